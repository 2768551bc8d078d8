"""CUDA path of the EXL3 kernels (cuda/exl3_fused.cu): fused matmul and routed-expert MoE for <= 16-row windows.

Each lane decodes its 8 trellis positions straight into its `mma.m16n8k16` operand registers (the tile
permutation of spec §1.4 was made for that), each warp streams its tile column through its own cp.async ring, the
input rotation runs in each block and the output rotation in the epilogue; split-K partials are summed in split
order by the block that arrives last. One cubin per (K, codebook): prebuilt in the closure or built once and cached
(`dsv41.kernels.cuda_build`, `dsv41.kernels.cuda_module`).

Launch shapes depend on the matrix only (never on m), so a row's bits do not depend on the other rows or on m.
"""

from __future__ import annotations

import ctypes
import math
import os
from dataclasses import dataclass

import torch

from dsv41.kernels.cuda_build import exl3_defines
from dsv41.kernels.cuda_build import tuning as configured_tuning
from dsv41.kernels.cuda_module import load_kernels, shared_memory_limit
from dsv41.kernels.exl3.layout import Exl3ExpertStack, Exl3Tensor, check_moe_inputs, moe_out

SOURCE = "exl3_fused.cu"
KERNELS = [
    "exl3_linear_r8", "exl3_linear_rows_r8", "exl3_linear_r16",
    "exl3_linear_few_r8", "exl3_linear_few_rows_r8", "exl3_linear_few_r16",
    "exl3_linear_group_r8", "exl3_linear_group_rows_r8",
    "exl3_moe_gate_up_r8", "exl3_moe_gate_up_r16",
    "exl3_moe_down_r8", "exl3_moe_down_r16",
    "exl3_decode",
    "exl3_prefill_r64", "exl3_prefill_r128",  # prefill tiles (kernels/exl3/prefill_cuda.py)
]
# must match exl3_fused.cu; the pipeline shape (KR, STAGES) is a compile-time define chosen in cuda_build
THREADS = 256
YS_STRIDE, SMEM_INTS = 132, 128
TUNING = configured_tuning()
MAX_ROWS = 16
# A block keeps its k slice of the rotated input in shared memory: at most 14 blocks of 128 (57 KB for 16 rows;
# slice_limit lowers it where the device has less shared memory).
MAX_SLICE_BLOCKS = 14
DTYPE_CODES = {torch.float16: 0, torch.bfloat16: 1, torch.float32: 2}
# Launches of at most this many blocks per SM use the linear kernel compiled for that many blocks per SM (more
# registers): the EXL3_FEW_MIN_BLOCKS of the tuning, 2 by default
FEW_BLOCKS_PER_SM = 2


def kernels_for(device: torch.device, K: int, codebook: str, tune: dict | None = None) -> dict:
    return load_kernels(SOURCE, exl3_defines(K, codebook, tune or TUNING), KERNELS, device)


def _shared_bytes(K: int, rows: int, xs_rows: int, xs_stride: int, tune: dict | None = None) -> int:
    """Shared memory of one block: the warps' cp.async rings (STAGES x 8 tile rows x 8 tiles), the fp32 result
    tile of `rows` rows, the small int table, and the rotated input of the `xs_rows` rows the launch can have."""
    t = tune or TUNING
    stage_words = 8 * 8 * 8 * K
    return (t["EXL3_STAGES"] * stage_words + rows * YS_STRIDE + SMEM_INTS) * 4 + xs_rows * xs_stride * 2


