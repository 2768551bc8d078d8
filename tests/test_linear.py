"""Linear: format detection, dequant against independent readers, EXL3 orientation against the golden layers,
tensor-parallel slices (whole blocks, uneven), shape errors naming the tensor, the dequant cache."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file

from dsv41.errors import CheckpointError
from dsv41.weights import Checkpoint, Linear, ShardedWriter, split_sizes, write_linear
from dsv41.weights import exl3, formats
from dsv41.weights.linear import split_range
from dsv41.weights.writer import random_exl3_group

FIXTURES = Path(__file__).resolve().parents[1].parent / "shared" / "fixtures" / "exl3"
ALL_FORMATS = ("bf16", "fp16", "fp32", "fp8", "mxfp4", "exl3")
FMT_NAME = {"bf16": "native", "fp16": "native", "fp32": "native", "fp8": "fp8", "mxfp4": "mxfp4", "exl3": "exl3"}

OUT, IN = 384, 640  # 3 x 5 Hadamard blocks, 12 x 20 FP8 blocks


@pytest.fixture(scope="module")
def weights_dir(tmp_path_factory):
    folder = tmp_path_factory.mktemp("linear")
    W = torch.randn(OUT, IN, generator=torch.Generator().manual_seed(5)) * 0.02
    W[:, :IN // 2] *= 3  # uneven column magnitudes so misplaced blocks would show
    with ShardedWriter(folder, max_shard_bytes=400_000) as writer:
        for fmt in ALL_FORMATS:
            write_linear(writer, f"layers.0.{fmt}", W, fmt, K=3)
    return folder, W


def stored_group(folder: Path, prefix: str) -> dict[str, torch.Tensor]:
    """The group's tensors read back through the official safetensors library (independent of Checkpoint)."""
    out = {}
    for path in folder.glob("*.safetensors"):
        with safe_open(str(path), "pt") as f:
            out.update({k[len(prefix) + 1:]: f.get_tensor(k) for k in f.keys() if k.startswith(prefix + ".")})
    return out


