"""`dsv41 make-tiny`: a complete, small DeepSeek-V4.1 checkpoint folder in the real formats.

The real model's structure scaled down, with every layer role present (MODEL.md §2): SWA-only layers, ratio-2
KV sources followed by reuse layers, a ratio-1 candidate source, a re-indexing layer and a reuse of it, two
Engram layers, three DSpark blocks fed by the last three layers, 4 mHC streams with 20 Sinkhorn iterations, and an
index top-k smaller than the visible compressed entries of any prompt beyond a few dozen tokens. Every EXL3 matrix
dimension is a multiple of 128 so that all formats can store every linear; widths split evenly at TP = 1/2/4/8.

Formats (`--format`):
- `exl3`: the EXL3 pack's layout (per-expert groups, `wo_a.slice.{g}`, K per role as in the pack, native norms,
  router, embedding, mHC, Markov/confidence heads; FP8 Engram tables). This is the built-in default.
- `fp8`: the release's layout (FP8 e4m3 + ue8m0 32x32 blocks, MXFP4 routed experts, bf16 natives).
- `bf16`: everything bf16 (mHC fp32).
The weights are random (seeded): EXL3 groups are random valid trellises (see weights/writer.py).
"""

from __future__ import annotations

import json
import math
import os
import shutil
import tempfile
from pathlib import Path

import torch

from .errors import DSV41Error
from .weights.writer import ShardedWriter, write_linear

FORMATS = ("exl3", "fp8", "bf16")
DEFAULT_FORMAT = "exl3"

N_LAYERS = 9
TINY_TEXT_CONFIG = {
    "model_type": "deepseek_v41_text",
    "vocab_size": 512,
    "hidden_size": 256,
    "moe_intermediate_size": 512,
    "num_hidden_layers": N_LAYERS,
    "num_attention_heads": 4,
    "num_key_value_heads": 1,
    "head_dim": 128,
    "qk_rope_head_dim": 64,
    "q_lora_rank": 128,
    "o_lora_rank": 128,
    "o_groups": 2,
    "hidden_act": "silu",
    "swiglu_limit": 10.0,
    "rms_norm_eps": 1e-20,
    "tie_word_embeddings": False,
    "max_position_embeddings": 1048576,
    "rope_theta": 10000.0,
    "rope_scaling": {"rope_type": "yarn", "factor": 16, "beta_fast": 32, "beta_slow": 1,
                     "original_max_position_embeddings": 65536},
    "compress_rope_theta": 160000.0,
    "n_routed_experts": 4,
    "n_shared_experts": 1,
    "num_experts_per_tok": 2,
    "scoring_func": "sqrtsoftplus",
    "topk_method": "noaux_tc",
    "norm_topk_prob": True,
    "routed_scaling_factor": 1.5,
    "sliding_window": 16,
    # layers 0-1 SWA only; 2 and 4 ratio-2 sources (3, 5 reuse); 6 ratio-1 candidate source; 7 re-indexes, 8 reuses
    "compress_ratios": [0, 0, 2, 2, 2, 2, 1, 1, 1, 0, 0, 0],
    "kv_source_layer_ids": [2, 4, 6],
    "index_source_layer_ids": [2, 4, 6, 7],
    "index_n_heads": 4,
    "index_head_dim": 128,
    "index_topk": 8,
    "candidate_source_layer_id": 6,
    "candidate_topk_blocks": 3,
    "candidate_block_size": 4,
    "hc_mult": 4,
    "hc_sinkhorn_iters": 20,
    "hc_eps": 1e-6,
    "engram_layer_ids": [1, 4],
    "engram_max_ngram_size": 4,
    "engram_vocab_size": 600,
    "engram_n_heads": 8,
    "engram_head_dim": 128,
    "engram_pad_token_id": 2,
    "num_nextn_predict_layers": 3,
    "dspark_block_size": 5,
    "dspark_target_layer_ids": [6, 7, 8],
    "dspark_markov_rank": 64,
    "dspark_n_routed_experts": 4,
    "dspark_num_experts_per_tok": 2,
    "bos_token_id": 0,
    "eos_token_id": 1,
}
EXL3_QUANT = {"quant_method": "exl3", "version": "1.4.2", "bits": 2.9, "head_bits": 6, "mtp_bits": 4,
              "codebook": "mul1"}
