"""The MoE router of decode / verify rows in two launches, one row's work never touching another's.

Reference: `dsv41.model.moe.route` (MODEL.md §8): logits = (x @ gate) / temp in fp32, scores = sqrt(softplus(logits))
(evaluated in fp64, rounded once to fp32, as the reference's `f64`), select = scores + bias (selection only), the k
largest selects with ties to the lower expert id (`model.topk.topk_lowest_index_ties`), weights = the scores at the
picked ids, renormalised (`/ (sum + 1e-20)`, if renorm and k > 1) and scaled by route_scale.

Launch 1 (logits): one program per (row, block of BLOCK_E experts, d split). Each accumulates x[row] * gate over its
d range in BLOCK_D chunks into a [BLOCK_E, BLOCK_D] fp32 tile (each lane a sequential sum) and sums the tile's lanes
once at the end: a fixed order set by the compile-time shape, which no row count changes.
Launch 2 (select): one program per row sums the d splits in split order, then softplus / sqrt / bias / top-k /
weights. Top-k is k rounds of "largest select, lowest id among equals", then that id is removed: the ids come out
best first, exactly the stable descending sort's first k. Folded (the default, `FOLD_ENV`): the select runs in
launch 1's last arriving program of each row (an arrival counter per row, as the mHC sites'), on the same partials
in the same order: one launch a layer fewer, the same bits.

Outputs stay on the device (no host sync): ids [B, k] int64 and weights [B, k] fp32 in the layout the MoE kernels
read (`kernels.exl3.moe`: row-major top-k tables), plus logits and select [B, E] fp32 (what the parity traces read).
A row's bits depend only on that row and the matrices: the grid grows with B, never the programs' shape.
Launch knobs (`route_rows`'s block_e / block_d / d_splits / num_warps, bench/step_kernel_sweep.py times them): they
set the reduction order, so a caller may pick them from d and E, never from B (a row's bits would then change with
the batch it rides in).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .knobs import switched_on
from .mhc import _COUNTERS
from .pdl import launch as pdl_launch, wait_previous

# the fastest summed over 1 and 16 rows at the release's shape (d 5120, E 384), cold gate, H200
# (bench/results/step_kernel_sweep.json): 10.3 / 17.2 us against 16.3 / 22.6 for 16 / 128 / 4
BLOCK_E = 32
BLOCK_D = 128
D_SPLITS = 16  # programs along d per (row, expert block): parallelism for one row; the split order is fixed
FOLD_ENV = "DSV41_ROUTER_FOLD"  # off: the select as its own launch (A/B; the same bits either way)


@triton.jit
def _router_logits_kernel(x_ptr, stride_x, gate_ptr, stride_gd, stride_ge, part_ptr, d, E,
                          count_ptr, bias_ptr, logits_ptr, select_ptr, ids_ptr, weights_ptr, temp, scale,
                          CHUNKS_PER_SPLIT: tl.constexpr, BE: tl.constexpr, BD: tl.constexpr,
                          SPLITS: tl.constexpr, EP: tl.constexpr, TOPK: tl.constexpr, KP: tl.constexpr,
                          HAS_BIAS: tl.constexpr, RENORM: tl.constexpr, FOLD: tl.constexpr = False,
                          PDL: tl.constexpr = False):
    wait_previous(PDL)
    row = tl.program_id(0)
    eb = tl.program_id(1)
    sp = tl.program_id(2)
    e = eb * BE + tl.arange(0, BE)
    e_ok = e < E
    acc = tl.zeros((BE, BD), dtype=tl.float32)
    for c in range(CHUNKS_PER_SPLIT):
        k = (sp * CHUNKS_PER_SPLIT + c) * BD + tl.arange(0, BD)
        k_ok = k < d
        xk = tl.load(x_ptr + row.to(tl.int64) * stride_x + k, mask=k_ok, other=0.0).to(tl.float32)
        w = tl.load(gate_ptr + k[None, :].to(tl.int64) * stride_gd + e[:, None].to(tl.int64) * stride_ge,
                    mask=e_ok[:, None] & k_ok[None, :], other=0.0).to(tl.float32)
        acc += w * xk[None, :]
    part = tl.sum(acc, axis=1)
    tl.store(part_ptr + (row.to(tl.int64) * SPLITS + sp) * E + e, part, mask=e_ok)
    if FOLD:  # the row's last arriving program runs the select launch's body on the partials the others stored
        tl.debug_barrier()  # every thread's partial stored before the ticket is released
        ticket = tl.atomic_add(count_ptr + row, 1, sem="acq_rel")
        if ticket == tl.num_programs(1) * SPLITS - 1:
            tl.atomic_xchg(count_ptr + row, 0)  # ready for the next launch (graph replays included)
            _select_row(row, part_ptr, bias_ptr, logits_ptr, select_ptr, ids_ptr, weights_ptr, E, temp, scale,
                        SPLITS, EP, TOPK, KP, HAS_BIAS, RENORM, ".cg")


@triton.jit
def _log1p_f64(u):
    """log(1 + u) in fp64 for u >= 0 to about an ulp (Goldberg: log(w) * u / (w - 1), w = fl(1 + u))."""
    w = 1.0 + u
    return tl.where(w == 1.0, u, tl.log(w) * (u / (w - 1.0)))


@triton.jit
def _router_select_kernel(part_ptr, bias_ptr, logits_ptr, select_ptr, ids_ptr, weights_ptr, E, temp, scale,
                          SPLITS: tl.constexpr, EP: tl.constexpr, TOPK: tl.constexpr, KP: tl.constexpr,
                          HAS_BIAS: tl.constexpr, RENORM: tl.constexpr, PDL: tl.constexpr = False):
    wait_previous(PDL)
    _select_row(tl.program_id(0), part_ptr, bias_ptr, logits_ptr, select_ptr, ids_ptr, weights_ptr, E, temp, scale,
                SPLITS, EP, TOPK, KP, HAS_BIAS, RENORM, "")


@triton.jit
def _select_row(row, part_ptr, bias_ptr, logits_ptr, select_ptr, ids_ptr, weights_ptr, E, temp, scale,
                SPLITS: tl.constexpr, EP: tl.constexpr, TOPK: tl.constexpr, KP: tl.constexpr,
                HAS_BIAS: tl.constexpr, RENORM: tl.constexpr, CACHE: tl.constexpr):
    """One row's logits, select, top-k ids and weights from its d-split partials (summed in split order).
    CACHE ".cg" (folded): the partials were stored by other programs of this launch, read past L1."""
    e = tl.arange(0, EP)
    e_ok = e < E
    base = row.to(tl.int64) * SPLITS * E
    z = tl.load(part_ptr + base + e, mask=e_ok, other=0.0, cache_modifier=CACHE)
    for sp in tl.static_range(1, SPLITS):
        z = z + tl.load(part_ptr + base + sp * E + e, mask=e_ok, other=0.0, cache_modifier=CACHE)
    z = tl.math.div_rn(z, temp)
    tl.store(logits_ptr + row.to(tl.int64) * E + e, z, mask=e_ok)
    # sqrt(softplus(z)) in fp64, rounded once (torch's softplus: z itself above the threshold 20)
    zd = z.to(tl.float64)
    sp_pos = zd + _log1p_f64(tl.exp(-zd))  # z > 0: exp(-z) <= 1
    sp_neg = _log1p_f64(tl.exp(zd))
    softplus = tl.where(zd > 20.0, zd, tl.where(zd > 0.0, sp_pos, sp_neg))
    scores = tl.sqrt(softplus).to(tl.float32)
    if HAS_BIAS:
        sel = scores + tl.load(bias_ptr + e, mask=e_ok, other=0.0)
    else:
        sel = scores
    tl.store(select_ptr + row.to(tl.int64) * E + e, sel, mask=e_ok)
    # top-k: the largest select, the lowest id among equal ones, k times
    sel = tl.where(e_ok, sel, float("-inf"))
    kk = tl.arange(0, KP)
    ids = tl.zeros((KP,), dtype=tl.int64)
    w = tl.zeros((KP,), dtype=tl.float32)
    total = 0.0
    for j in tl.static_range(TOPK):
        best = tl.max(sel, axis=0)
        pick = tl.min(tl.where(sel == best, e, EP), axis=0)
        s_pick = tl.sum(tl.where(e == pick, scores, 0.0), axis=0)
        ids = tl.where(kk == j, pick.to(tl.int64), ids)
        w = tl.where(kk == j, s_pick, w)
        total = total + s_pick
        sel = tl.where(e == pick, float("-inf"), sel)
    if RENORM:
        w = tl.math.div_rn(w, tl.zeros((KP,), dtype=tl.float32) + (total + 1e-20))
    w = w * scale
    k_ok = kk < TOPK
    tl.store(ids_ptr + row.to(tl.int64) * TOPK + kk, ids, mask=k_ok)
    tl.store(weights_ptr + row.to(tl.int64) * TOPK + kk, w, mask=k_ok)


def check_route_args(x: torch.Tensor, gate_t: torch.Tensor, bias: torch.Tensor | None, k: int, dtypes) -> int:
    """The router's inputs fit (gate_t [d, E] of one of `dtypes`, 1 <= k <= E, bias fp32 [E] or None): E."""
    d = x.shape[1]
    if gate_t.shape[0] != d or gate_t.dtype not in dtypes:
        names = " / ".join(str(t).replace("torch.", "") for t in dtypes)
        raise ValueError(f"gate_t must be {names} [d={d}, E], got {gate_t.dtype} {list(gate_t.shape)}")
    E = gate_t.shape[1]
    if not 1 <= k <= E:
        raise ValueError(f"top-k {k} out of range for {E} experts")
    if bias is not None and (bias.shape != (E,) or bias.dtype != torch.float32):
        raise ValueError(f"bias must be fp32 [{E}], got {bias.dtype} {list(bias.shape)}")
    return E


