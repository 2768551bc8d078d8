"""Argument checks of the mHC site launchers (kernels/step/mhc.py's row kernels and kernels/step/mhc_prefill.py's
prefill tiles; kept apart as attention_args.py is). Each names the argument and what it should be; none launches
anything."""

from __future__ import annotations

import torch

from .live import live_rows as _live_rows


def _streams(x: torch.Tensor) -> tuple[int, int, int]:
    if x.dim() != 3 or not x.is_contiguous():
        raise ValueError(f"streams must be a contiguous [B, hc, d] tensor, got {tuple(x.shape)}")
    return tuple(x.shape)


def _coeff(t: torch.Tensor, shape: tuple, name: str) -> torch.Tensor:
    if tuple(t.shape) != shape or t.dtype != torch.float32:
        raise ValueError(f"{name} must be fp32 {list(shape)}, got {t.dtype} {list(t.shape)}")
    return t.contiguous()


def site_args(x, y, post_in, comb_in, fn_t, base, scale, pre_in, norm_weight, iters, rows) -> tuple:
    """A site launch's arguments checked (a clear error naming the wrong one) and its outputs allocated, for the
    row kernels here and the prefill tiles (mhc_prefill.py): (B, hc, d, nmix, rows, expand, y, post_in, comb_in,
    pre_in, xo, h, pre, post, comb); xo is the expand's X' (x itself without one), h [B, d] in x's dtype, pre / post
    [B, hc] and comb [B, hc, hc] fp32."""
    B, hc, d = _streams(x)
    rows = _live_rows(rows, B)
    nmix = (2 + hc) * hc
    if tuple(fn_t.shape) != (hc * d, nmix) or fn_t.dtype != torch.float32:
        raise ValueError(f"fn_t must be fp32 [{hc * d}, {nmix}], got {fn_t.dtype} {list(fn_t.shape)}")
    if base.numel() != nmix or scale.numel() != 3 or norm_weight.numel() != d or iters < 1:
        raise ValueError("base [(2 + hc) * hc], scale [3], norm_weight [d] and iters >= 1 expected")
    pre_in = _coeff(pre_in, (B, hc), "pre_in")
    expand = y is not None
    xo = torch.empty_like(x) if expand else x
    if expand:
        if tuple(y.shape) != (B, d) or y.dtype not in (x.dtype, torch.float32):
            raise ValueError(f"y must be [{B}, {d}] {x.dtype} or fp32, got {y.dtype} {list(y.shape)}")
        y, post_in, comb_in = y.contiguous(), _coeff(post_in, (B, hc), "post"), _coeff(comb_in, (B, hc, hc), "comb")
    else:
        y, post_in, comb_in = x, pre_in, pre_in  # unused (EXPAND off)
    h = torch.empty(B, d, dtype=x.dtype, device=x.device)
    pre = torch.empty(B, hc, dtype=torch.float32, device=x.device)
    post = torch.empty_like(pre)
    comb = torch.empty(B, hc, hc, dtype=torch.float32, device=x.device)
    return B, hc, d, nmix, rows, expand, y, post_in, comb_in, pre_in, xo, h, pre, post, comb