FP8_QUANT = {"quant_method": "fp8", "activation_scheme": "dynamic", "weight_block_size": [32, 32],
             "scale_fmt": "ue8m0", "expert_dtype": "fp4"}


def default_model_dir() -> Path:
    """The built-in tiny model, created on first use under $DSV41_HOME (default ~/.cache/dsv41)."""
    home = Path(os.environ.get("DSV41_HOME", Path.home() / ".cache" / "dsv41"))
    folder = home / f"tiny-{DEFAULT_FORMAT}-seed0"
    if not (folder / "model.safetensors.index.json").is_file():
        make_tiny(folder, DEFAULT_FORMAT, seed=0)
    return folder


def make_tiny(out_dir: str | Path, fmt: str = DEFAULT_FORMAT, seed: int = 0) -> Path:
    """Write the tiny checkpoint to `out_dir` (atomically: built beside it, then renamed into place)."""
    if fmt not in FORMATS:
        raise DSV41Error(f"make-tiny: unknown format {fmt!r}; expected one of {', '.join(FORMATS)}")
    out_dir = Path(out_dir)
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.", dir=out_dir.parent))
    try:
        _write(tmp, fmt, seed)
        if out_dir.exists():
            shutil.rmtree(out_dir)
        tmp.rename(out_dir)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return out_dir


class _Init:
    """Seeded random tensors with scales chosen so that no mechanism is degenerate."""

    def __init__(self, seed: int):
        self.g = torch.Generator().manual_seed(seed)
        self.seed = seed

    def normal(self, *shape, std: float = 1.0, mean: float = 0.0) -> torch.Tensor:
        return torch.randn(*shape, generator=self.g) * std + mean

    def uniform(self, *shape, lo: float, hi: float) -> torch.Tensor:
        return torch.rand(*shape, generator=self.g) * (hi - lo) + lo

    def proj(self, out_f: int, in_f: int, gain: float = 1.0) -> torch.Tensor:
        return self.normal(out_f, in_f, std=gain / math.sqrt(in_f))

    def exl3_generator(self, name: str) -> torch.Generator:
        return torch.Generator().manual_seed((self.seed * 1_000_003 + sum(name.encode()) * 7919) % 2**62)