@pytest.mark.parametrize("fmt", ALL_FORMATS)
def test_loaded_linear_matches_its_stored_tensors(weights_dir, fmt):
    folder, W = weights_dir
    layer = Linear.from_checkpoint(Checkpoint(folder), f"layers.0.{fmt}", expected_shape=(OUT, IN))
    assert (layer.fmt, layer.out_features, layer.in_features) == (FMT_NAME[fmt], OUT, IN)
    g = stored_group(folder, f"layers.0.{fmt}")
    if fmt == "exl3":
        expected = exl3.effective_weight(g["trellis"], g["suh"], g["svh"], "mul1").T
        assert layer.codebook == "mul1" and set(g) == {"trellis", "suh", "svh", "mul1"}
    elif fmt == "fp8":
        expected = formats.dequant_fp8_block(g["weight"], g["scale"])
    elif fmt == "mxfp4":
        expected = formats.dequant_mxfp4(g["weight"], g["scale"])
    else:
        expected = g["weight"].float()
    dense = layer.materialize()
    assert dense.shape == (OUT, IN) and torch.equal(dense, expected)
    # Every format stands for W: lossy ones within their precision; EXL3 only matches its RMS (random trellis).
    rel = ((dense - W).norm() / W.norm()).item()
    bound = {"fp32": 0, "fp16": 1e-3, "bf16": 5e-3, "fp8": 0.05, "mxfp4": 0.2}.get(fmt)
    if bound is not None:
        assert rel <= bound
    else:
        assert abs(dense.pow(2).mean().sqrt() / W.pow(2).mean().sqrt() - 1) < 2e-3
    x = torch.randn(3, IN)
    assert torch.allclose(layer(x), x @ expected.T, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("path", sorted(FIXTURES.glob("*.safetensors"))[::5], ids=lambda p: p.stem)
def test_exl3_linear_orientation_against_golden_layers(tmp_path, path):
    tensors = load_file(str(path))
    with ShardedWriter(tmp_path) as writer:
        for key, t in tensors.items():
            if key.startswith("layer."):
                writer.add("layers.3.attn.wq_b." + key.removeprefix("layer."), t)
    k, n = tensors["ref.w_eff"].shape
    layer = Linear.from_checkpoint(Checkpoint(tmp_path), "layers.3.attn.wq_b", expected_shape=(n, k))
    ref = tensors["ref.w_eff"].double()
    dense = layer.materialize(torch.float64)
    assert ((dense.T - ref).norm() / ref.norm()).item() <= 1e-6
    y = layer(tensors["ref.x"].double()).float()
    assert ((y - tensors["ref.y"]).norm() / tensors["ref.y"].norm()).item() <= 1e-3


# ---- tensor parallel ------------------------------------------------------------------------------------------


def test_split_sizes():
    assert split_sizes(7 * 128, 2, 128) == [512, 384]
    assert split_sizes(100, 3, 32) == [64, 32, 4]  # 4 blocks, the last one partial
    assert split_sizes(10, 3) == [4, 3, 3]
    assert split_range(7 * 128, 2, 1, 128) == (512, 896)
    with pytest.raises(ValueError, match="cannot split 128 into 2 parts of whole 128-blocks"):
        split_sizes(128, 2, 128)


@pytest.mark.parametrize("fmt", ALL_FORMATS)
@pytest.mark.parametrize("world", [2, 3])
def test_tensor_parallel_slices_reassemble_the_layer(weights_dir, fmt, world):
    folder, _ = weights_dir
    ckpt = Checkpoint(folder)
    prefix = f"layers.0.{fmt}"
    full = Linear.from_checkpoint(ckpt, prefix)
    x = torch.randn(2, IN, dtype=torch.float64)
    y_full = full(x)

    # EXL3 rotates per 128-block, so a slice differs from the whole only by fp32 summation order.
    same = torch.equal if fmt != "exl3" else lambda a, b: torch.allclose(a, b, rtol=0, atol=1e-6 * b.abs().max())
    cols = [Linear.from_checkpoint(ckpt, prefix, split="col", rank=r, world=world) for r in range(world)]
    assert sum(c.out_features for c in cols) == OUT and all(c.in_features == IN for c in cols)
    assert same(torch.cat([c.materialize() for c in cols], dim=0), full.materialize())
    assert torch.allclose(torch.cat([c(x) for c in cols], dim=-1), y_full)

    rows = [Linear.from_checkpoint(ckpt, prefix, split="row", rank=r, world=world) for r in range(world)]
    assert sum(r.in_features for r in rows) == IN
    assert same(torch.cat([r.materialize() for r in rows], dim=1), full.materialize())
    starts = [0]
    for r in rows:
        starts.append(starts[-1] + r.in_features)
    partial = sum(r(x[:, starts[i]:starts[i + 1]]) for i, r in enumerate(rows))
    assert torch.allclose(partial, y_full)

    unit = {"exl3": 128, "fp8": 32}.get(fmt, 1)
    for part in cols[:-1]:
        assert part.out_features % unit == 0
    if fmt == "exl3":  # only the slice was read: trellis tiles and the split side's scales
        assert cols[0].tensors["trellis"].shape[1] * 16 == cols[0].out_features
        assert cols[0].tensors["suh"].shape == (IN,) and cols[0].tensors["svh"].shape == (cols[0].out_features,)
        assert rows[0].tensors["suh"].shape == (rows[0].in_features,) and rows[0].tensors["svh"].shape == (OUT,)
    if fmt == "mxfp4":
        assert rows[0].in_features % 32 == 0 and rows[0].tensors["weight"].shape[1] * 2 == rows[0].in_features


def test_split_block_override(weights_dir):
    ckpt = Checkpoint(weights_dir[0])
    part = Linear.from_checkpoint(ckpt, "layers.0.fp8", split="col", rank=0, world=2, block=128)
    assert part.out_features == 256
    with pytest.raises(ValueError, match="not a multiple of fp8's 32"):
        Linear.from_checkpoint(ckpt, "layers.0.fp8", split="col", rank=0, world=2, block=48)
    with pytest.raises(CheckpointError, match="cannot split 640 into 6 parts"):
        Linear.from_checkpoint(ckpt, "layers.0.exl3", split="row", rank=0, world=6)


# ---- errors ---------------------------------------------------------------------------------------------------


def test_wrong_shape_names_the_linear(weights_dir):
    ckpt = Checkpoint(weights_dir[0])
    for fmt in ALL_FORMATS:
        with pytest.raises(CheckpointError, match=rf"'layers\.0\.{fmt}'.*\[384, 640\].*\[640, 384\]"):
            Linear.from_checkpoint(ckpt, f"layers.0.{fmt}", expected_shape=(IN, OUT))


def test_missing_linear_names_the_prefix(weights_dir):
    with pytest.raises(CheckpointError, match=r"'layers\.7\.attn\.wkv'.*\.weight.*\.trellis"):
        Linear.from_checkpoint(Checkpoint(weights_dir[0]), "layers.7.attn.wkv")


def damaged(tmp_path: Path, group: dict[str, torch.Tensor], prefix: str = "layers.1.ffn.w2") -> Checkpoint:
    with ShardedWriter(tmp_path) as writer:
        for part, t in group.items():
            writer.add(f"{prefix}.{part}", t, dtype="F8_E8M0" if part == "scale" else None)
    return Checkpoint(tmp_path)


def test_fp8_without_scale_or_with_wrong_scale(tmp_path):
    q, scale = formats.quantize_fp8_block(torch.randn(64, 96))
    ckpt = damaged(tmp_path / "a", {"weight": q})
    with pytest.raises(CheckpointError, match=r"'layers\.1\.ffn\.w2\.scale'.*missing"):
        Linear.from_checkpoint(ckpt, "layers.1.ffn.w2")
    ckpt = damaged(tmp_path / "b", {"weight": q, "scale": scale[:, :2]})
    with pytest.raises(CheckpointError, match=r"'layers\.1\.ffn\.w2\.scale': shape \[2, 2\], expected \[2, 3\]"):
        Linear.from_checkpoint(ckpt, "layers.1.ffn.w2")


def test_exl3_group_errors(tmp_path):
    group = random_exl3_group(torch.randn(128, 256), K=2)
    bad_marker = dict(group, mul1=torch.tensor(12345, dtype=torch.int32))
    with pytest.raises(CheckpointError, match=r"layers\.1\.ffn\.w2\.mul1: marker value 12345"):
        Linear.from_checkpoint(damaged(tmp_path / "a", bad_marker), "layers.1.ffn.w2")
    short_svh = dict(group, svh=group["svh"][:64])
    with pytest.raises(CheckpointError, match=r"'layers\.1\.ffn\.w2\.svh': shape \[64\], expected \[128\]"):
        Linear.from_checkpoint(damaged(tmp_path / "b", short_svh), "layers.1.ffn.w2")
    odd_k = dict(group, trellis=torch.zeros(16, 8, 72, dtype=torch.int16))
    with pytest.raises(CheckpointError, match=r"'layers\.1\.ffn\.w2\.trellis'.*K=4\.5"):
        Linear.from_checkpoint(damaged(tmp_path / "c", odd_k), "layers.1.ffn.w2")


def test_random_exl3_group_is_valid_and_has_the_weights_rms():
    W = torch.randn(256, 384) * 0.05
    W[:128] *= 4  # per-output-channel magnitudes should carry over through svh
    for codebook, K in [("mul1", 2.5), ("mcg", 3), ("3inst", 1)]:
        group = random_exl3_group(W, K=K, codebook=codebook, generator=torch.Generator().manual_seed(1))
        assert group["trellis"].shape == (384 // 16, 256 // 16, int(16 * K))
        assert exl3.codebook_from_group(group) == codebook
        w_eff = exl3.effective_weight(group["trellis"], group["suh"], group["svh"], codebook).T
        assert abs(w_eff.pow(2).mean().sqrt() / W.pow(2).mean().sqrt() - 1) < 2e-3
        assert w_eff[:128].pow(2).mean() > 8 * w_eff[128:].pow(2).mean()
    with pytest.raises(ValueError, match="divisible by 128"):
        random_exl3_group(torch.randn(100, 256))
    with pytest.raises(ValueError, match="only for the mul1"):
        random_exl3_group(W, K=2.5, codebook="mcg")


# ---- cache ----------------------------------------------------------------------------------------------------


def test_materialize_caches_one_dense_copy():
    w = torch.randn(8, 16)
    layer = Linear.from_tensor(w, "t")
    assert (layer.fmt, layer.out_features, layer.in_features) == ("native", 8, 16)
    first = layer.materialize()
    assert layer.materialize() is first
    half = layer.materialize(torch.bfloat16)
    assert half.dtype == torch.bfloat16 and layer.materialize(torch.bfloat16) is half
    layer.release()
    assert layer.materialize(torch.bfloat16) is not half
    x = torch.randn(4, 16)
    assert torch.allclose(layer(x), x @ w.T)
    with pytest.raises(ValueError, match="t: input has 15 features, layer expects 16"):
        layer(torch.randn(2, 15))
