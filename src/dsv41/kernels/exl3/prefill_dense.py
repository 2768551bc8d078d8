"""Dense prefill projections as one tensor-core GEMM over a workspace decoded once a call (issue 31, item 2).

The tile path (`prefill.prefill_linear`'s default) decodes a matrix's whole trellis once per 64-row tile: at 8,192
rows every weight of a dense projection is decoded 128 times, and at the tile kernel's ~1.4 T weights/s the 11
dense matrices of a layer took 7.98 ms (113-215 TFLOP/s, bf16 measured 793: docs/perf/prefill.md). A rank's dense
matrices are small (~86 M weights a layer), so here each is decoded ONCE a call into an fp16 workspace [k, n]
(`reconstruct.reconstruct(rotate=False)`: the decoded trellis values W_q, exact in fp16, the very values the tile
kernels multiply) and the product is a plain GEMM on the tensor cores:

    out = rot(xh @ W_q) ⊙ svh,   xh = rot(fp16(x) ⊙ suh)   (the input rotation: the tile path's `_rotate_kernel`)

with the tile path's epilogue (`decode.rotate_rows_fp32`, then svh, rounded once to out's dtype). Same function as
the tile path; other bits (another summation order of the k products).

Row invariance (chunked == one-shot, batched == alone): ONE launch shape per device (`GEMM`; `COMPACT` where a block
has less shared memory, GB10; `INTERPRETED` in Triton's CPU interpreter: BLOCK_M / BLOCK_K / warps / stages fixed,
never chosen from the row count; `DSV41_PREFILL_DENSE_TILE` names another fixed shape of `TILES`: GPU A/Bs), the
output rotation's 128-column blocks (one a program, or two sharing the A tiles: BN 256), the whole k in one program
(no split-K, no atomics), every product a tensor-core dot whose output row depends on its own input row only; rows
past the chunk are masked loads (zeros) whose outputs are never stored. The programs' order over the tiles (grouped
by GROUP_M row tiles, for L2 reuse of the workspace's column blocks) changes which program computes a tile, never a
tile's arithmetic.

A/B switch (`DSV41_PREFILL_DENSE_GEMM`, read at each launch; on by default since the H100 run at 63be457: 8.61 ms
of tile launches -> 5.53 ms a layer at 8,192 rows, its GPU test passed; `=0` takes the tiles;
`prefill_linear(dense_gemm=...)` beside it for tests and benches). With it off nothing here runs.

The workspace: the runtime passes its one reused buffer (`runtime.layers.linear.PrefillWorkspace.matrix`, sized at
build for the largest matrix that takes a prefill path, wq_b's 1280 x 16384 fp16 = 42 MB on a full-shape rank);
the matrices of a layer run one after another on one stream, so one buffer serves them all. The matrices that
read one point of a layer can run as one launch (`prefill_group.py`, `DSV41_PREFILL_DENSE_GROUP`): the same tiles.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Callable

import torch
import triton
import triton.language as tl

from dsv41.kernels.exl3.backend import cuda_path_available, interpreting
from dsv41.kernels.exl3.decode import hadamard_signs, hadamard_tile, rotate_rows_fp32, rotate_rows_fp32_with
from dsv41.kernels.exl3.layout import Exl3Tensor
from dsv41.kernels.exl3.reconstruct import reconstruct
from dsv41.kernels.step.knobs import switched_on

ENV = "DSV41_PREFILL_DENSE_GEMM"  # 1: dense prefill products as decode-once workspace + GEMM (A/B, default off)
BLOCK_N = 128  # the output rotation's 128-column block: a program's columns are exactly one

Workspace = Callable[[int, int], torch.Tensor]  # (k, n) -> a contiguous fp16 [k, n] tensor to decode into


@dataclass(frozen=True)
class GemmConfig:
    """The one launch shape of the workspace GEMM: fixed, so a row's bits never follow the chunk."""

    block_m: int = 128
    block_k: int = 64
    num_warps: int = 8
    num_stages: int = 3
    group_m: int = 8  # row tiles a group of programs sweeps before the next column block (L2 reuse only)
    shared_kb: int = 128  # its shared memory a block, the most over sm_80 / sm_90 / sm_121 (Triton 3.7's compile)
    block_n: int = 128  # 128, or 256: two 128-column accumulators sharing each A tile, each rotated on its own
    h_early: bool = False  # the epilogue's 32 KB Hadamard loaded before the k loop (its L2 latency hidden by it)
    rotate_parts: int = 3  # the output rotation's exact fp16 parts: 3 (fp32 accuracy, the tiles' bits) or 2
    tma: bool = False  # the k loop's A / B tiles by tensor descriptors (TMA on sm_90: no per-element addresses)
    persistent: int = 0  # > 0: that many programs an SM, each looping over tiles (the next tile's loads beside the
    # last one's epilogue where Triton pipelines across tiles); the SM count is the device's, never the rows'