def _write(folder: Path, fmt: str, seed: int) -> None:
    from .model.engram import EngramConstants, build_compressed_token_map, quantize_rows_fp8
    from .tiny_tokenizer import PLACEHOLDER, build_tiny_tokenizer
    from .tokenizer import Tokenizer
    from .config import ModelConfig

    build_tiny_tokenizer(folder)
    tok = Tokenizer.from_dir(folder)
    _, compressed = build_compressed_token_map(tok)
    text = dict(TINY_TEXT_CONFIG)
    text["engram_compressed_vocab_size"] = compressed
    text["dspark_noise_token_id"] = tok.token_to_id(PLACEHOLDER.format(0))
    text["image_token_id"] = tok.token_to_id("<｜deepseek_image｜>")
    text["engram_num_embeddings"] = _engram_rows(text)
    config = {"architectures": ["DeepseekV41ForCausalLM"], "model_type": "deepseek_v41",
              "image_token_id": text["image_token_id"], "tie_word_embeddings": False,
              "torch_dtype": "bfloat16", "text_config": text}
    if fmt == "exl3":
        config["quantization_config"] = EXL3_QUANT
    elif fmt == "fp8":
        config["quantization_config"] = FP8_QUANT
    (folder / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    cfg = ModelConfig.from_file(folder)
    init = _Init(seed)
    with ShardedWriter(folder, max_shard_bytes=8 * 1024**2) as w:
        _write_weights(w, cfg, fmt, init, EngramConstants.from_config(cfg), quantize_rows_fp8)


def _engram_rows(text: dict) -> list[int]:
    from types import SimpleNamespace
    from .model.engram import engram_primes
    ns = SimpleNamespace(**{**text, "engram_num_embeddings": [0] * len(text["engram_layer_ids"])})
    return [int(s) for s in engram_primes(ns).flatten(1).sum(dim=1)]


def _linear_fmt(fmt: str, role: str) -> tuple[str, dict]:
    """Storage of one linear by format and role (EXL3 bits per role follow the pack's K map)."""
    if fmt == "bf16":
        return "bf16", {}
    if fmt == "fp8":
        if role == "expert":
            return "mxfp4", {}
        if role in ("compressor", "index_wk", "head"):
            return "bf16", {}
        return "fp8", {}
    K = {"expert": 3, "expert_mid": 2, "shared": 5, "attn": 5, "compressor": 5, "index_wk": 8, "engram": 5,
         "head": 6, "mtp": 4}[role]
    return "exl3", {"K": K, "codebook": "mul1"}


def _write_weights(w: ShardedWriter, cfg, fmt: str, init: _Init, engram_constants, quantize_rows_fp8) -> None:
    d, V = cfg.hidden_size, cfg.vocab_size

    def lin(prefix: str, W: torch.Tensor, role: str) -> None:
        f, opts = _linear_fmt(fmt, role)
        if f == "exl3":
            opts["generator"] = init.exl3_generator(prefix)
        write_linear(w, prefix, W, f, **opts)

    def nat(name: str, t: torch.Tensor) -> None:  # norms, router, Markov/confidence heads: bf16 as released
        w.add(name, t.to(torch.bfloat16))

    w.add("embed.weight", init.normal(V, d).to(torch.bfloat16))
    for L in range(cfg.num_hidden_layers + cfg.n_dspark):
        role = cfg.role(L)
        mtp = role.is_dspark
        prefix = f"mtp.{L - cfg.num_hidden_layers}." if mtp else f"layers.{L}."
        _write_layer(w, cfg, role, prefix, lin, nat, init, fmt, mtp)
        if not mtp and L in cfg.engram_layer_ids:
            _write_engram(w, cfg, L, lin, nat, init, fmt, engram_constants, quantize_rows_fp8)
    if cfg.n_dspark:
        n_taps, r = len(cfg.dspark_target_layer_ids), cfg.dspark_markov_rank
        last = f"mtp.{cfg.n_dspark - 1}."
        lin("mtp.0.main_proj", init.proj(d, n_taps * d), "mtp")
        nat("mtp.0.main_norm.weight", init.normal(d, std=0.1, mean=1.0))
        nat(f"{last}norm.weight", init.normal(d, std=0.1, mean=1.0))
        nat(f"{last}markov_head.embed.weight", init.normal(V, r))
        nat(f"{last}markov_head.head.weight", init.normal(V, r, std=0.5 / math.sqrt(r)))
        nat(f"{last}confidence_head.proj.weight", init.normal(1, d + r, std=1 / math.sqrt(d + r)))
    nat("norm.weight", init.normal(d, std=0.1, mean=1.0))
    lin("head", init.proj(V, d), "head")


def _write_layer(w, cfg, role, prefix, lin, nat, init: _Init, fmt: str, mtp: bool) -> None:
    d, hd, H, G = cfg.hidden_size, cfg.head_dim, cfg.num_attention_heads, cfg.o_groups
    ql, ol, hc = cfg.q_lora_rank, cfg.o_lora_rank, cfg.hc_mult
    a = prefix + "attn."
    attn_role = "mtp" if mtp else "attn"
    nat(f"{prefix}attn_norm.weight", init.normal(d, std=0.1, mean=1.0))
    nat(f"{prefix}ffn_norm.weight", init.normal(d, std=0.1, mean=1.0))
    mix = (2 + hc) * hc
    for site in ("attn", "ffn"):
        w.add(f"{prefix}hc_{site}_fn", init.normal(mix, hc * d, std=1 / math.sqrt(hc * d)))
        w.add(f"{prefix}hc_{site}_base", init.normal(mix, std=0.5))
        w.add(f"{prefix}hc_{site}_scale", init.uniform(3, lo=0.5, hi=1.5))
    w.add(f"{a}attn_sink", init.normal(H))
    lin(f"{a}wq_a", init.proj(ql, d), attn_role)
    nat(f"{a}q_norm.weight", init.normal(ql, std=0.1, mean=1.0))
    lin(f"{a}wq_b", init.proj(H * hd, ql, gain=1.5), attn_role)
    lin(f"{a}wkv", init.proj(hd, d), attn_role)
    nat(f"{a}kv_norm.weight", init.normal(hd, std=0.1, mean=1.0))
    wo_a = init.proj(G * ol, (H // G) * hd)
    if fmt == "exl3":  # the pack stores one EXL3 group per output group
        for g in range(G):
            lin(f"{a}wo_a.slice.{g}", wo_a[g * ol:(g + 1) * ol], attn_role)
    else:
        lin(f"{a}wo_a", wo_a, attn_role)
    lin(f"{a}wo_b", init.proj(d, G * ol), attn_role)
    if role.compresses:
        c = a + "compressor."
        lin(f"{c}wkv", init.proj(hd, d), "compressor")
        if role.compress_ratio > 1:
            lin(f"{c}wgate", init.proj(hd, d, gain=2.0), "compressor")
        nat(f"{c}norm.weight", init.normal(hd, std=0.1, mean=1.0))
        if role.scores:
            lin(f"{a}indexer.wk", init.proj(cfg.index_head_dim, hd), "index_wk")
            nat(f"{a}indexer.k_norm.weight", init.normal(cfg.index_head_dim, std=0.1, mean=1.0))
    if role.scores:
        lin(f"{a}indexer.wq_b", init.proj(cfg.index_n_heads * cfg.index_head_dim, ql), attn_role)
        nat(f"{a}indexer.weights_proj.weight", init.proj(cfg.index_n_heads, d))

    f = prefix + "ffn."
    E = cfg.dspark_n_routed_experts if mtp else cfg.n_routed_experts
    inter = cfg.moe_intermediate_size
    nat(f"{f}gate.weight", init.proj(E, d, gain=2.0))
    w.add(f"{f}gate.bias", init.normal(E, std=0.3))
    w.add(f"{f}gate.bias_vl", init.normal(E, std=0.3))
    middle = not mtp and role.index == cfg.num_hidden_layers // 2
    expert_role = "mtp" if mtp else ("expert_mid" if middle else "expert")
    for e in range(E):
        _write_expert(lin, f"{f}experts.{e}.", init, d, inter, expert_role)
    _write_expert(lin, f"{f}shared_experts.", init, d, inter, "mtp" if mtp else "shared")


def _write_expert(lin, p: str, init: _Init, d: int, inter: int, role: str) -> None:
    lin(f"{p}w1", init.normal(inter, d, std=4 / math.sqrt(d)), role)
    lin(f"{p}w3", init.normal(inter, d, std=4 / math.sqrt(d)), role)
    lin(f"{p}w2", init.normal(d, inter, std=0.1 / math.sqrt(inter)), role)


def _write_engram(w, cfg, L, lin, nat, init: _Init, fmt: str, constants, quantize_rows_fp8) -> None:
    e = f"layers.{L}.engram."
    rows = constants.num_rows[constants.layer_index(L)]
    table = init.normal(rows, cfg.engram_head_dim)
    if fmt == "bf16":
        w.add(f"{e}embed.weight", table.to(torch.bfloat16))
    else:
        q, scale = quantize_rows_fp8(table)
        w.add(f"{e}embed.weight", q.view(torch.float8_e4m3fn))
        w.add(f"{e}embed.scale", scale, dtype="F8_E8M0")
    d, hc = cfg.hidden_size, cfg.hc_mult
    lin(f"{e}wkv", init.proj((hc + 1) * d, constants.n_cols * constants.head_dim), "engram")
    nat(f"{e}q_weight", init.normal(hc, d))
    nat(f"{e}k_weight", init.normal(hc, d))
