"""The mHC sites of a fast forward (MODEL.md §6): each site in one launch of the step kernels where Triton runs
them (kernels/step/mhc.py), else the reference math (`hc_coefficients`, `model.mhc`, `rms_norm`)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from dsv41.config import ModelConfig
from dsv41.kernels.step import mhc as step_mhc
from dsv41.kernels.step import mhc_blocks as step_mhc_blocks
from dsv41.kernels.step import mhc_prefill as step_mhc_prefill
from dsv41.kernels.step import mhc_split as step_mhc_split
from dsv41.model import mhc
from dsv41.model.norm import rms_norm
from dsv41.model.rowwise import f64

from .layers.attention import step_kernels_run
from .layers.linear import is_fused


@dataclass
class HC:
    """One mHC site: the reference's HCParams with the mixing matrix transposed once."""

    fn_t: torch.Tensor  # [hc * d, (2 + hc) * hc] fp32
    base: torch.Tensor
    scale: torch.Tensor


def hc_coefficients(x: torch.Tensor, p: HC, hc: int, norm_eps: float, hc_eps: float, iters: int):
    """`mhc.coefficients` with the mixing product over the whole bucket in one matmul."""
    flat = x.float().reshape(x.shape[0], -1)
    m = (flat @ p.fn_t) * f64(torch.rsqrt, flat.pow(2).mean(dim=-1, keepdim=True) + norm_eps)
    base, scale = p.base, p.scale
    pre = f64(torch.sigmoid, m[:, :hc] * scale[0] + base[:hc]) + hc_eps
    post = 2 * f64(torch.sigmoid, m[:, hc:2 * hc] * scale[1] + base[hc:2 * hc])
    comb_logits = (m[:, 2 * hc:] * scale[2] + base[2 * hc:]).view(-1, hc, hc)
    return pre, post, mhc.sinkhorn(comb_logits, iters, hc_eps)


@dataclass(frozen=True)
class MhcSites:
    """The mHC work of a forward: each site in one launch of the step kernels (kernels/step/mhc.py: coefficients,
    Sinkhorn, collapse and norm, fused with the expand before the site) wherever Triton runs them (CUDA, or the
    interpreter), else the reference math of `hc_coefficients`, `mhc` and `rms_norm`. Prefill rows' sites take the
    tile launches where `DSV41_PREFILL_MHC_TILES=1` (kernels/step/mhc_prefill.py: tiles of rows x splits of d, fn read
    once a tile, not once a row; other bits than the row kernels', row-invariant too), or the row-block launches where
    `DSV41_PREFILL_MHC_BLOCKS=1` (kernels/step/mhc_blocks.py: blocks of 32 rows x splits of d on CUDA cores, then a
    finishing launch; other bits again, row-invariant; over the tiles where both are set), or by default (unless
    `DSV41_PREFILL_MHC_SPLIT=0`) three plain launches (kernels/step/mhc_split.py: expand + collapse elementwise, the
    mixing product split-K on the bf16 tensor cores, a finish per row; other bits than the row kernels', row-invariant;
    over the tiles and the blocks); decode and verify rows keep the row kernels."""

    hc: int
    eps: float  # the norms' and the mixing rsqrt's
    hc_eps: float
    iters: int
    kernels: bool
    rows: int | None = None  # the kernels run the first `rows` rows (the real ones); the others come out zero
    tiles: bool = False  # the sites as tiles of rows (prefill rows, `DSV41_PREFILL_MHC_TILES=1`)
    blocks: bool = False  # the sites as row blocks (prefill rows, `DSV41_PREFILL_MHC_BLOCKS=1`; over `tiles`)
    split: bool = False  # the sites as three launches (prefill rows, on unless `DSV41_PREFILL_MHC_SPLIT=0`; over both)

    @classmethod
    def of(cls, cfg: ModelConfig, device: torch.device, rows: int | None = None,
           phase: str = "decode") -> "MhcSites":
        kernels = step_kernels_run(device)
        prefill = kernels and not is_fused(phase)
        return cls(cfg.hc_mult, cfg.rms_norm_eps, cfg.hc_eps, cfg.hc_sinkhorn_iters, kernels, rows,
                   prefill and step_mhc_prefill.tiles_on(), prefill and step_mhc_blocks.blocks_on(),
                   prefill and step_mhc_split.split_on())

    def _k(self) -> dict:
        return dict(norm_eps=self.eps, hc_eps=self.hc_eps, iters=self.iters, rms_eps=self.eps, rows=self.rows)

    def site(self, x, p: HC, pre_in, norm):
        """(h = rms_norm(collapse(x, pre_in)), pre, post, comb = H(x))."""
        if self.kernels:
            launch = (step_mhc_split.hc_site_split if self.split else
                      step_mhc_blocks.hc_site_blocks if self.blocks else
                      step_mhc_prefill.hc_site_tiles if self.tiles else step_mhc.hc_site)
            return launch(x, p.fn_t, p.base, p.scale, pre_in, norm, **self._k())
        pre, post, comb = hc_coefficients(x, p, self.hc, self.eps, self.hc_eps, self.iters)
        return rms_norm(mhc.collapse(x, pre_in), norm, self.eps), pre, post, comb

    def expand_site(self, y, x, post, comb, p: HC, pre_in, norm):
        """x' = expand(y, x, post, comb), then `site(x', p, pre_in, norm)`: (x', h, pre', post', comb')."""
        if self.kernels:
            launch = (step_mhc_split.hc_expand_site_split if self.split else
                      step_mhc_blocks.hc_expand_site_blocks if self.blocks else
                      step_mhc_prefill.hc_expand_site_tiles if self.tiles else step_mhc.hc_expand_site)
            return launch(y, x, post, comb, p.fn_t, p.base, p.scale, pre_in, norm, **self._k())
        x = mhc.expand(y, x, post, comb)
        return (x, *self.site(x, p, pre_in, norm))

    def expanded(self, x, pending):
        """x with a pending FFN expand `(y, post, comb)` applied (before an Engram layer and the final norm)."""
        if pending is None:
            return x
        y, post, comb = pending
        return step_mhc.hc_expand(y, x, post, comb, rows=self.rows) if self.kernels else mhc.expand(y, x, post, comb)

    def collapse_norm(self, x, pre, norm):
        if self.kernels:
            return step_mhc.collapse_norm(x, pre, norm, rms_eps=self.eps, rows=self.rows)
        return rms_norm(mhc.collapse(x, pre), norm, self.eps)