def route_outputs(B: int, E: int, k: int, ids_dtype: torch.dtype, device):
    """(ids [B, k], weights [B, k] fp32, logits [B, E] fp32, select [B, E] fp32), unwritten: what a router launch
    fills."""
    f32 = dict(dtype=torch.float32, device=device)
    return (torch.empty(B, k, dtype=ids_dtype, device=device), torch.empty(B, k, **f32), torch.empty(B, E, **f32),
            torch.empty(B, E, **f32))


def route_rows(x: torch.Tensor, gate_t: torch.Tensor, bias: torch.Tensor | None, k: int, *, scale: float,
               renorm: bool, temp: float = 1.0, block_e: int = BLOCK_E, block_d: int = BLOCK_D,
               d_splits: int = D_SPLITS, num_warps: int = 4, ids_dtype: torch.dtype = torch.int64,
               fold: bool | None = None):
    """`model.moe.route` for rows x [B, d] and gate_t [d, E] (fp32, or the release's bf16: both read as fp32, the
    bf16 one at half the bytes; compiled, the two reduce their lanes in other orders, so their bits differ; any
    strides: the transposed view of the stored [E, d] gate reads coalesced). Returns (ids [B, k] int64
    (`ids_dtype`), weights [B, k] fp32, logits [B, E] fp32, select [B, E] fp32), all on x's device, no host sync.
    block_e / block_d (powers of two): the logits launch's tile; d_splits: its programs along d; num_warps: its
    warps (the select launch keeps 4). Other knobs give other logits bits (another reduction order), the same
    within fp32 rounding; the defaults are the module constants. `ids_dtype` int32 writes the ids as the MoE
    kernels read them (no conversion launch after this one). `fold`: the select in the logits launch's last
    arriving program of each row (one launch; the same bits as the two), default the `FOLD_ENV` switch (on)."""
    B, d = x.shape
    E = check_route_args(x, gate_t, bias, k, (torch.float32, torch.bfloat16, torch.float16))
    for name, v in (("block_e", block_e), ("block_d", block_d), ("num_warps", num_warps)):
        if v < 1 or v & (v - 1):
            raise ValueError(f"{name} must be a power of two, got {v}")
    if d_splits < 1:
        raise ValueError(f"d_splits must be >= 1, got {d_splits}")
    if ids_dtype not in (torch.int32, torch.int64):
        raise ValueError(f"ids_dtype must be int32 or int64, got {ids_dtype}")
    if x.stride(1) != 1:
        x = x.contiguous()
    if bias is not None and bias.stride(0) != 1:
        bias = bias.contiguous()
    dev = x.device
    chunks = triton.cdiv(d, block_d)
    per_split = triton.cdiv(chunks, d_splits)
    part = torch.empty(B, d_splits, E, dtype=torch.float32, device=dev)
    ids, weights, logits, select = route_outputs(B, E, k, ids_dtype, dev)
    if B == 0:
        return ids, weights, logits, select
    tail = (bias if bias is not None else part, logits, select, ids, weights)
    select_kw = dict(SPLITS=d_splits, EP=triton.next_power_of_2(E), TOPK=k, KP=triton.next_power_of_2(k),
                     HAS_BIAS=bias is not None, RENORM=bool(renorm and k > 1))
    fold = switched_on(FOLD_ENV) if fold is None else fold
    _router_logits_kernel[(B, triton.cdiv(E, block_e), d_splits)](
        x, x.stride(0), gate_t, gate_t.stride(0), gate_t.stride(1), part, d, E,
        _COUNTERS.get(dev, B, "router") if fold else part, *tail, float(temp), float(scale),
        CHUNKS_PER_SPLIT=per_split, BE=block_e, BD=block_d, FOLD=fold, **select_kw, num_warps=num_warps,
        **pdl_launch(dev))
    if not fold:
        _router_select_kernel[(B,)](part, *tail, E, float(temp), float(scale), **select_kw, num_warps=4,
                                    **pdl_launch(dev))
    return ids, weights, logits, select
