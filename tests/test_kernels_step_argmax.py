"""kernels/step/argmax.py against torch.argmax: the same index on every row (ties inside and across chunks, NaN,
-inf rows, signed zeros, +inf, bf16, a strided view), ids offset for a vocabulary shard, the ranks' proposals
combined as the full row's argmax. CPU under Triton's interpreter (a child process, small chunks so a row spans
many); the release shapes on the GPU."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests"))
from step_harness import interpreted, need_compiled_cuda  # noqa: E402

NAN, INF = float("nan"), float("inf")
# name: (V, chunk, dtype, offset, view): the rows of `_rows(V)` (a view: columns 13..V-10 of rows of V)
CASES = {"f32-70": (70, 16, "float32", 0, False), "f32-128": (128, 32, "float32", 0, False),
         "f32-1000": (1000, 64, "float32", 0, False), "bf16-1000": (1000, 64, "bfloat16", 0, False),
         "view-200": (200, 16, "float32", 0, True), "shard-96": (96, 16, "float32", 64640, False)}


def _rows(V: int, seed: int = 0) -> torch.Tensor:
    """Rows that each test one rule of the first maximum (V >= 70)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(10, V, generator=g)
    x[1, [30, 40, 41]] = 9.0  # a tie inside a chunk and across chunks: the first wins
    x[2, [V - 11, 17]] = 7.5  # the first is not the last written
    x[3, :] = -INF  # a row of -inf: its first index
    x[4, 25], x[4, 60] = NAN, NAN  # NaN above every number, the first NaN
    x[4, 22] = INF
    x[5, :] = 0.0
    x[5, 33] = -0.0  # -0.0 == +0.0: the first zero
    x[5, :33] = -1.0
    x[6, V - 11] = 50.0  # near the end (a partial chunk)
    x[7, 64] = INF  # +inf beats every finite number
    x[8] = x[8].round()  # many exact ties at the top
    x[9, 14] = 30.0
    return x


def _input(name: str) -> torch.Tensor:
    V, chunk, dtype, offset, view = CASES[name]
    x = _rows(V, seed=len(name)).to(getattr(torch, dtype))
    return x[:, 13:V - 10] if view else x


def _shards() -> tuple[torch.Tensor, int]:
    x = _rows(300, seed=3)
    x[0, [100, 200]] = 12.0  # the same maximum in both shards: the first rank's
    x[2, 260] = NAN
    return x, 150


def run_kernels(device: str) -> dict:
    """What the kernels give for every case (moved to the CPU)."""
    from dsv41.kernels.step.argmax import first_across_shards, greedy_rows

    out = {}
    for name, (V, chunk, dtype, offset, view) in CASES.items():
        values, ids = greedy_rows(_input(name).to(device), offset, chunk=chunk)
        out[name] = (values.cpu(), ids.cpu())
    x, cut = _shards()
    props = [greedy_rows(x[:, :cut].to(device), 0, chunk=32), greedy_rows(x[:, cut:].to(device), cut, chunk=32)]
    out["shards"] = first_across_shards(torch.stack([p[0] for p in props]), torch.stack([p[1] for p in props])).cpu()
    return out


@pytest.fixture(scope="module")
def interp(tmp_path_factory):
    return interpreted(tmp_path_factory, __file__, "argmax")


def _same_as_torch(x: torch.Tensor, values: torch.Tensor, ids: torch.Tensor, offset: int) -> None:
    want = torch.argmax(x, dim=-1)
    assert torch.equal(ids, want + offset)
    want_v = x.float().gather(1, want[:, None])[:, 0]
    assert torch.equal(torch.isnan(values), torch.isnan(want_v))
    fin = ~torch.isnan(want_v)
    assert torch.equal(values[fin], want_v[fin])


@pytest.mark.parametrize("name", list(CASES))
def test_greedy_rows_is_torch_argmax(interp, name):
    values, ids = interp[name]
    _same_as_torch(_input(name), values, ids, CASES[name][3])


def test_first_across_shards_is_the_full_rows_argmax(interp):
    x, _ = _shards()
    assert torch.equal(interp["shards"], torch.argmax(x, dim=-1))


def test_greedy_rows_rejects_bad_input():
    from dsv41.kernels.step.argmax import greedy_rows

    for bad, match in ((torch.zeros(3), "rows, vocab"), (torch.zeros(2, 4, dtype=torch.int32), "fp32"),
                       (torch.zeros(2, 0), "no column")):
        with pytest.raises(ValueError, match=match):
            greedy_rows(bad)
    with pytest.raises(ValueError, match="power of two"):
        greedy_rows(torch.zeros(2, 40), chunk=24)
    values, ids = greedy_rows(torch.zeros(0, 40))
    assert values.shape == ids.shape == (0,)


@pytest.mark.gpu
def test_gpu_greedy_rows_release_shapes():
    need_compiled_cuda()
    from dsv41.kernels.step.argmax import greedy_rows

    got = run_kernels("cuda")
    for name in CASES:
        _same_as_torch(_input(name), *got[name], CASES[name][3])
    g = torch.Generator(device="cuda").manual_seed(5)
    for V in (129280, 64640):  # the head at TP=1 and a rank's half at TP=2
        x = torch.randn(16, V, device="cuda", generator=g)
        x[1, [7, V - 3]] = 99.0
        x[2, 4097] = NAN
        x[3] = x[3].round()
        for dtype in (torch.float32, torch.bfloat16):
            y = x.to(dtype)
            assert torch.equal(greedy_rows(y)[1], torch.argmax(y, dim=-1)), (V, dtype)


if __name__ == "__main__" and len(sys.argv) == 3 and sys.argv[1] == "--interp-worker":
    os.environ["TRITON_INTERPRET"] = "1"
    torch.save(run_kernels("cpu"), sys.argv[2])
