"""`dsv41 make-tiny`: real formats, every layer role, deterministic per seed; loads in every format."""

from __future__ import annotations

import hashlib
import subprocess
import sys

import pytest
import torch

from dsv41.config import ModelConfig
from dsv41.model.loader import load_model
from dsv41.tiny.model import make_tiny
from dsv41.weights import Checkpoint, Linear, ShardedWriter


def digest(folder) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(folder.iterdir())}


def test_every_layer_role_is_present(tiny_model_dir):
    cfg = ModelConfig.from_file(tiny_model_dir)
    modes = [r.mode for r in cfg.roles[:cfg.num_hidden_layers]]
    assert {"swa", "full", "reuse", "reindex"} <= set(modes)
    assert {cfg.compress_ratios[s] for s in cfg.kv_source_layer_ids} == {1, 2}
    ratio2_sources = [s for s in cfg.kv_source_layer_ids if cfg.compress_ratios[s] == 2]
    assert any(r.mode == "reuse" and r.kv_source in ratio2_sources for r in cfg.roles)
    cand = cfg.candidate_source_layer_id
    assert cfg.compress_ratios[cand] == 1 and any(r.uses_candidates for r in cfg.roles)
    assert len(cfg.engram_layer_ids) == 2 and cfg.n_dspark == 3
    assert cfg.hc_mult == 4 and cfg.hc_sinkhorn_iters == 20
    # top-k smaller than the visible compressed entries of a modest prompt (ratio 1 source: one per token)
    assert cfg.index_topk < 40 and cfg.candidate_topk_blocks * cfg.candidate_block_size < 40
    assert cfg.quant.is_exl3


def test_exl3_layout_matches_the_pack(tiny_model_dir):
    ckpt = Checkpoint(tiny_model_dir)
    names = set(ckpt.names())
    for group in ("layers.0.attn.wq_a", "layers.3.ffn.experts.1.w2", "layers.0.attn.wo_a.slice.1", "head",
                  "mtp.0.main_proj", "layers.1.engram.wkv"):
        assert {f"{group}.trellis", f"{group}.suh", f"{group}.svh", f"{group}.mul1"} <= names, group
    assert ckpt.dtype("layers.0.attn.wq_a.trellis") == "I16"
    assert ckpt.dtype("layers.1.engram.embed.weight") == "F8_E4M3"
    assert ckpt.dtype("embed.weight") == "BF16" and ckpt.dtype("layers.0.hc_attn_fn") == "F32"
    assert (tiny_model_dir / "model.safetensors.index.json").is_file()
    assert len(list(tiny_model_dir.glob("model-*-of-*.safetensors"))) > 1


def test_same_seed_same_bytes_other_seed_other_bytes(tmp_path):
    a, b, c = (make_tiny(tmp_path / n, "bf16", seed=s) for n, s in (("a", 3), ("b", 3), ("c", 4)))
    assert digest(a) == digest(b)
    assert digest(a)["config.json"] == digest(c)["config.json"] and digest(a) != digest(c)


def dequantized_copy(src, dst) -> None:
    """The same checkpoint with every FP8 / MXFP4 / EXL3 linear stored as its dequantised fp32 weight."""
    ckpt = Checkpoint(src)
    names = set(ckpt.names())
    dst.mkdir()
    for f in ("config.json", "tokenizer.json", "tokenizer_config.json"):
        (dst / f).write_bytes((src / f).read_bytes())
    with ShardedWriter(dst) as w:
        for name in sorted(names):
            prefix, _, part = name.rpartition(".")
            quantised = f"{prefix}.trellis" in names or (f"{prefix}.scale" in names and f"{prefix}.weight" in names)
            if ".engram.embed." in name or not quantised:  # Engram rows keep their own per-row FP8 format
                w.add(name, ckpt.get(name), dtype=ckpt.dtype(name))
            elif part in ("trellis", "weight"):
                w.add(f"{prefix}.weight", Linear.from_checkpoint(ckpt, prefix).dequantize(torch.float32))


@pytest.mark.parametrize("fmt", ["fp8", "exl3", "bf16"])
def test_every_format_computes_its_stored_weights(tmp_path, fmt, tiny_model_dir):
    """A quantised checkpoint gives the same logits as a plain checkpoint of its dequantised weights."""
    folder = tiny_model_dir if fmt == "exl3" else make_tiny(tmp_path / fmt, fmt, seed=1)
    if fmt == "fp8":
        ckpt = Checkpoint(folder)
        assert ckpt.dtype("layers.0.attn.wq_a.weight") == "F8_E4M3"
        assert ckpt.dtype("layers.0.attn.wq_a.scale") in ("F8_E8M0", "U8")
        assert ckpt.dtype("layers.0.ffn.experts.0.w1.weight") == "I8"
    model = load_model(folder)
    ids = model.tokenizer.encode("<｜begin▁of▁sentence｜>Hello world, this is a tiny model.")
    logits = model.forward(model.new_state(), torch.tensor(ids))
    assert logits.shape == (len(ids), model.cfg.vocab_size) and torch.isfinite(logits).all()
    if fmt != "bf16":
        dequantized_copy(folder, tmp_path / "plain")
        plain = load_model(tmp_path / "plain")
        assert Checkpoint(tmp_path / "plain").dtype("layers.0.attn.wq_a.weight") == "F32"
        ref = plain.forward(plain.new_state(), torch.tensor(ids))
        assert float((logits - ref).norm() / ref.norm()) < 1e-5


def test_make_tiny_cli(tmp_path):
    r = subprocess.run([sys.executable, "-m", "dsv41.cli", "make-tiny", str(tmp_path / "m"), "--format", "bf16",
                        "--seed", "7"], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    assert ModelConfig.from_file(tmp_path / "m").num_hidden_layers > 0


def test_bench_cli_reports_speeds():
    import json as _json
    r = subprocess.run([sys.executable, "-m", "dsv41.cli", "bench", "--prompt-tokens", "20", "--chunk", "8",
                        "--tokens", "4"], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    result = _json.loads(r.stdout.strip().splitlines()[-1])
    assert result["prefill_tok_s"] > 0 and result["decode_tok_s"] > 0 and result["decode_tokens"] == 4


def test_generate_cli_prints_text_and_speed():
    r = subprocess.run([sys.executable, "-m", "dsv41.cli", "generate", "--prompt", "The quick brown fox",
                        "--max-tokens", "8", "--ignore-eos"], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip()  # the continuation
    assert "8 generated" in r.stderr and "tok/s" in r.stderr
    again = subprocess.run([sys.executable, "-m", "dsv41.cli", "generate", "--prompt", "The quick brown fox",
                            "--max-tokens", "8", "--ignore-eos"], capture_output=True, text=True, timeout=300)
    assert again.stdout == r.stdout  # greedy by default: the same continuation
