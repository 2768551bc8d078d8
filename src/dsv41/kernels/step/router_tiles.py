"""The MoE router of prefill rows: the logits as one tiled product, then the select launch of `router.py`.

`router.route_rows` gives each row its own programs (decode rows: a few rows, the gate read once per row from L2);
a prefill chunk of 2,048 rows read the 7.8 MB fp32 gate 2,048 times (1.9 ms a layer on the H100). Here a program
owns BM rows x BE experts and runs the whole d loop: logits[r, e] = (x[r] . gate[:, e]) in fp32, the gate read once
per BM rows. The gate as stored: bf16 (the release) goes on the tensor cores with x's bf16 values (exact products,
fp32 sums); an fp32 gate (the reference's) takes an IEEE fp32 dot. The select is `router._router_select_kernel`
on these logits (one "split"): softplus / sqrt in fp64, bias, top-k with ties to the lower id, weights.

Row invariance: each logit is one output element of the dot over the whole d in a fixed order (the tile shape is
fixed), so a row's logits, ids and weights do not depend on the other rows of the chunk (chunked == one-shot).
Against the reference (`model.moe.route`) only the fp32 sum order of the logits differs.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..exl3.backend import interpreting
from .router import _router_select_kernel, check_route_args, route_outputs

BM, BE, BK = 64, 64, 64
# Triton's interpreter has no bf16 dot: there bf16 values go in as fp32 (the same exact products)
MMA = tl.constexpr(not interpreting())


@triton.jit(do_not_specialize=["B"])
def _logits_tile_kernel(x_ptr, stride_x, gate_ptr, stride_gd, stride_ge, out_ptr, B, d, E,
                        BM: tl.constexpr, BE: tl.constexpr, BK: tl.constexpr, BF16: tl.constexpr):
    rb = tl.program_id(0)
    eb = tl.program_id(1)
    rows = rb * BM + tl.arange(0, BM)
    e = eb * BE + tl.arange(0, BE)
    r_ok = rows < B
    e_ok = e < E
    acc = tl.zeros((BM, BE), dtype=tl.float32)
    for k0 in range(0, d, BK):
        k = k0 + tl.arange(0, BK)
        k_ok = k < d
        x = tl.load(x_ptr + rows[:, None].to(tl.int64) * stride_x + k[None, :], mask=r_ok[:, None] & k_ok[None, :],
                    other=0.0)
        g = tl.load(gate_ptr + k[:, None].to(tl.int64) * stride_gd + e[None, :].to(tl.int64) * stride_ge,
                    mask=k_ok[:, None] & e_ok[None, :], other=0.0)
        if BF16 and MMA:
            acc = tl.dot(x.to(tl.bfloat16), g.to(tl.bfloat16), acc)
        else:
            acc = tl.dot(x.to(tl.float32), g.to(tl.float32), acc, input_precision="ieee")
    tl.store(out_ptr + rows[:, None].to(tl.int64) * E + e[None, :], acc, mask=r_ok[:, None] & e_ok[None, :])


def route_rows_tiles(x: torch.Tensor, gate_t: torch.Tensor, bias: torch.Tensor | None, k: int, *, scale: float,
                     renorm: bool, temp: float = 1.0, ids_dtype: torch.dtype = torch.int64):
    """`router.route_rows`'s function and outputs (ids [B, k], weights [B, k] fp32, logits [B, E] fp32, select
    [B, E] fp32) for prefill rows x [B, d] (bf16 / fp16 / fp32) and gate_t [d, E] (fp32 or bf16, any strides).
    The bf16 gate's tensor-core path needs x's values bf16 ones (the model's bf16 activations)."""
    B, d = x.shape
    E = check_route_args(x, gate_t, bias, k, (torch.float32, torch.bfloat16))
    bf16 = gate_t.dtype == torch.bfloat16
    if bf16 and x.dtype not in (torch.bfloat16,):
        raise ValueError(f"a bf16 gate takes bf16 rows (exact products), got {x.dtype}")
    if x.stride(1) != 1:
        x = x.contiguous()
    dev = x.device
    ids, weights, logits, select = route_outputs(B, E, k, ids_dtype, dev)
    if B == 0:
        return ids, weights, logits, select
    part = torch.empty(B, E, dtype=torch.float32, device=dev)
    _logits_tile_kernel[(triton.cdiv(B, BM), triton.cdiv(E, BE))](
        x, x.stride(0), gate_t, gate_t.stride(0), gate_t.stride(1), part, B, d, E, BM=BM, BE=BE, BK=BK, BF16=bf16,
        num_warps=4)
    b = bias.contiguous() if bias is not None else part
    _router_select_kernel[(B,)](part, b, logits, select, ids, weights, E, float(temp), float(scale), SPLITS=1,
                                EP=triton.next_power_of_2(E), TOPK=k, KP=triton.next_power_of_2(k),
                                HAS_BIAS=bias is not None, RENORM=bool(renorm and k > 1), num_warps=4)
    return ids, weights, logits, select


def rows_product_tiles(x: torch.Tensor, mat_t: torch.Tensor) -> torch.Tensor:
    """x [B, d] @ mat_t [d, N] in fp32 [B, N], each output element one dot over the whole d in the tile kernel's
    fixed order: a row's bits never depend on B or the other rows (cuBLAS picks its kernel, split-K among them, by
    the row count, so its bits do). bf16 x and bf16 mat_t go on the tensor cores (exact products, fp32 sums); other
    float dtypes take an IEEE fp32 dot of their values. For the prefill rows of native matrices (the indexer's
    weights_proj [32, 5120]): chunked == one-shot."""
    if x.dim() != 2 or mat_t.dim() != 2 or x.shape[1] != mat_t.shape[0]:
        raise ValueError(f"x {list(x.shape)} and mat_t {list(mat_t.shape)} do not multiply")
    if not (x.is_floating_point() and mat_t.is_floating_point()):
        raise ValueError(f"float operands only, got {x.dtype} and {mat_t.dtype}")
    if x.stride(1) != 1:
        x = x.contiguous()
    B, d = x.shape
    N = mat_t.shape[1]
    out = torch.empty(B, N, dtype=torch.float32, device=x.device)
    if B == 0 or N == 0:
        return out
    bf16 = x.dtype == torch.bfloat16 and mat_t.dtype == torch.bfloat16
    _logits_tile_kernel[(triton.cdiv(B, BM), triton.cdiv(N, BE))](
        x, x.stride(0), mat_t, mat_t.stride(0), mat_t.stride(1), out, B, d, N, BM=BM, BE=BE, BK=BK, BF16=bf16,
        num_warps=4)
    return out