# Hopper: 128 x 128 x 64 tiles, two warpgroups (wgmma m64 each), 3 stages of A + B in shared memory: 96 KB on sm_90
# (pipelined cp.async, 180 registers, no spills); 128 KB where the dots are mma.sync (the epilogue's [128, 128] fp32
# layout conversions go through shared memory)
GEMM = GemmConfig()
# devices with less shared memory a block (GB10: 99 KB): 64-row tiles, 4 warps, 80 KB on sm_121. A choice by the
# device, never by the rows (each device's bits are its own anyway)
COMPACT = GemmConfig(block_m=64, num_warps=4, shared_kb=80)
# the interpreter runs one program at a time on the CPU: the smallest legal tile (the GPU's claims are the GPU's).
# 16-deep k steps as the tiles' interpreted config: at 32 the interpreted TP=1 fake-quant-off parity test
# (tests/test_runtime_fast.py, switch on) flipped the same index choice (margin 11% of the scale, drift inf: a
# flip upstream of it, likely the candidate pool, which the test does not count) that 128-deep tile steps flip at TP=2
# (docs/perf/prefill.md, "Next" 4); at 16 it passes (prefill logits within 1.9e-3)
INTERPRETED = GemmConfig(block_m=16, block_k=16, num_warps=4, num_stages=1, group_m=1)

# The launch shapes a GPU A/B may pick (`DSV41_PREFILL_DENSE_TILE=<name>`, read at each launch; unset: GEMM). Each is
# ONE shape for every row count on a device (row invariance holds for each); a shape other than the default may give
# other bits (another k step or tile: the tensor cores' fp32 sums may be grouped otherwise), which the bench's dense
# sweep and the GPU test measure against the default. Names: BM x BN x BK, warps, stages (g: group_m when not 8).
TILES = {
    "128x128x64w8s3": GEMM,
    "128x128x64w8s4": GemmConfig(num_stages=4, shared_kb=160),
    "128x128x128w8s2": GemmConfig(block_k=128, num_stages=2, shared_kb=160),
    "128x128x128w8s3": GemmConfig(block_k=128, num_stages=3, shared_kb=224),
    "128x128x64w4s3": GemmConfig(num_warps=4),
    "128x256x64w8s3": GemmConfig(block_n=256, num_stages=3, shared_kb=192),
    "128x256x64w8s2": GemmConfig(block_n=256, num_stages=2, shared_kb=160),
    "256x128x64w8s3": GemmConfig(block_m=256, num_stages=3, shared_kb=192),
    "64x128x64w4s4": GemmConfig(block_m=64, num_warps=4, num_stages=4, shared_kb=128),
    "128x128x64w8s3h": GemmConfig(h_early=True),
    "128x128x64w8s3p2": GemmConfig(rotate_parts=2),
    "128x128x64w8s3hp2": GemmConfig(h_early=True, rotate_parts=2),
    "64x128x64w4s3h": GemmConfig(block_m=64, num_warps=4, num_stages=3, shared_kb=112, h_early=True),
    "128x128x64w8s3t": GemmConfig(tma=True),
    "128x128x64w8s4ht": GemmConfig(num_stages=4, shared_kb=192, h_early=True, tma=True),
    "128x128x64w8s3hP": GemmConfig(h_early=True, persistent=1),
    "128x128x64w8s3htP": GemmConfig(h_early=True, tma=True, persistent=1),
    "128x128x64w8s3g1": GemmConfig(group_m=1),
    "128x128x64w8s3g16": GemmConfig(group_m=16),
}
TILE_ENV = "DSV41_PREFILL_DENSE_TILE"  # a name of TILES: the GEMM's launch shape on devices where it fits
# The default shape where a block's shared memory holds its 4 stages (Hopper): the tiles through TMA descriptors, the
# epilogue's Hadamard loaded before the k loop, 4 stages. The SAME bits as GEMM (H100 at 92e817f: every dense matrix
# of 3 layers at 2,048 and 8,192 rows, rows invariant; the 16K chunked == one-shot GPU test passed with it) and a
# layer's dense GEMMs 1.305 -> 0.997 ms at 2,048 rows, 4.43 -> 3.51 ms at 8,192 (bench/results/
# prefill_dense_sweep_92e817f.json). Elsewhere (GB10's 99 KB, an A100's 164 KB) GEMM or COMPACT, as before.
DEFAULT_TILE = "128x128x64w8s4ht"


