"""EXL3 reference decoder vs ExLlamaV3's own golden layers (../shared/fixtures/exl3) and vs slow,
literal re-readings of the format notes (spec/EXL3-ENGRAM.md §1-2)."""

from __future__ import annotations

import ast
import os
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from safetensors import safe_open

from dsv41.errors import CheckpointError
from dsv41.weights import exl3

REPO = Path(__file__).resolve().parents[1]
FIXTURES = REPO.parent / "shared" / "fixtures" / "exl3"
FIXTURE_FILES = sorted(FIXTURES.glob("*.safetensors"))


def load_fixture(path: Path) -> tuple[dict, dict, dict]:
    with safe_open(str(path), "pt") as f:
        tensors = {key: f.get_tensor(key) for key in f.keys()}
        meta = f.metadata()
    group = {key.removeprefix("layer."): t for key, t in tensors.items() if key.startswith("layer.")}
    ref = {key.removeprefix("ref."): t for key, t in tensors.items() if key.startswith("ref.")}
    return group, ref, meta


def test_fixture_set_is_complete():
    assert len(FIXTURE_FILES) >= 28, f"expected at least the 28 EXL3 fixtures in {FIXTURES}, found {len(FIXTURE_FILES)}"


# ---- codebooks ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "codebook,rms,distinct", [("3inst", 1.2437, 10598), ("mcg", 1.2441, 10746), ("mul1", 1.0003, 913)]
)
def test_codebook_table_statistics_match_spec(codebook, rms, distinct):
    table = exl3.codebook_table(codebook)
    assert table.dtype == torch.float16 and table.shape == (65536,)
    assert abs(table.double().pow(2).mean().sqrt().item() - rms) < 5e-5
    assert table.unique().numel() == distinct


def _slow_codebook_value(codebook: str, s: int) -> np.float16:
    """One state through the §2.1 recipe with Python ints and numpy's correctly rounded fp16 arithmetic."""

    def half(bits: int) -> np.float16:
        return np.array([bits & 0xFFFF], dtype=np.uint16).view(np.float16)[0]

    if codebook == "mul1":
        x = (s * 0x83DCD12D) % 2**32
        h = 1024 + sum((x >> shift) & 0xFF for shift in (0, 8, 16, 24))
        exact = h * float(half(0x1EEE)) + float(half(0xC931))  # exact in double, then one rounding
        return np.float16(exact)
    x = (s * 89226354 + 64248484) % 2**32 if codebook == "3inst" else (s * 0xCBAC1FED) % 2**32
    x = (x & 0x8FFF8FFF) ^ 0x3B603B60
    return half(x) + half(x >> 16)  # numpy fp16 + fp16: one correctly rounded fp16 addition


@pytest.mark.parametrize("codebook", exl3.CODEBOOKS)
def test_codebook_table_matches_scalar_recipe(codebook):
    table = exl3.codebook_table(codebook).numpy()
    states = list(range(0, 65536, 97)) + [0, 1, 0x7FFF, 0x8000, 0xFFFF]
    for s in states:
        expected = _slow_codebook_value(codebook, s)
        assert table[s].view(np.uint16) == expected.view(np.uint16), (codebook, s, table[s], expected)


def test_unknown_codebook_is_rejected():
    with pytest.raises(ValueError, match="unknown EXL3 codebook"):
        exl3.codebook_table("2mad")


# ---- bit stream --------------------------------------------------------------------------------------------