def _longest_slice(k: int, splits: int) -> int:
    """128-blocks in the longest of the `splits` k slices (kslice in the kernel)."""
    return math.ceil((k // 128) / splits)


def _xs_stride(k: int, splits: int) -> int:
    # fp16 row stride of the rotated input: whole 128-blocks of the longest k slice + 32, so that rows are 16 words
    # apart modulo 32 banks (conflict-free B operand loads, see b_word_pos in the kernel)
    return _longest_slice(k, splits) * 128 + 32


MAX_CLUSTER = 8  # portable thread block cluster size


def max_cluster(device: torch.device) -> int:
    """Largest thread block cluster: 16 on Hopper (non-portable size, allowed per kernel at launch), else 8."""
    return 16 if torch.cuda.get_device_capability(device)[0] == 9 else MAX_CLUSTER


def use_clusters(device: torch.device) -> bool:
    """Split-K reduction through a cluster's shared memory (sm_90+), opt-in with DSV41_EXL3_CLUSTER=1: correct,
    but no faster, even with 16-block clusters, and it gives up the head's column-block loop (docs/perf/exl3.md,
    "Numbers behind the code")."""
    if os.environ.get("DSV41_EXL3_CLUSTER", "0") in ("0", ""):
        return False
    return torch.cuda.get_device_capability(device) >= (9, 0)


def _sm_count(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count


def _shared_limit(device: torch.device) -> int:
    return shared_memory_limit(device.index if device.index is not None else torch.cuda.current_device())


def slice_limit(K: int, shared_limit: int, cap: int, tune: dict | None = None) -> int:
    """Longest k slice (in 128-blocks, at most `cap`) whose 16-row launch fits in `shared_limit` bytes of shared
    memory: GB10 allows 99 KB per block where the H200 allows 227 KB (K=8 fits 10 blocks there, K=6 MoE slices 12).
    Depends on the device and K only, never on m (row invariance)."""
    fixed = _shared_bytes(K, MAX_ROWS, 0, 0, tune)
    fit = (shared_limit - fixed - MAX_ROWS * 32 * 2) // (MAX_ROWS * 128 * 2)
    if fit < 1:
        raise ValueError(f"K={K}: the kernel's pipeline needs {fixed} B of shared memory, the device allows "
                         f"{shared_limit} B per block")
    return min(cap, fit)


def few_blocks(tune: dict | None = None) -> int:
    """Blocks per SM up to which a linear launch runs the kernel with the larger register budget."""
    return (tune or TUNING).get("EXL3_FEW_MIN_BLOCKS", FEW_BLOCKS_PER_SM)


def default_splits(k: int, n: int, sm_count: int, blocks_per_sm: float = FEW_BLOCKS_PER_SM,
                   max_slice: int = MAX_SLICE_BLOCKS) -> int:
    """Split-K count for a `[k, n]` matrix (never depends on m: row invariance).

    Wide matrices (at least one 128-column block per SM) take the fewest splits the shared-memory bound allows.
    Narrower ones take as many as keep every block resident at `blocks_per_sm` (2) per SM, which is where a launch
    runs the linear kernel with the larger register budget: more splits shorten the k slices until a launch leaves
    that kernel, fewer leave SMs idle (the sweeps: docs/perf/exl3.md, "Numbers behind the code").
    """
    k_blocks, col_blocks = k // 128, n // 128
    fewest = math.ceil(k_blocks / max_slice)
    if col_blocks >= sm_count:
        return fewest
    splits = max(1, math.floor(blocks_per_sm * sm_count / col_blocks))
    return max(fewest, min(k_blocks, splits))


class _Workspace:
    """Split-K partials and arrival counters per (device, shape); counters reset themselves after each launch."""

    def __init__(self):
        self._cache: dict[tuple, object] = {}

    def get(self, key: tuple, make):
        ws = self._cache.get(key)
        if ws is None:
            ws = self._cache[key] = make()
        return ws


_WORKSPACE = _Workspace()


def _vector_ready(x: torch.Tensor) -> torch.Tensor:
    """x with unit column stride, a row stride of whole 16-byte groups and a 16-byte aligned start (the kernel
    reads 4 elements at a time); copied only when it is not so already."""
    if x.stride(-1) == 1 and (x.stride(0) * x.element_size()) % 16 == 0 and x.data_ptr() % 16 == 0:
        return x
    y = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    y.copy_(x)
    return y


def _rows_variant(m: int) -> int:
    return 8 if m <= 8 else 16


def fused_matmul_cuda(
    x: torch.Tensor,
    weight: Exl3Tensor,
    out_dtype: torch.dtype = torch.float32,
    splits: int | None = None,
    out: torch.Tensor | None = None,
    tuning: dict | None = None,
) -> torch.Tensor:
    """`y = x @ W_eff` for x `[m, k]` (fp16/bf16/fp32, rounded to fp16 as ExLlamaV3 takes it); 16-row launches.

    `tuning` overrides the compile-time pipeline shape (TUNING) for benchmarks.
    """
    if x.dim() != 2 or x.shape[1] != weight.k:
        raise ValueError(f"x must be [m, {weight.k}], got {list(x.shape)}")
    if x.dtype not in DTYPE_CODES or out_dtype not in DTYPE_CODES:
        raise ValueError(f"unsupported dtypes x={x.dtype} out={out_dtype}")
    x = _vector_ready(x)
    m = x.shape[0]
    if out is None:
        out = torch.empty((m, weight.n), dtype=out_dtype, device=x.device)
    elif out.shape != (m, weight.n) or out.dtype not in DTYPE_CODES or out.stride(1) != 1:
        raise ValueError(f"out must be [{m}, {weight.n}] fp16/bf16/fp32 with unit column stride, got "
                         f"{list(out.shape)} {out.dtype}")
    if m == 0:
        return out
    k, n, K = weight.k, weight.n, weight.K
    clustered = use_clusters(x.device)
    if splits is None:
        splits = linear_splits(k, n, K, x.device, tuning)
    if not 1 <= splits <= k // 128:
        raise ValueError(f"splits={splits} does not fit k={k} (1..{k // 128})")
    # (longer k slices than default_splits makes need more shared memory; the launch names the size if it is refused)
    clustered = clustered and 1 < splits <= max_cluster(x.device)
    kernels = kernels_for(x.device, K, weight.codebook, tuning)
    xs_stride = _xs_stride(k, splits)
    col_blocks = n // 128
    # the kernel with the larger register budget where the launch leaves room for it (same arithmetic, same bits;
    # chosen by the matrix shape only)
    few = col_blocks * splits <= few_blocks(tuning) * _sm_count(x.device)
    for start in range(0, m, MAX_ROWS):
        rows = min(MAX_ROWS, m - start)
        variant = _rows_variant(rows)
        part, counters = _WORKSPACE.get(
            ("linear", str(x.device), splits, n, variant),
            lambda: (
                torch.empty((splits, variant, n), dtype=torch.float32, device=x.device),
                # arrival counters per column block, then one column-block counter per split (_column_grid)
                torch.zeros((n // 128 + splits,), dtype=torch.int32, device=x.device),
            ),
        )
        xc, yc = x[start:start + rows], out[start:start + rows]
        kernel = kernels[f"exl3_linear_{_linear_kind(few, variant, rows, k, splits, tuning)}r{variant}"]
        shared = _shared_bytes(K, variant, rows, xs_stride, tuning)
        grid_x = col_blocks
        if not clustered:
            grid_x = _column_grid(kernel, shared, col_blocks, splits, _sm_count(x.device), rows)
        kernel.launch(
            (grid_x, splits, 1), THREADS, shared,
            [xc, x.stride(0), DTYPE_CODES[x.dtype], rows, weight.words, weight.suh, weight.svh,
             yc, out.stride(0), DTYPE_CODES[out.dtype], part, counters, k, n, splits, xs_stride,
             (OPT_CLUSTER if clustered else 0) | (0 if warp_epilogue_enabled() else OPT_BLOCK_EPILOGUE)],
            cluster=(1, splits, 1) if clustered else None,
        )
    return out


def linear_splits(k: int, n: int, K: int, device: torch.device, tuning: dict | None = None) -> int:
    """The split-K count `fused_matmul_cuda` takes for a `[k, n]` K-bit matrix on `device` when none is given:
    from the shape, K and the device only (the runtime resolves it once per matrix at build)."""
    max_slice = slice_limit(K, _shared_limit(device), MAX_SLICE_BLOCKS, tuning)
    splits = default_splits(k, n, _sm_count(device), few_blocks(tuning), max_slice=max_slice)
    if use_clusters(device):
        splits = max(math.ceil((k // 128) / max_slice), min(splits, max_cluster(device)))
    return splits


# (row, 128-block) units per warp up to which exl3_linear_rows_r8 rotates its input by warp (EXL3_ROWS_WARP_UNITS)
ROWS_WARP_UNITS = 4


def _linear_kind(few: bool, variant: int, rows: int, k: int, splits: int, tune: dict | None) -> str:
    """Which linear kernel of a variant: 2..8 rows go to the kernels that rotate their input by warp for more
    units than a one-row launch has (the larger-register one always; the 4-blocks one where the longest k slice's
    units fit), as their code made one-row launches slower (docs/perf/exl3.md, "Numbers behind the code").
    Same bits either way."""
    if few:
        return "few_rows_" if variant == 8 and rows > 1 else "few_"
    units = rows * _longest_slice(k, splits)
    if variant == 8 and rows > 1 and units <= (tune or TUNING).get("EXL3_ROWS_WARP_UNITS", ROWS_WARP_UNITS) * 8:
        return "rows_"
    return ""


# options of a linear launch (exl3_fused.cu)
OPT_CLUSTER, OPT_BLOCK_EPILOGUE = 1, 2


def warp_epilogue_enabled() -> bool:
    """Per-warp split-K epilogue for one-row launches (on by default; DSV41_EXL3_WARP_EPILOGUE=0 for A/B runs, the
    bits are the same either way)."""
    return os.environ.get("DSV41_EXL3_WARP_EPILOGUE", "1") not in ("0", "")


def persistent_enabled() -> bool:
    """Column-block loops for very wide matrices (on by default; DSV41_EXL3_PERSIST=0 for A/B runs)."""
    return os.environ.get("DSV41_EXL3_PERSIST", "1") not in ("0", "")


# at most this many matrices in one group launch (GROUP_MAX in exl3_fused.cu); rows of a group launch (ROWS = 8)
GROUP_MAX, GROUP_ROWS = 8, 8


class _GroupMember(ctypes.Structure):
    # GroupMember in exl3_fused.cu
    _fields_ = [(f, ctypes.c_void_p) for f in ("x", "trellis", "suh", "svh", "y", "part", "counters")] + [
        (f, ctypes.c_int) for f in ("ldx", "x_dtype", "ldy", "y_dtype", "k", "n", "splits", "xs_stride",
                                    "first_block", "pad0", "pad1", "pad2")]


class _LinearGroup(ctypes.Structure):
    _fields_ = [("mem", _GroupMember * GROUP_MAX), ("count", ctypes.c_int), ("m", ctypes.c_int),
                ("options", ctypes.c_int), ("pad", ctypes.c_int)]


def group_splits(shapes: list[tuple[int, int]], K: int, device: torch.device, tuning: dict | None = None) -> list[int]:
    """Split counts of the members `[(k, n), ...]` of one group launch: the shortest common k slice (in 128-blocks)
    at which the group's blocks fit the GPU once at the larger register budget's blocks per SM, so every block does
    about the same work; from the shapes, K and the device only (never the row count)."""
    return group_splits_for(shapes, few_blocks(tuning) * _sm_count(device),
                            slice_limit(K, _shared_limit(device), MAX_SLICE_BLOCKS, tuning))


def group_splits_for(shapes: list[tuple[int, int]], budget: int, max_slice: int) -> list[int]:
    """`group_splits`' rule for a budget of `budget` blocks and k slices of at most `max_slice` 128-blocks."""
    for length in range(1, max_slice + 1):
        splits = [min(k // 128, math.ceil((k // 128) / length)) for k, _ in shapes]
        if sum(s * (n // 128) for s, (_, n) in zip(splits, shapes)) <= budget:
            return splits
    return [math.ceil((k // 128) / max_slice) for k, _ in shapes]


def linear_group_cuda(xs: list[torch.Tensor], weights: list[Exl3Tensor], outs: list[torch.Tensor],
                      splits: list[int], tuning: dict | None = None) -> None:
    """`outs[i] = xs[i] @ W_eff_i` for 1..GROUP_MAX matrices of one K and codebook and 1..8 rows, in one launch.

    Each member's bits are those of `fused_matmul_cuda(xs[i], weights[i], splits=splits[i])`: its blocks run the
    same k slices in the same order on its own partials (exl3_fused.cu, "grouped linear")."""
    count = len(weights)
    if not 1 <= count <= GROUP_MAX or not len(xs) == len(outs) == len(splits) == count:
        raise ValueError(f"a group launch takes 1..{GROUP_MAX} matching inputs, weights, outputs and splits")
    K, codebook, dev, m = weights[0].K, weights[0].codebook, xs[0].device, xs[0].shape[0]
    if not 1 <= m <= GROUP_ROWS:
        raise ValueError(f"a group launch takes 1..{GROUP_ROWS} rows, got {m}")
    group, first, shared, seen, ready = _LinearGroup(), 0, 0, {}, []
    for i, (x, w, y, s) in enumerate(zip(xs, weights, outs, splits)):
        if (w.K, w.codebook) != (K, codebook):
            raise ValueError(f"{w.name}: a group is one K and codebook ({K}, {codebook}), got ({w.K}, {w.codebook})")
        if x.dim() != 2 or x.shape != (m, w.k) or x.device != dev or x.dtype not in DTYPE_CODES:
            raise ValueError(f"{w.name}: x must be [{m}, {w.k}] fp16/bf16/fp32 on {dev}, got {list(x.shape)}")
        if y.shape != (m, w.n) or y.dtype not in DTYPE_CODES or y.stride(1) != 1:
            raise ValueError(f"{w.name}: out must be [{m}, {w.n}] with unit column stride, got {list(y.shape)}")
        if not 1 <= s <= w.k // 128:
            raise ValueError(f"{w.name}: splits={s} does not fit k={w.k}")
        x = _vector_ready(x)
        ready.append(x)  # (alive until the launch has read its pointer)
        # members of one (splits, n) take distinct partials (slot 0 is a lone launch's: stream order keeps them apart)
        slot = seen[(s, w.n)] = seen.get((s, w.n), -1) + 1
        part, counters = _WORKSPACE.get(
            ("linear", str(dev), s, w.n, GROUP_ROWS) + ((slot,) if slot else ()),
            lambda: (torch.empty((s, GROUP_ROWS, w.n), dtype=torch.float32, device=dev),
                     torch.zeros((w.n // 128 + s,), dtype=torch.int32, device=dev)))
        xs_stride = _xs_stride(w.k, s)
        group.mem[i] = _GroupMember(x.data_ptr(), w.words.data_ptr(), w.suh.data_ptr(), w.svh.data_ptr(),
                                    y.data_ptr(), part.data_ptr(), counters.data_ptr(), x.stride(0),
                                    DTYPE_CODES[x.dtype], y.stride(0), DTYPE_CODES[y.dtype], w.k, w.n, s, xs_stride,
                                    first, 0, 0, 0)
        first += (w.n // 128) * s
        shared = max(shared, _shared_bytes(K, GROUP_ROWS, m, xs_stride, tuning))
    group.count, group.m = count, m
    group.options = 0 if warp_epilogue_enabled() else OPT_BLOCK_EPILOGUE
    kernel = kernels_for(dev, K, codebook, tuning)["exl3_linear_group_r8" if m == 1 else "exl3_linear_group_rows_r8"]
    kernel.launch((first, 1, 1), THREADS, shared, [group])


# The column-block loop pays off from 3 rows on: with more rows each block's input rotation and reduction cost
# more, which the loop does once per resident block (docs/perf/exl3.md, "Numbers behind the code").
PERSIST_MIN_ROWS = 3


def _column_grid(kernel, shared: int, col_blocks: int, splits: int, sm_count: int, rows: int) -> int:
    """Blocks per split of a linear launch. Normally one per 128-column block; when the launch has more than twice
    the blocks the GPU holds at once (the head) and at least PERSIST_MIN_ROWS rows, only as many
    as stay resident, which then take column blocks from a counter until none is left (the same column blocks'
    work either way, so the same bits)."""
    if rows < PERSIST_MIN_ROWS or not persistent_enabled():
        return col_blocks
    resident = kernel.resident_blocks_per_sm(THREADS, shared) * sm_count
    if col_blocks * splits <= 2 * resident or resident < splits:
        return col_blocks
    return resident // splits


def decode_cuda(weight: Exl3Tensor) -> torch.Tensor:
    """W_q `[k, n]` fp16 (rotated domain) through the kernels' own fragment decode (tests and tools)."""
    out = torch.empty((weight.k, weight.n), dtype=torch.float16, device=weight.device)
    tiles = (weight.k // 16) * (weight.n // 16)
    kernels_for(weight.device, weight.K, weight.codebook)["exl3_decode"].launch(
        (math.ceil(tiles / 8), 1, 1), THREADS, 0, [weight.words, out, weight.k, weight.n]
    )
    return out


@dataclass(frozen=True)
class MoeCudaConfig:
    """Split-K counts of the two MoE launches (fixed per expert shape, never per window: row invariance)."""

    splits_gate_up: int
    splits_down: int


# k slices of the MoE launches may be longer than the linear's: a window has at most 16 rows and the expert shapes are
# fixed (16 rows x 14 blocks of rotated input is 57 KB)
MOE_MAX_SLICE_BLOCKS = 14


def default_moe_config(k_gate_up: int, k_down: int, max_slice_gate_up: int = MOE_MAX_SLICE_BLOCKS,
                       max_slice_down: int = MOE_MAX_SLICE_BLOCKS) -> MoeCudaConfig:
    """Split counts from the input widths of the gate/up (hidden) and down (intermediate) projections: 3 and 2 for
    the pack's 5120/2304 (the fastest in the sweeps: docs/perf/exl3.md, "Numbers behind the code"), more where the
    device's shared memory (slice_limit) asks for shorter k slices."""
    return MoeCudaConfig(
        splits_gate_up=max(math.ceil((k_gate_up // 128) / max_slice_gate_up), min(3, k_gate_up // 128)),
        splits_down=max(math.ceil((k_down // 128) / max_slice_down), min(2, k_down // 128)),
    )


def moe_config(w1: Exl3ExpertStack, w2: Exl3ExpertStack, device: torch.device,
               tuning: dict | None = None) -> MoeCudaConfig:
    """The split counts `moe_forward_cuda` takes for these stacks on `device` when no config is given (resolved
    once per layer by the runtime)."""
    limit = _shared_limit(device)
    return default_moe_config(w1.k, w2.k, slice_limit(w1.K, limit, MOE_MAX_SLICE_BLOCKS, tuning),
                              slice_limit(w2.K, limit, MOE_MAX_SLICE_BLOCKS, tuning))


def moe_forward_cuda(
    x: torch.Tensor,
    topk_ids: torch.Tensor,
    topk_weights: torch.Tensor,
    w1: Exl3ExpertStack,
    w3: Exl3ExpertStack,
    w2: Exl3ExpertStack,
    swiglu_limit: float = 10.0,
    out_dtype: torch.dtype = torch.float32,
    config: MoeCudaConfig | None = None,
    tuning: dict | None = None,
    out: torch.Tensor | None = None,
    addend: torch.Tensor | None = None,
) -> torch.Tensor:
    """Σ_i w_i · (clamped SwiGLU(x W1_e, x W3_e) @ W2_e) per row (e = topk_ids[row, i]), slots summed in order i.

    Two launches per window of at most 16 rows; every expert's trellis is read once per window. `addend` [T, hidden]
    (fp16/bf16/fp32, unit column stride): added to each row's sum in the down launch's epilogue, one fp32 add (the
    bits of `out + addend` after the launch, without that launch).
    """
    check_moe_inputs(x, topk_ids, topk_weights, w1, w3, w2)
    T, hidden = x.shape
    if x.dtype not in DTYPE_CODES or out_dtype not in DTYPE_CODES:
        raise ValueError(f"unsupported dtypes x={x.dtype} out={out_dtype}")
    topk = topk_ids.shape[1]
    if MAX_ROWS * topk > THREADS:
        raise ValueError(f"top-k {topk} too large for the MoE kernel (at most {THREADS // MAX_ROWS})")
    cfg = config or moe_config(w1, w2, x.device, tuning)
    out = moe_out(out, T, hidden, out_dtype, x.device)
    if addend is not None and (addend.shape != (T, hidden) or addend.dtype not in DTYPE_CODES
                               or addend.stride(1) != 1 or addend.device != x.device):
        raise ValueError(f"addend must be [{T}, {hidden}] fp16/bf16/fp32 with unit column stride on {x.device}, got "
                         f"{addend.dtype} {list(addend.shape)}")
    x = _vector_ready(x)
    for start in range(0, T, MAX_ROWS):
        stop = min(T, start + MAX_ROWS)
        _moe_window(x[start:stop], topk_ids[start:stop], topk_weights[start:stop], w1, w3, w2,
                    float(swiglu_limit), out[start:stop], cfg, tuning,
                    None if addend is None else addend[start:stop])
    return out


def _moe_window(x, topk_ids, topk_weights, w1, w3, w2, limit, out, cfg: MoeCudaConfig, tuning=None,
                addend=None) -> None:
    T, topk = topk_ids.shape
    n_slots = T * topk
    variant = _rows_variant(T)
    dev = x.device
    ids = topk_ids.reshape(-1).to(torch.int32).contiguous()
    route = topk_weights.reshape(-1).to(torch.float32).contiguous()
    sa, sb = cfg.splits_gate_up, cfg.splits_down
    n1, n2 = w1.n, w2.n

    def make():
        f32 = dict(dtype=torch.float32, device=dev)
        i32 = dict(dtype=torch.int32, device=dev)
        return {
            "h": torch.empty((n_slots, n1), dtype=torch.float16, device=dev),
            "y": torch.empty((n_slots, n2), **f32),
            "part_a": torch.empty((n_slots, sa, 2, variant, n1), **f32),
            "part_b": torch.empty((n_slots, sb, variant, n2), **f32),
            "count_a": torch.zeros((n_slots * (n1 // 128),), **i32),
            "count_b": torch.zeros((n_slots * (n2 // 128),), **i32),
            "count_out": torch.zeros((n2 // 128,), **i32),
        }

    ws = _WORKSPACE.get(("moe", str(dev), n_slots, n1, n2, sa, sb, variant), make)
    ka = kernels_for(dev, w1.K, w1.codebook, tuning)
    xs_a = _xs_stride(w1.k, sa)
    expert_words_1 = ctypes.c_longlong(w1.words[0].numel())
    ka[f"exl3_moe_gate_up_r{variant}"].launch(
        (n_slots, 2 * (n1 // 128), sa), THREADS, _shared_bytes(w1.K, variant, min(n_slots, variant), xs_a, tuning),
        [x, x.stride(0), DTYPE_CODES[x.dtype], topk, ids, route, n_slots,
         w1.words, w1.suh, w1.svh, w3.words, w3.suh, w3.svh, expert_words_1,
         ws["h"], ws["part_a"], ws["count_a"], w1.k, n1, sa, xs_a, limit],
    )
    kb = kernels_for(dev, w2.K, w2.codebook, tuning)
    xs_b = _xs_stride(w2.k, sb)
    kb[f"exl3_moe_down_r{variant}"].launch(
        (n_slots, n2 // 128, sb), THREADS, _shared_bytes(w2.K, variant, min(n_slots, variant), xs_b, tuning),
        [ws["h"], ids, n_slots, T, topk, w2.words, w2.suh, w2.svh, ctypes.c_longlong(w2.words[0].numel()),
         ws["y"], out, out.stride(0), DTYPE_CODES[out.dtype], ws["part_b"], ws["count_b"], ws["count_out"],
         w2.k, n2, sb, xs_b, ctypes.c_void_p(0 if addend is None else addend.data_ptr()),
         0 if addend is None else addend.stride(0), DTYPE_CODES[addend.dtype] if addend is not None else 0],
    )
