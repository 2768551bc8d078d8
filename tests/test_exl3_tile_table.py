"""The routed experts' tile table in three launches (dsv41.kernels.exl3.tile_table.route_table) against the torch
reference (`prefill.tile_table`) and the gathers `prefill_moe` made from it, element for element: skewed routing
(experts of several tiles, experts with none), int32 and int64 ids, 64- and 128-row tiles, one pair, none.

CPU: the kernels run in Triton's interpreter in one child process (this file with `--interp-worker`); GPU (`-m gpu`):
the same cases compiled, plus a 16,384-row chunk's ids.
"""

from __future__ import annotations

import os
import sys

import pytest
import torch

from step_harness import interpreted, need_compiled_cuda  # noqa: E402

# name: (experts, rows, topk, block_m, ids dtype)
CASES = {"small": (6, 40, 3, 16, torch.int64), "pack64": (384, 2048, 6, 64, torch.int32),
         "pack128": (384, 2048, 6, 128, torch.int32), "one": (8, 1, 2, 64, torch.int64),
         "odd": (7, 500, 3, 128, torch.int32), "none": (5, 0, 3, 16, torch.int32)}


def _case(name: str, device="cpu"):
    experts, rows, topk, bm, dtype = CASES[name]
    gen = torch.Generator().manual_seed(rows + experts)
    skew = torch.rand(experts, generator=gen) ** 4  # a few experts take most pairs, some none
    ids = torch.stack([torch.multinomial(skew, topk, generator=gen) for _ in range(rows)]) if rows else \
        torch.zeros(0, topk, dtype=torch.int64)
    w = torch.rand(rows, topk, generator=gen)
    return ids.to(dtype).to(device), w.to(device)


def _run(name: str, device="cpu") -> dict:
    from dsv41.kernels.exl3.prefill import max_tiles
    from dsv41.kernels.exl3.tile_table import route_table

    experts, rows, topk, bm, _ = CASES[name]
    ids, w = _case(name, device)
    rt = route_table(ids, experts, bm, max_tiles(rows * topk, experts, bm), weights=w, topk=topk)
    return {k: v.cpu() for k, v in rt._asdict().items()}


def _check(name: str, got: dict) -> None:
    from dsv41.kernels.exl3.prefill import tile_table

    experts, rows, topk, bm, _ = CASES[name]
    ids, w = _case(name)
    order, pair_e, table = tile_table(ids, experts, bm)
    assert torch.equal(got["order"], order)
    assert got["pair_e"].dtype == torch.int32 and torch.equal(got["pair_e"], pair_e)
    assert got["table"].dtype == torch.int32 and torch.equal(got["table"], table), (got["table"], table)
    assert torch.equal(got["src"], torch.div(order, topk, rounding_mode="floor").to(torch.int32))
    assert got["route"].dtype == torch.float32 and torch.equal(got["route"], w.reshape(-1).float()[order])
    assert torch.equal(got["out_rows"], order.to(torch.int32))
    if rows > 1:
        assert (table[:, 2] > 0).any() and (table[:, 2] == 0).any(), "the case has real and spare tiles"


@pytest.fixture(scope="module")
def interp(tmp_path_factory):
    return interpreted(tmp_path_factory, __file__, "tile_table")


@pytest.mark.parametrize("name", CASES)
def test_interpreted_route_table_is_the_reference_table(interp, name):
    _check(name, interp[name])


@pytest.mark.gpu
@pytest.mark.parametrize("name", CASES)
def test_gpu_route_table_is_the_reference_table(name):
    need_compiled_cuda()
    _check(name, _run(name, "cuda"))


if __name__ == "__main__" and len(sys.argv) == 3 and sys.argv[1] == "--interp-worker":
    os.environ["TRITON_INTERPRET"] = "1"
    torch.set_num_threads(1)
    torch.save({name: _run(name) for name in CASES}, sys.argv[2])