def dense_gemm_enabled() -> bool:
    """Whether prefill_linear takes this path (read at each launch; on by default
    since a GPU run checked its bits and time: tests/test_exl3_prefill_dense.py's GPU test and
    bench/prefill.py's kernels.dense; `=0` takes the tile kernel)."""
    return switched_on(ENV, default=True)


def tile_named(name: str | None = None) -> GemmConfig:
    """The launch shape `name` (None: the `DSV41_PREFILL_DENSE_TILE` knob, unset or empty: DEFAULT_TILE)."""
    name = (os.environ.get(TILE_ENV, "") if name is None else name).strip() or DEFAULT_TILE
    if name not in TILES:
        raise ValueError(f"{TILE_ENV}={name!r}: expected one of {', '.join(TILES)}")
    return TILES[name]


def config(device: torch.device) -> GemmConfig:
    """The launch shape on `device`: GEMM (or the knob's `TILES` entry) where its stages fit a block's shared memory
    (NVIDIA: asked of the driver), else COMPACT. Never a function of the rows."""
    if interpreting() or device.type != "cuda":
        return INTERPRETED
    if not cuda_path_available(device):
        return COMPACT
    from dsv41.kernels.cuda_module import shared_memory_limit

    index = device.index if device.index is not None else torch.cuda.current_device()
    limit = shared_memory_limit(index)
    chosen = tile_named()
    if chosen.shared_kb * 1024 <= limit:
        return chosen
    return GEMM if GEMM.shared_kb * 1024 <= limit else COMPACT