def _slow_states(tile_words: np.ndarray, K: float) -> list[int]:
    """§1.3 read literally: explicit bit list, windows ending at E(p), indices mod R."""
    words = [int(w) & 0xFFFF for w in tile_words]
    u32 = [words[2 * m] | (words[2 * m + 1] << 16) for m in range(len(words) // 2)]
    bits = [(u >> (31 - b)) & 1 for u in u32 for b in range(32)]
    total = len(bits)
    states = []
    for p in range(256):
        if float(K).is_integer():
            end = (p + 1) * int(K)
        else:
            ka = int(K - 0.5)
            end = ((p + 1) * (2 * ka + 1) - ((p + 1) % 2)) // 2
        value = 0
        for b in range(end - 16, end):
            value = (value << 1) | bits[b % total]
        states.append(value)
    return states


@pytest.mark.parametrize("K", [1, 2, 3, 4, 5, 6, 7, 8, 1.5, 2.5, 3.5])
def test_decode_states_matches_literal_bit_stream(K):
    gen = torch.Generator().manual_seed(int(K * 10))
    trellis = torch.randint(-32768, 32768, (2, 3, int(16 * K)), dtype=torch.int32, generator=gen).to(torch.int16)
    states = exl3.decode_states(trellis)
    assert states.shape == (2, 3, 256)
    for tk in range(2):
        for tn in range(3):
            assert states[tk, tn].tolist() == _slow_states(trellis[tk, tn].numpy(), K)


@pytest.mark.parametrize("K", [2, 3, 5])
def test_states_follow_the_shift_register_recurrence(K):
    trellis = torch.randint(-32768, 32768, (1, 1, 16 * K), dtype=torch.int32).to(torch.int16)
    states = exl3.decode_states(trellis)[0, 0]
    previous = torch.roll(states, 1)  # state_{-1} = state_255 (tail-biting)
    assert torch.equal(states >> K, previous & ((1 << (16 - K)) - 1))


def test_bits_per_weight_rejects_bad_widths():
    assert exl3.bits_per_weight(torch.zeros(1, 1, 40, dtype=torch.int16)) == 2.5
    with pytest.raises(CheckpointError, match="K=4.5"):
        exl3.bits_per_weight(torch.zeros(1, 1, 72, dtype=torch.int16))
    with pytest.raises(CheckpointError, match="K=9"):
        exl3.bits_per_weight(torch.zeros(1, 1, 144, dtype=torch.int16))
    with pytest.raises(CheckpointError, match="3-d"):
        exl3.bits_per_weight(torch.zeros(16, 48, dtype=torch.int16))


# ---- tile permutation and Hadamard ---------------------------------------------------------------------------


def test_tile_position_map_is_the_spec_permutation_and_its_inverse():
    row, col = exl3.tile_position_map()
    assert sorted((row * 16 + col).tolist()) == list(range(256))
    for p in range(256):
        r, c = int(row[p]), int(col[p])
        lane = 4 * (c % 8) + (r % 8) // 2
        j = (r % 2) + 2 * (r // 8) + 4 * (c // 8)
        assert 8 * lane + j == p


def test_hadamard_is_sylvester_and_orthonormal():
    h = exl3.hadamard_128(torch.float64)
    for i, j in [(0, 0), (1, 1), (3, 5), (127, 127), (64, 63), (100, 37)]:
        assert h[i, j].item() == pytest.approx((-1) ** bin(i & j).count("1") / 128**0.5)
    assert torch.allclose(h @ h, torch.eye(128, dtype=torch.float64), atol=1e-12)
    assert torch.equal(h, h.T)


def test_rotate_blocks_acts_per_block_along_the_given_dim():
    x = torch.randn(3, 256, dtype=torch.float64)
    h = exl3.hadamard_128(torch.float64)
    expected = torch.cat([x[:, :128] @ h, x[:, 128:] @ h], dim=1)
    assert torch.allclose(exl3.rotate_blocks(x, 1), expected)
    assert torch.allclose(exl3.rotate_blocks(x.T, 0), expected.T)
    with pytest.raises(CheckpointError, match="multiple of the 128"):
        exl3.rotate_blocks(torch.zeros(3, 96), 1)


# ---- markers --------------------------------------------------------------------------------------------------


def test_codebook_from_group_markers():
    assert exl3.codebook_from_group({"trellis": 0, "suh": 0, "svh": 0}) == "3inst"
    assert exl3.codebook_from_group({"x.mul1": torch.tensor(-2082680531, dtype=torch.int32)}) == "mul1"
    assert exl3.codebook_from_group({"mcg": torch.tensor(-877912083, dtype=torch.int32)}) == "mcg"
    with pytest.raises(CheckpointError, match=r"layers\.3\.w1\.mul1: marker value 7"):
        exl3.codebook_from_group({"mul1": torch.tensor(7, dtype=torch.int32)}, "layers.3.w1")
    with pytest.raises(CheckpointError, match="both codebook markers"):
        exl3.codebook_from_group({"mul1": -2082680531, "mcg": -877912083})


# ---- golden layers -------------------------------------------------------------------------------------------


@pytest.mark.parametrize("path", FIXTURE_FILES, ids=lambda p: p.stem)
def test_golden_layer(path):
    group, ref, meta = load_fixture(path)
    codebook = exl3.codebook_from_group(group, "layer")
    assert codebook == meta["codebook"]
    assert exl3.bits_per_weight(group["trellis"]) == float(meta["bits_per_weight"])

    w_q = exl3.decode_rotated(group["trellis"], codebook)
    assert w_q.dtype == torch.float16
    mismatched = (w_q.view(torch.int16) != ref["w_q"].view(torch.int16)).sum().item()
    assert mismatched == 0, f"{mismatched} decoded elements differ from the library's reconstruct"

    w_eff = exl3.effective_weight(group["trellis"], group["suh"], group["svh"], codebook, torch.float64)
    ref_eff = ref["w_eff"].double()
    assert (w_eff - ref_eff).norm() / ref_eff.norm() <= 1e-6

    # Rounded once to fp16, ours and the library's fp32 product may differ only at rounding boundaries.
    ours16 = w_eff.to(torch.float16).view(torch.int16).int()
    theirs16 = ref["w_eff"].to(torch.float16).view(torch.int16).int()
    assert (ours16 - theirs16).abs().max() <= 1
    assert (ours16 == theirs16).float().mean() >= 0.99

    # The library's own fp16 weight was rounded after each of its four steps.
    rms = w_eff.pow(2).mean().sqrt()
    lib16 = ref["w_eff_fp16"].double()
    assert (w_eff - lib16).abs().max() <= 5e-3 * rms
    assert (w_eff - lib16).norm() / w_eff.norm() <= 1e-3

    y = exl3.reference_matmul(ref["x"], group["trellis"], group["suh"], group["svh"], codebook)
    assert y.dtype == torch.float32 and y.shape == ref["y"].shape
    y_rms = ref["y"].pow(2).mean().sqrt()
    assert (y - ref["y"]).norm() / ref["y"].norm() <= 1e-3
    assert (y - ref["y"]).abs().max() <= 3e-3 * y_rms


def test_expert_sized_decode_is_fast():
    trellis = torch.randint(-32768, 32768, (320, 144, 48), dtype=torch.int32).to(torch.int16)
    exl3.decode_rotated(trellis[:8, :8], "mul1")  # warm the caches
    start = time.perf_counter()
    w_q = exl3.decode_rotated(trellis, "mul1")
    elapsed = time.perf_counter() - start
    print(f"5120x2304 K=3 decode: {elapsed:.3f} s")
    assert w_q.shape == (5120, 2304)
    assert elapsed < 10.0  # ~0.2 s on an idle core: this only catches a return to a per-element Python loop


# ---- the one group check: the loader (checkpoint entries) and the kernels' layout (tensors) ---------------------


def _entry(t: torch.Tensor) -> SimpleNamespace:
    """A checkpoint entry as Checkpoint.info gives it: a shape and a safetensors dtype name."""
    names = {torch.int16: "I16", torch.float16: "F16", torch.float32: "F32"}
    return SimpleNamespace(shape=tuple(t.shape), dtype=names[t.dtype])


@pytest.mark.parametrize("case", ["good", "half-K", "float trellis", "K=4.5", "2-d", "short suh", "fp32 svh", "k=64"])
def test_check_group_says_the_same_of_tensors_and_checkpoint_entries(case):
    trellis = torch.zeros(16, 8, 48, dtype=torch.int16)
    suh, svh = torch.ones(256, dtype=torch.float16), torch.ones(128, dtype=torch.float16)
    group = {
        "good": (trellis, suh, svh), "half-K": (trellis[..., :40], suh, svh),
        "float trellis": (trellis.float(), suh, svh), "K=4.5": (torch.zeros(16, 8, 72, dtype=torch.int16), suh, svh),
        "2-d": (trellis[0], suh, svh), "short suh": (trellis, suh[:128], svh), "fp32 svh": (trellis, suh, svh.float()),
        "k=64": (trellis[:4], suh[:64], svh),
    }[case]

    def outcome(parts):
        try:
            return exl3.check_group("layers.1.ffn.w2", *parts)
        except CheckpointError as e:
            return str(e)

    from_tensors = outcome(group)
    assert from_tensors == outcome([_entry(t) for t in group])
    if case in ("good", "half-K"):
        assert from_tensors == ((3.0 if case == "good" else 2.5), 256, 128)
    else:
        assert from_tensors.startswith("tensor 'layers.1.ffn.w2."), from_tensors


def test_kernel_codebook_ids_follow_the_reference_codebooks():
    from dsv41.kernels.cuda_build import CODEBOOK_IDS

    assert tuple(CODEBOOK_IDS) == exl3.CODEBOOKS and list(CODEBOOK_IDS.values()) == [0, 1, 2]


def test_bad_groups_raise_checkpoint_error_naming_the_tensor():
    from dsv41.kernels.exl3.layout import Exl3ExpertStack, Exl3Tensor

    trellis = torch.zeros(8, 8, 48, dtype=torch.int16)
    suh, svh = torch.ones(128, dtype=torch.float16), torch.ones(128, dtype=torch.float16)
    with pytest.raises(CheckpointError, match=r"layers\.0\.w1\.trellis"):
        Exl3Tensor.from_group(trellis.float(), suh, svh, "mul1", "layers.0.w1")
    # half-integer K is a valid group (the reference decodes it) without a kernel path
    half = torch.zeros(8, 8, 40, dtype=torch.int16)
    assert exl3.check_group("x", half, suh, svh, "mul1") == (2.5, 128, 128)
    with pytest.raises(CheckpointError, match=r"'x\.trellis': half-integer K=2\.5 has no kernel path"):
        Exl3Tensor.from_group(half, suh, svh, "mul1", "x")
    with pytest.raises(CheckpointError, match=r"x\.svh"):
        Exl3Tensor.from_group(trellis, suh, svh[:64], "mul1", "x")
    with pytest.raises(CheckpointError, match=r"multiples of 128"):
        Exl3Tensor.from_group(torch.zeros(4, 8, 48, dtype=torch.int16), suh[:64], svh, "mul1", "x")
    with pytest.raises(CheckpointError, match=r"x: unknown EXL3 codebook '2mad'"):
        Exl3Tensor.from_group(trellis, suh, svh, "2mad", "x")
    # a stack: the same check with the expert dimension in front
    stack = (trellis.expand(3, -1, -1, -1), suh.expand(3, -1), svh.expand(3, -1))
    w = Exl3ExpertStack.from_stacked(*stack, "mcg", "layers.2.ffn.w1")
    assert (w.experts, w.K, w.k, w.n, w.codebook_id, tuple(w.words.shape)) == (3, 3, 128, 128, 1, (3, 8, 8, 24))
    with pytest.raises(CheckpointError, match=r"'layers\.2\.ffn\.w1\.suh': shape \[2, 128\], expected \[3, 128\]"):
        Exl3ExpertStack.from_stacked(stack[0], suh.expand(2, -1), stack[2], "mcg", "layers.2.ffn.w1")
    with pytest.raises(CheckpointError, match=r"4-d \[E, k/16, n/16, 16K\]"):
        Exl3ExpertStack.from_stacked(trellis, suh, svh, "mcg", "layers.2.ffn.w1")


def test_reference_and_layout_import_neither_triton_nor_each_other_in_a_circle():
    """weights/ and the kernels' layout, backend choice and CUDA launchers load without Triton; no import between
    dsv41.kernels modules (deferred ones inside functions included) closes a circle."""
    code = ("import sys; sys.modules['triton'] = None\n"
            "import dsv41.weights.linear, dsv41.kernels.exl3.layout, dsv41.kernels.exl3.backend\n"
            "import dsv41.kernels.exl3.cuda, dsv41.kernels.exl3.warmup")
    env = dict(os.environ, PYTHONPATH=f"{REPO / 'src'}{os.pathsep}{os.environ.get('PYTHONPATH', '')}")
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]

    src = REPO / "src"
    paths = {".".join(p.relative_to(src).with_suffix("").parts).removesuffix(".__init__"): p
             for p in (src / "dsv41" / "kernels").rglob("*.py")}
    graph = {}
    for module, path in paths.items():
        names = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module:
                names |= {node.module} | {f"{node.module}.{a.name}" for a in node.names}
            elif isinstance(node, ast.Import):
                names |= {a.name for a in node.names}
        graph[module] = sorted(names & paths.keys() - {module})

    def visit(module, stack):
        assert module not in stack, " -> ".join(stack + [module])
        for dep in graph[module]:
            visit(dep, stack + [module])

    for module in graph:
        visit(module, [])
