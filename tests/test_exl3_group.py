"""Group launches of EXL3 linears (kernels.exl3.cuda.linear_group_cuda, runtime.layers.linear.LinearGroup).

CPU part (CI): the split rule, the host's mirror of the kernel's parameter struct, the group's fallback (each
member on its own) where no CUDA kernel runs. GPU part (`-m gpu`, the H200): every member of a group launch has
the bits of its own launch at the same split count, for every row count, repeated, inside a CUDA graph, and
whichever members share the grid; LinearGroup partitions by K and falls back beyond 8 rows with the same bits.
"""

from __future__ import annotations

import ctypes
import math
import re
from pathlib import Path

import pytest
import torch

from test_exl3_kernels import _random_group

SOURCE = Path(__file__).resolve().parents[1] / "src" / "dsv41" / "kernels" / "cuda" / "exl3_fused.cu"

# the real groups of a rank at TP=2: a ratio-2 layer's projections of x (wq_a, wkv, the compressor's wkv and
# wgate), wq_b with the indexer's wq_b, wo_a's 4 groups, the shared expert's gate and up
REAL_GROUPS = [
    [(5120, 1280), (5120, 512), (5120, 512), (5120, 512)],
    [(1280, 16384), (1280, 4096)],
    [(4096, 1024)] * 4,
    [(5120, 1152), (5120, 1152)],
]