@triton.jit
def product_tile(a_ptrs, ok, w_ptrs, k, n, BM: tl.constexpr, BK: tl.constexpr):
    """acc [BM, 128] = the rows' xh @ one 128-column block of W, the whole k in BK steps (a_ptrs / w_ptrs: the
    first step's [BM, BK] / [BK, 128] pointers; rows not `ok` load zeros)."""
    acc = tl.zeros((BM, 128), dtype=tl.float32)
    for _kb in range(0, k // BK):
        a = tl.load(a_ptrs, mask=ok[:, None], other=0.0)
        b = tl.load(w_ptrs)
        acc = tl.dot(a, b, acc)
        a_ptrs += BK
        w_ptrs += BK * n
    return acc


@triton.jit
def product_tile_tma(xh_ptr, w_ptr, mb, nb, n_rows, k, n, BM: tl.constexpr, BK: tl.constexpr):
    """product_tile with the tiles loaded through tensor descriptors: the rows past n_rows come in as zeros (as
    the masked loads'), the same dots in the same k order."""
    a_desc = tl.make_tensor_descriptor(xh_ptr, shape=[n_rows, k], strides=[k, 1], block_shape=[BM, BK])
    b_desc = tl.make_tensor_descriptor(w_ptr, shape=[k, n], strides=[n, 1], block_shape=[BK, 128])
    acc = tl.zeros((BM, 128), dtype=tl.float32)
    for kb in range(0, k // BK):
        acc = tl.dot(a_desc.load([mb * BM, kb * BK]), b_desc.load([kb * BK, nb * 128]), acc)
    return acc


@triton.jit
def product_tile2(a_ptrs, ok, w_ptrs, n_ok1, k, n, BM: tl.constexpr, BK: tl.constexpr):
    """product_tile for two adjacent 128-column blocks sharing each A tile (BN 256): per block the same k steps and
    dots as product_tile's. n_ok1: whether the second block's columns exist (False: zeros, never stored)."""
    acc0 = tl.zeros((BM, 128), dtype=tl.float32)
    acc1 = tl.zeros((BM, 128), dtype=tl.float32)
    for _kb in range(0, k // BK):
        a = tl.load(a_ptrs, mask=ok[:, None], other=0.0)
        b0 = tl.load(w_ptrs)
        b1 = tl.load(w_ptrs + 128, mask=n_ok1, other=0.0)
        acc0 = tl.dot(a, b0, acc0)
        acc1 = tl.dot(a, b1, acc1)
        a_ptrs += BK
        w_ptrs += BK * n
    return acc0, acc1


@triton.jit
def store_rotated(acc, svh_ptrs, had_ptr, out_ptrs, ok):
    """The tile path's epilogue (`_tile_matmul_kernel`): the output rotation at fp32 accuracy, then svh, rounded
    once to out's dtype, stored for the rows `ok`."""
    y = rotate_rows_fp32(acc, had_ptr) * tl.load(svh_ptrs).to(tl.float32)[None, :]
    tl.store(out_ptrs, y.to(out_ptrs.dtype.element_ty), mask=ok[:, None])


@triton.jit
def store_rotated_with(acc, h, svh_ptrs, out_ptrs, ok, PARTS: tl.constexpr):
    """store_rotated with the Hadamard h already loaded (H_EARLY) and PARTS fp16 parts (`rotate_rows_fp32_with`: 3
    is `rotate_rows_fp32`'s very arithmetic, 2 other bits)."""
    y = rotate_rows_fp32_with(acc, h, PARTS) * tl.load(svh_ptrs).to(tl.float32)[None, :]
    tl.store(out_ptrs, y.to(out_ptrs.dtype.element_ty), mask=ok[:, None])


@triton.jit
def tile_of(pid, m_blocks, n_blocks, GROUP_M: tl.constexpr):
    """(row tile, column block) of program pid: GROUP_M row tiles x every column block, then the next group (the
    workspace's column blocks stay in L2); which program computes a tile, never the tile's arithmetic."""
    per_group = GROUP_M * n_blocks
    first_m = (pid // per_group) * GROUP_M
    size_m = tl.minimum(m_blocks - first_m, GROUP_M)
    return first_m + (pid % per_group) % size_m, (pid % per_group) // size_m


@triton.jit(do_not_specialize=["n_rows"])
def _gemm_rotate_kernel(xh_ptr, w_ptr, svh_ptr, had_ptr, out_ptr, stride_out, n_rows, k, n,
                        BM: tl.constexpr, BK: tl.constexpr, GROUP_M: tl.constexpr, BN: tl.constexpr = 128,
                        H_EARLY: tl.constexpr = False, PARTS: tl.constexpr = 3, TMA: tl.constexpr = False):
    """out[r, cols] = rot(xh[r] @ W[:, cols]) ⊙ svh[cols] for BM rows r and one BN-column block (BN 128, or 256 as
    two 128-column blocks, each rotated on its own), the whole k.

    xh [n_rows, k] fp16 (rotated input), W [k, n] fp16 (the decoded W_q), out any float dtype, unit column stride."""
    mb, nb = tile_of(tl.program_id(0), tl.cdiv(n_rows, BM), tl.cdiv(n, BN), GROUP_M)
    rows = mb * BM + tl.arange(0, BM)
    ok = rows < n_rows
    cols = nb * BN + tl.arange(0, 128)
    kk = tl.arange(0, BK)
    x_ptrs = xh_ptr + rows[:, None].to(tl.int64) * k + kk[None, :]
    w_ptrs = w_ptr + kk[:, None].to(tl.int64) * n + cols[None, :]
    out_ptrs = out_ptr + rows[:, None].to(tl.int64) * stride_out + cols[None, :]
    if TMA:  # BN 128 (gemm_rotated checks)
        if H_EARLY or PARTS != 3:
            h = hadamard_tile(had_ptr)
            acc = product_tile_tma(xh_ptr, w_ptr, mb, nb, n_rows, k, n, BM, BK)
            store_rotated_with(acc, h, svh_ptr + cols, out_ptrs, ok, PARTS)
        else:
            acc = product_tile_tma(xh_ptr, w_ptr, mb, nb, n_rows, k, n, BM, BK)
            store_rotated(acc, svh_ptr + cols, had_ptr, out_ptrs, ok)
    elif H_EARLY or PARTS != 3:  # BN 128 (gemm_rotated checks)
        h = hadamard_tile(had_ptr)
        acc = product_tile(x_ptrs, ok, w_ptrs, k, n, BM, BK)
        store_rotated_with(acc, h, svh_ptr + cols, out_ptrs, ok, PARTS)
    elif BN == 128:
        store_rotated(product_tile(x_ptrs, ok, w_ptrs, k, n, BM, BK), svh_ptr + cols, had_ptr, out_ptrs, ok)
    else:
        n_ok1 = nb * BN + 128 < n
        acc0, acc1 = product_tile2(x_ptrs, ok, w_ptrs, n_ok1, k, n, BM, BK)
        store_rotated(acc0, svh_ptr + cols, had_ptr, out_ptrs, ok)
        if n_ok1:  # a matrix of an odd number of 128-column blocks: its last program's second block is past n
            store_rotated(acc1, svh_ptr + cols + 128, had_ptr, out_ptrs + 128, ok)


def _scratch_cuda(size: int, align: int, stream) -> torch.Tensor:
    return torch.empty(size, dtype=torch.int8, device="cuda")


def _scratch_cpu(size: int, align: int, stream) -> torch.Tensor:
    return torch.empty(size, dtype=torch.int8)


def _descriptor_scratch(device: torch.device) -> None:
    """Triton's in-kernel tensor descriptors need global scratch a launch (a few hundred bytes): from torch's caching
    allocator on the current device, where Triton launches ("cpu" in the interpreter). Set before every TMA launch:
    Triton keeps the allocator in a context variable, so a thread that launches (the engine's) has its own."""
    triton.set_allocator(_scratch_cuda if device.type == "cuda" else _scratch_cpu)


@triton.jit(do_not_specialize=["n_rows"])
def _gemm_persistent_kernel(xh_ptr, w_ptr, svh_ptr, had_ptr, out_ptr, stride_out, n_rows, k, n, programs,
                            BM: tl.constexpr, BK: tl.constexpr, GROUP_M: tl.constexpr, PARTS: tl.constexpr,
                            TMA: tl.constexpr):
    """`_gemm_rotate_kernel`'s tiles (BN 128, the Hadamard loaded once a program) taken by `programs` programs in
    turn: tile t by program t % programs; each tile the same loads, dots and epilogue as there (the same bits)."""
    m_blocks = tl.cdiv(n_rows, BM)
    n_blocks = n // 128
    h = hadamard_tile(had_ptr)
    kk = tl.arange(0, BK)
    for t in tl.range(tl.program_id(0), m_blocks * n_blocks, programs, flatten=True):
        mb, nb = tile_of(t, m_blocks, n_blocks, GROUP_M)
        rows = mb * BM + tl.arange(0, BM)
        ok = rows < n_rows
        cols = nb * 128 + tl.arange(0, 128)
        out_ptrs = out_ptr + rows[:, None].to(tl.int64) * stride_out + cols[None, :]
        if TMA:
            acc = product_tile_tma(xh_ptr, w_ptr, mb, nb, n_rows, k, n, BM, BK)
        else:
            x_ptrs = xh_ptr + rows[:, None].to(tl.int64) * k + kk[None, :]
            w_ptrs = w_ptr + kk[:, None].to(tl.int64) * n + cols[None, :]
            acc = product_tile(x_ptrs, ok, w_ptrs, k, n, BM, BK)
        store_rotated_with(acc, h, svh_ptr + cols, out_ptrs, ok, PARTS)


def _sm_count(device: torch.device) -> int:
    """The device's SM count (the persistent shapes' grid: a property of the device, never of the rows)."""
    if device.type != "cuda":
        return 2  # the interpreter: two programs, so that one takes several tiles in turn (tests' 3-tile shapes)
    return torch.cuda.get_device_properties(device).multi_processor_count


def decode_into(weight: Exl3Tensor, workspace: Workspace | None = None) -> torch.Tensor:
    """W_q [k, n] fp16, the matrix's trellis decoded once (no rotation, no scales), into the workspace if given."""
    out = workspace(weight.k, weight.n) if workspace is not None else None
    return reconstruct(weight, torch.float16, rotate=False, out=out)


def gemm_rotated(xh: torch.Tensor, w: torch.Tensor, weight: Exl3Tensor, out: torch.Tensor,
                 cfg: GemmConfig | None = None) -> torch.Tensor:
    """out = rot(xh @ w) ⊙ svh: the rotated input xh [T, k] fp16 times the decoded w [k, n] fp16, one launch."""
    T, k = xh.shape
    n = weight.n
    if xh.dtype != torch.float16 or not xh.is_contiguous() or k != weight.k:
        raise ValueError(f"xh must be contiguous fp16 [rows, {weight.k}], got {xh.dtype} {list(xh.shape)}")
    if w.shape != (k, n) or w.dtype != torch.float16 or not w.is_contiguous():
        raise ValueError(f"w must be contiguous fp16 [{k}, {n}], got {w.dtype} {list(w.shape)}")
    if out.shape != (T, n) or out.stride(-1) != 1:
        raise ValueError(f"out must be [{T}, {n}] with unit column stride, got {list(out.shape)}")
    cfg = cfg or config(xh.device)
    if k % cfg.block_k or n % BLOCK_N:
        raise ValueError(f"[{k}, {n}] is not a whole number of {cfg.block_k} x {BLOCK_N} blocks")
    if (cfg.h_early or cfg.rotate_parts != 3 or cfg.tma or cfg.persistent) and cfg.block_n != 128:
        raise ValueError("h_early / rotate_parts / tma / persistent are built for 128-column programs")
    if T == 0:
        return out
    if cfg.tma:
        _descriptor_scratch(xh.device)
    if cfg.persistent:
        programs = min(cfg.persistent * _sm_count(xh.device), triton.cdiv(T, cfg.block_m) * (n // BLOCK_N))
        _gemm_persistent_kernel[(programs,)](
            xh, w, weight.svh, hadamard_signs(xh.device, torch.float16), out, out.stride(0), T, k, n, programs,
            BM=cfg.block_m, BK=cfg.block_k, GROUP_M=cfg.group_m, PARTS=cfg.rotate_parts, TMA=cfg.tma,
            num_warps=cfg.num_warps, num_stages=cfg.num_stages)
        return out
    grid = (triton.cdiv(T, cfg.block_m) * triton.cdiv(n, cfg.block_n),)
    _gemm_rotate_kernel[grid](xh, w, weight.svh, hadamard_signs(xh.device, torch.float16), out, out.stride(0), T, k,
                              n, BM=cfg.block_m, BK=cfg.block_k, GROUP_M=cfg.group_m, BN=cfg.block_n,
                              H_EARLY=cfg.h_early, PARTS=cfg.rotate_parts, TMA=cfg.tma, num_warps=cfg.num_warps,
                              num_stages=cfg.num_stages)
    return out


def workspace_matmul(xh: torch.Tensor, weight: Exl3Tensor, out: torch.Tensor,
                     workspace: Workspace | None = None, cfg: GemmConfig | None = None) -> torch.Tensor:
    """`prefill_linear`'s product on this path, from the rotated input: decode once, then the GEMM + epilogue."""
    return gemm_rotated(xh, decode_into(weight, workspace), weight, out, cfg)