@pytest.mark.parametrize("shapes", REAL_GROUPS)
@pytest.mark.parametrize("budget,max_slice", [(264, 14), (96, 14), (96, 6)])
def test_group_splits_take_the_shortest_common_slice_that_fits_the_budget(shapes, budget, max_slice):
    from dsv41.kernels.exl3.cuda import group_splits_for

    def blocks(length):
        return sum(min(k // 128, math.ceil((k // 128) / length)) * (n // 128) for k, n in shapes)

    splits = group_splits_for(shapes, budget, max_slice)
    assert all(1 <= s <= k // 128 for s, (k, _) in zip(splits, shapes))
    longest = max(math.ceil((k // 128) / s) for s, (k, _) in zip(splits, shapes))
    assert longest <= max_slice
    used = sum(s * (n // 128) for s, (_, n) in zip(splits, shapes))
    if used <= budget:
        # no shorter common slice would have fit
        assert all(blocks(length) > budget for length in range(1, longest))
    else:
        # nothing fits: the fewest splits the shared memory allows
        assert splits == [math.ceil((k // 128) / max_slice) for k, _ in shapes]
    # members of one shape get one split count; the rule never looks at a row count
    for (a, sa), (b, sb) in zip(zip(shapes, splits), zip(shapes[1:], splits[1:])):
        assert a != b or sa == sb


def test_host_mirror_of_the_group_struct_has_the_kernels_layout():
    from dsv41.kernels.exl3.cuda import GROUP_MAX, _GroupMember, _LinearGroup

    text = SOURCE.read_text()
    sizes = dict(re.findall(r"static_assert\(sizeof\((\w+)\) == (\d+)", text))
    assert ctypes.sizeof(_GroupMember) == int(sizes["GroupMember"])
    assert ctypes.sizeof(_LinearGroup) == int(sizes["LinearGroup"])
    assert f"#define GROUP_MAX {GROUP_MAX}" in text
    # the fields in the kernel's order
    body = re.search(r"struct GroupMember \{(.*?)\};", text, re.S).group(1)
    c_fields = re.findall(r"(\w+)(?:,|;)", body)
    assert c_fields == [name for name, _ in _GroupMember._fields_]


def test_linear_group_without_cuda_kernels_runs_each_member_alone():
    from dsv41.runtime.layers.linear import DequantLinear, LinearGroup

    gen = torch.Generator().manual_seed(3)
    lins = [DequantLinear("native", {"weight": torch.randn(o, 64, generator=gen)}, 64, o, f"m{o}") for o in (32, 48)]
    group = LinearGroup(lins)
    assert group.parts == []
    x = torch.randn(4, 64, generator=gen)
    for phase in ("decode", "verify", "prefill"):
        y32, y64 = group([x, x], 3, phase, [torch.float32, torch.float64])
        assert torch.equal(y32, lins[0](x, 3, phase)) and y64.dtype == torch.float64
        assert torch.equal(y64, lins[1](x, 3, phase, out_dtype=torch.float64))
    with pytest.raises(ValueError, match="takes 2 inputs"):
        group([x], 3, "decode")


def _need_cuda():
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device: GPU kernel tests run on the H200 (pytest -m gpu)")


def _weights(gen, shapes, K=5, cb="mul1"):
    from dsv41.kernels.exl3.layout import Exl3Tensor

    return [Exl3Tensor.from_group(*_random_group(gen, k, n, K, "cuda"), cb, f"w{i}") for i, (k, n) in
            enumerate(shapes)]


@pytest.mark.gpu
@pytest.mark.parametrize("K", [3, 5])
def test_gpu_group_launch_members_have_their_own_launches_bits(K):
    """Two members of one (splits, n) (their own partials), a strided input (wo_a's groups), outputs as column
    slices of one tensor in three dtypes; rows 1..8; repeated; in a graph."""
    _need_cuda()
    from dsv41.kernels.exl3.cuda import fused_matmul_cuda, group_splits, linear_group_cuda

    gen = torch.Generator().manual_seed(40 + K)
    shapes = [(1024, 512), (1024, 512), (2048, 256), (1024, 1280)]
    ws = _weights(gen, shapes, K)
    splits = group_splits(shapes, K, torch.device("cuda"))
    x = torch.randn(8, 1024, generator=gen).cuda().bfloat16()
    wide = torch.randn(8, 2 * 2048, generator=gen).cuda().bfloat16()
    xs = [x, x, wide[:, 2048:], x.half()]
    dtypes = [torch.bfloat16, torch.float32, torch.float16, torch.bfloat16]
    for m in range(1, 9):
        big = torch.full((m, 512 + 1280), float("nan"), dtype=torch.bfloat16, device="cuda")
        outs = [big[:, :512], torch.empty(m, 512, device="cuda"), torch.empty(m, 256, dtype=torch.float16,
                device="cuda"), big[:, 512:]]
        for _ in range(2):  # the counters reset themselves
            linear_group_cuda([t[:m] for t in xs], ws, outs, splits)
            for t, w, y, s, dt in zip(xs, ws, outs, splits, dtypes):
                alone = fused_matmul_cuda(t[:m], w, out_dtype=dt, splits=s)
                assert torch.equal(y.view(torch.uint8), alone.contiguous().view(torch.uint8)), (m, w.name)
    # captured and replayed: the same bits
    outs = [torch.empty(1, n, dtype=dt, device="cuda") for (_, n), dt in zip(shapes, dtypes)]
    eager = [torch.empty_like(o) for o in outs]
    linear_group_cuda([t[:1] for t in xs], ws, eager, splits)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        linear_group_cuda([t[:1] for t in xs], ws, outs, splits)
    for _ in range(3):
        graph.replay()
    torch.cuda.synchronize()
    assert all(torch.equal(a.view(torch.uint8), b.view(torch.uint8)) for a, b in zip(outs, eager))


@pytest.mark.gpu
def test_gpu_linear_group_partitions_by_K_and_falls_back_with_the_same_bits():
    _need_cuda()
    from dsv41.kernels.exl3.layout import Exl3Tensor
    from dsv41.runtime.layers.linear import Exl3Linear, LinearGroup, PrefillWorkspace

    gen = torch.Generator().manual_seed(7)
    ws = PrefillWorkspace(torch.device("cuda"))
    spec = [(1024, 512, 5), (1024, 256, 6), (1024, 384, 5), (1024, 128, 6), (1024, 640, 4)]
    lins = [Exl3Linear(Exl3Tensor.from_group(*_random_group(gen, k, n, K, "cuda"), "mul1", f"l{i}"), ws, f"l{i}")
            for i, (k, n, K) in enumerate(spec)]
    group = LinearGroup(lins)
    assert sorted(sorted(chunk) for chunk, _ in group.parts) == [[0, 2], [1, 3]]  # K=4 alone: no group
    for chunk, splits in group.parts:
        assert [lins[i].launch.splits for i in chunk] == splits  # a member alone keeps the group's bits
    x = torch.randn(16, 1024, generator=gen).cuda().bfloat16()
    full = group([x] * 5, 16, "verify")  # more than 8 rows: each member on its own
    for n in (1, 5, 8):
        ys = group([x] * 5, n, "decode")
        for lin, y, f in zip(lins, ys, full):
            assert torch.equal(y[:n], lin(x, n, "decode")[:n]), (n, lin.name)
            assert torch.equal(y[:n], f[:n]), (n, lin.name)  # batched == alone across the fallback
