"""The training forward: the reference math of model/ over a batch of whole sequences, differentiable.

Why not model/ itself: the reference runs one sequence at a time, every matrix product row by row and every
transcendental in fp64 (row invariance for bitwise chunking tests), and keeps its caches in a per-sequence state.
A training step wants [B, T] at once, bf16 autocast and autograd. So this module computes the same function of
the same tensors (same names, same shapes, same storage roundings) batched, and reuses model/'s pieces wherever
they are batch-agnostic and differentiable: RMSNorm, RoPE, the mHC Sinkhorn / collapse / expand, the clamped
SwiGLU expert, the Engram projection and gate, deterministic top-k, the indexer's candidate mask and selection, and
the fake quantisers (through quant.py's straight-through wrappers). What differs and why:

- one-shot over whole sequences: the window is a band mask over the sequence, compressed entries are all formed at
  once and a query sees those closed at or before it (the reference's visibility rule), the top-k is one sort;
- routed experts run densely with zero weights for unselected experts (no host sync, same sum);
- the lightning indexer gets no gradient through its discrete top-k, so it is trained as DeepSeek trains it
  (V3.2 DSA): a KL loss between its score softmax and the main attention's head-summed distribution over the
  visible compressed entries, with its inputs detached so this loss moves the indexer alone;
- the router bias is selection-only and not learned by gradient: aux-loss-free balancing moves it after each step;
- DSpark (MODEL.md §10) is trained on detached taps (the release trains it on a frozen backbone): at sampled anchor
  positions p, a block [y = token p+1, noise x 4] at positions p+1.. attends the stage's ring (main_x of
  positions p-W+1..p) and the whole block; row i, with the Markov head fed the true token p+1+i, is trained to
  the backbone's own next-token distribution at p+1+i (the acceptance target of verification), and the
  confidence head to whether the row's argmax equals the backbone's.

`TinyNet.reference_logits` checks the claim: tests compare it with `load_model` on the exported checkpoint.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

from dsv41.config import LayerRole, ModelConfig
from dsv41.model import mhc
from dsv41.model.attention import Attention
from dsv41.model.engram import engram_mix, engram_project
from dsv41.model.moe import Expert, swiglu_clamped
from dsv41.model.norm import rms_norm
from dsv41.model.rope import rope_tables
from dsv41.model.topk import topk_lowest_index_ties

from . import quant
from .layout import TensorSpec


def param_key(name: str) -> str:
    return name.replace(".", "__")


NOT_LEARNED = (".ffn.gate.bias", ".ffn.gate.bias_vl")  # selection-only router bias: moved by load balancing


@dataclass
class Losses:
    total: torch.Tensor
    lm: torch.Tensor
    draft: torch.Tensor
    confidence: torch.Tensor
    indexer: torch.Tensor
    lm_acc: torch.Tensor
    draft_acc: torch.Tensor

    def floats(self) -> dict[str, float]:
        return {k: float(v.detach()) for k, v in self.__dict__.items()}


class TinyNet(nn.Module):
    def __init__(self, cfg: ModelConfig, specs: list[TensorSpec]):
        super().__init__()
        self.cfg = cfg
        self.kinds = {s.name: s.kind for s in specs}
        self.weights = nn.ParameterDict({
            param_key(s.name): nn.Parameter(torch.zeros(s.shape), requires_grad=not s.name.endswith(NOT_LEARNED))
            for s in specs})
        self.rope = rope_tables(cfg)
        n_all = cfg.num_hidden_layers + cfg.n_dspark
        self.roles = [cfg.role(L) for L in range(n_all)]
        # model/ Attention objects for their batch-agnostic helpers (candidate mask, selection); no weights
        self._helpers = {r.index: Attention(cfg, r, None, None, local_heads=cfg.num_attention_heads)
                         for r in self.roles}
        self._cache: dict[str, torch.Tensor] = {}
        self.loads: dict[str, torch.Tensor] = {}
        self.fake_quant = True  # the activation quantisers (load_model's fake_quant; off only for checks)

    def _fq(self, fn, x: torch.Tensor) -> torch.Tensor:
        return fn(x) if self.fake_quant else x

    # ------------------------------------------------------------------ weights
    def raw(self, name: str) -> nn.Parameter:
        return self.weights[param_key(name)]

    def names(self) -> list[str]:
        return list(self.kinds)

    def refresh_weights(self) -> None:
        """Every effective (stored-and-read-back) weight, computed once per forward, a storage kind at a time."""
        by_kind: dict[str, list[str]] = {}
        for name, kind in self.kinds.items():
            by_kind.setdefault(kind, []).append(name)
        self._cache = {}
        for kind, names in by_kind.items():
            self._cache.update(zip(names, quant.stored_all([self.raw(n) for n in names], kind)))

    def w(self, name: str) -> torch.Tensor:
        if name not in self._cache:
            self.refresh_weights()
        return self._cache[name]

    def lin(self, x: torch.Tensor, prefix: str) -> torch.Tensor:
        return x @ self.w(prefix + ".weight").t()

    def _fp32_lin(self, x: torch.Tensor, prefix: str) -> torch.Tensor:
        with torch.autocast(x.device.type, enabled=False):
            return x.float() @ self.w(prefix + ".weight").float().t()

    # ------------------------------------------------------------------ pieces
    def _coefficients(self, x: torch.Tensor, prefix: str, site: str):
        """mhc.coefficients over all rows at once (the mixing product kept in fp32, as in the reference)."""
        cfg, hc = self.cfg, self.cfg.hc_mult
        fn, base, scale = (self.w(f"{prefix}hc_{site}_{k}") for k in ("fn", "base", "scale"))
        with torch.autocast(x.device.type, enabled=False):
            flat = x.float().reshape(x.shape[0], -1)
            m = (flat @ fn.float().t()) * torch.rsqrt(flat.pow(2).mean(dim=-1, keepdim=True) + cfg.rms_norm_eps)
            pre = torch.sigmoid(m[:, :hc] * scale[0] + base[:hc]) + cfg.hc_eps
            post = 2 * torch.sigmoid(m[:, hc:2 * hc] * scale[1] + base[hc:2 * hc])
            comb = mhc.sinkhorn((m[:, 2 * hc:] * scale[2] + base[2 * hc:]).view(-1, hc, hc), cfg.hc_sinkhorn_iters,
                                cfg.hc_eps)
        return pre, post, comb

    def _norm(self, x: torch.Tensor, name: str) -> torch.Tensor:
        return rms_norm(x, self.w(name), self.cfg.rms_norm_eps)

    def _block(self, prefix: str, x: torch.Tensor, pre_in: torch.Tensor, attend, moe_args):
        """Block.run batched: both sublayers with single-pass mHC; returns (streams, the FFN site's pre)."""
        a_pre, a_post, a_comb = self._coefficients(x, prefix, "attn")
        h = self._norm(mhc.collapse(x, pre_in), f"{prefix}attn_norm.weight")
        x = mhc.expand(attend(h).float(), x, a_post, a_comb)
        f_pre, f_post, f_comb = self._coefficients(x, prefix, "ffn")
        h = self._norm(mhc.collapse(x, a_pre), f"{prefix}ffn_norm.weight")
        x = mhc.expand(self._moe(h, prefix, *moe_args), x, f_post, f_comb)
        return x, f_pre

    def _moe(self, h: torch.Tensor, prefix: str, n_experts: int, topk: int) -> torch.Tensor:
        cfg, f = self.cfg, prefix + "ffn."
        logits = self._fp32_lin(h, f"{f}gate") / cfg.gate_temp
        scores = torch.sqrt(F.softplus(logits))
        bias = self.w(f"{f}gate.bias")
        ids = topk_lowest_index_ties((scores + bias.float()).detach(), topk)
        weights = scores.gather(1, ids)
        if cfg.norm_topk_prob and topk > 1:
            weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
        weights = weights * cfg.routed_scaling_factor
        dense = torch.zeros(h.shape[0], n_experts, device=h.device, dtype=weights.dtype).scatter(1, ids, weights)
        if self.training:
            key = f"{f}gate.bias"  # summed over a step's micro-batches
            self.loads[key] = self.loads.get(key, 0) + torch.bincount(ids.flatten(), minlength=n_experts).float()
        y = torch.zeros(h.shape[0], h.shape[1], dtype=torch.float32, device=h.device)
        for e in range(n_experts):
            y = y + swiglu_clamped(h, self._expert(f"{f}experts.{e}."), cfg.swiglu_limit, dense[:, e])
        if cfg.n_shared_experts:
            y = y + swiglu_clamped(h, self._expert(f"{f}shared_experts."), cfg.swiglu_limit, None)
        return y

    def _expert(self, p: str) -> Expert:
        return Expert(w1=lambda x: self.lin(x, p + "w1"), w2=lambda x: self.lin(x, p + "w2"),
                      w3=lambda x: self.lin(x, p + "w3"))

    def _rope(self, role: LayerRole, x: torch.Tensor, pos: torch.Tensor, inverse: bool = False) -> torch.Tensor:
        return self.rope[role.rope_kind].apply(x, pos, self.cfg.qk_rope_head_dim, inverse=inverse)

    def _query(self, role, a: str, h: torch.Tensor, pos: torch.Tensor):
        qr = self._norm(self.lin(h, a + "wq_a"), a + "q_norm.weight")
        q = self._rope(role, self.lin(qr, a + "wq_b").view(h.shape[0], -1, self.cfg.head_dim), pos)
        return qr, q

    def _window_kv(self, role, a: str, h: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        kv = self._norm(self.lin(h, a + "wkv"), a + "kv_norm.weight")
        return self._fq(quant.kv_fp8, self._rope(role, kv, pos))

    def _output(self, role, a: str, o: torch.Tensor, pos: torch.Tensor, dtype) -> torch.Tensor:
        cfg = self.cfg
        o = self._rope(role, o.to(dtype), pos, inverse=True)
        G = cfg.o_groups
        groups = o.reshape(o.shape[0], G, -1)
        wo_a = self.w(a + "wo_a.weight").view(G, cfg.o_lora_rank, -1)
        u = torch.einsum("ngi,goi->ngo", groups, wo_a.to(groups.dtype)).reshape(o.shape[0], -1)
        return self.lin(u, a + "wo_b")

    def _softmax_with_sink(self, logits: torch.Tensor, a: str) -> torch.Tensor:
        """Probabilities over the last dim of fp32 logits [..., H, S] with the head's sink in the denominator."""
        sink = self.w(a + "attn_sink").float()
        sink = sink.view(*([1] * (logits.dim() - 2)), -1, 1).expand(*logits.shape[:-1], 1)
        return torch.softmax(torch.cat((logits, sink), dim=-1), dim=-1)[..., :-1]

    # ------------------------------------------------------------------ backbone attention
    def _attention(self, L: int, h: torch.Tensor, B: int, T: int, pos: torch.Tensor, ctx: dict) -> torch.Tensor:
        cfg, role = self.cfg, self.roles[L]
        a = f"layers.{L}.attn."
        N, H, hd, W = h.shape[0], cfg.num_attention_heads, cfg.head_dim, cfg.sliding_window
        qr, q = self._query(role, a, h, pos)
        kv = self._window_kv(role, a, h, pos)
        scale = hd ** -0.5
        # window: queries in blocks of W see the previous block and their own (band mask)
        nb = -(-T // W)
        pad = nb * W - T
        qb = F.pad(q.view(B, T, H, hd), (0, 0, 0, 0, 0, pad)).view(B, nb, W, H, hd)
        kb = F.pad(kv.view(B, T, hd), (0, 0, 0, pad)).view(B, nb, W, hd)
        keys = torch.cat((F.pad(kb, (0, 0, 0, 0, 1, 0))[:, :-1], kb), dim=2)  # [B, nb, 2W, hd]
        s_win = torch.einsum("bjihd,bjkd->bjihk", qb.float(), keys.float()) * scale
        i = torch.arange(W, device=h.device)
        kk = torch.arange(2 * W, device=h.device)
        band = (kk[None, :] > i[:, None]) & (kk[None, :] <= i[:, None] + W)  # key pos in [t-W+1, t]
        first = torch.zeros(nb, 1, 2 * W, dtype=torch.bool, device=h.device)
        first[0, :, :W] = True  # the block before the first does not exist
        ok_win = (band[None] & ~first)[None, :, :, None, :]  # [1, nb, W, 1, 2W]
        s_win = s_win.masked_fill(~ok_win, float("-inf")).reshape(B, nb * W, H, 2 * W)[:, :T]
        parts, values = [s_win], None
        if not role.swa_only:
            src = ctx["sources"].setdefault(role.kv_source, {})
            if role.compresses:
                self._compress(L, h, B, T, src)
            ids = self._topk(L, h, qr, q, B, T, pos, src, ctx) if role.scores else ctx["topk"].get(role.index_source)
            if ids is not None and ids.shape[-1]:
                comp = src["kv"]  # [B, C, hd]
                kc = torch.gather(comp[:, None].expand(B, T, -1, -1), 2,
                                  ids.clamp(min=0)[..., None].expand(-1, -1, -1, hd))  # [B, T, k, hd]
                s_c = torch.einsum("bthd,btkd->bthk", q.view(B, T, H, hd).float(), kc.float()) * scale
                parts.append(s_c.masked_fill(~(ids >= 0)[:, :, None, :], float("-inf")))
                values = kc
        p = self._softmax_with_sink(torch.cat(parts, dim=-1), a)
        pw = F.pad(p[..., :2 * W], (0, 0, 0, 0, 0, pad)).view(B, nb, W, H, 2 * W)
        o = torch.einsum("bjihk,bjkd->bjihd", pw, keys.float()).reshape(B, nb * W, H, hd)[:, :T]
        if values is not None:
            o = o + torch.einsum("bthk,btkd->bthd", p[..., 2 * W:], values.float())
        return self._output(role, a, o.reshape(N, H, hd), pos, h.dtype)

    def _compress(self, L: int, h: torch.Tensor, B: int, T: int, src: dict) -> None:
        """All compressed entries (and index keys) of the sequence: groups of `ratio` tokens from position 0."""
        cfg, role = self.cfg, self.roles[L]
        a = f"layers.{L}.attn."
        c, r = a + "compressor.", role.compress_ratio
        if r == 1:
            latent = self._norm(self.lin(h, c + "wkv"), c + "norm.weight").view(B, T, -1)
        else:
            n, hd = T // r, cfg.head_dim
            v = self.lin(h.float(), c + "wkv").float().view(B, T, hd)[:, :n * r].reshape(B, n, r, hd)
            s = self.lin(h.float(), c + "wgate").float().view(B, T, hd)[:, :n * r].reshape(B, n, r, hd)
            pooled = (torch.softmax(s, dim=2) * v).sum(dim=2)
            latent = self._norm(pooled.to(h.dtype), c + "norm.weight")
        C = latent.shape[1]
        entry_pos = (torch.arange(C, device=h.device) * r).repeat(B)
        flat = latent.reshape(B * C, -1)
        src["kv"] = self._fq(quant.compressed_fp4, self._rope(role, flat, entry_pos)).view(B, C, -1)
        src["ratio"] = r
        if role.scores:  # the index keys come from the pre-RoPE latent, detached: only the indexer loss trains them
            k = self._norm(self.lin(flat.detach(), a + "indexer.wk"), a + "indexer.k_norm.weight")
            src["index_k"] = self._fq(quant.index_fp4, self._rope(role, k, entry_pos)).view(B, C, -1)

    def _topk(self, L, h, qr, q, B, T, pos, src, ctx) -> torch.Tensor:
        cfg, role = self.cfg, self.roles[L]
        a = f"layers.{L}.attn.indexer."
        C = src["kv"].shape[1]
        if C == 0:
            ids = torch.empty(B, T, 0, dtype=torch.long, device=h.device)
            ctx["topk"][L] = ids
            return ids
        nh, ihd = cfg.index_n_heads, cfg.index_head_dim
        iq = self._fq(quant.index_fp4, self._rope(role, self.lin(qr.detach(), a + "wq_b").view(-1, nh, ihd), pos))
        wts = self.lin(h.detach(), a + "weights_proj").float() * (ihd ** -0.5) * (nh ** -0.5)
        per_head = torch.relu(torch.einsum("bthd,bcd->bthc", iq.view(B, T, nh, ihd).float(),
                                           src["index_k"].float()))
        scores = (wts.view(B, T, nh, 1) * per_head).sum(dim=2)  # [B, T, C]
        n_visible = torch.div(torch.arange(T, device=h.device) + 1, role.compress_ratio, rounding_mode="floor")
        visible = (torch.arange(C, device=h.device)[None, :] < n_visible[:, None])[None].expand(B, -1, -1)
        masked = scores.masked_fill(~visible, float("-inf"))
        helper = self._helpers[L]
        chosen = masked.detach().reshape(B * T, C)
        if role.is_candidate_source:
            ctx["candidates"] = helper._candidate_mask(chosen, n_visible.repeat(B))
        elif role.uses_candidates:
            chosen = chosen.masked_fill(~ctx["candidates"], float("-inf"))
        ids = helper._select(chosen, min(cfg.index_topk, C)).view(B, T, -1)
        ctx["topk"][L] = ids
        if self.training:
            ctx["indexer"].append(self._indexer_kl(masked, visible, q.detach(), src["kv"].detach(), B, T))
        return ids

    @staticmethod
    def _indexer_kl(masked_scores, visible, q, comp, B, T) -> torch.Tensor:
        """KL(main attention's head-summed distribution over visible entries || softmax of index scores), the
        mean over the queries that see any entry (no data-dependent branch or indexing: no host sync)."""
        rows = visible.any(dim=-1)  # [B, T]
        with torch.no_grad():
            H = q.shape[1]
            logits = torch.einsum("bthd,bcd->bthc", q.view(B, T, H, -1).float(), comp.float())
            logits = logits.masked_fill(~visible[:, :, None, :], float("-inf"))
            target = torch.softmax(logits, dim=-1).nan_to_num(0.0).sum(dim=2)
            target = target / target.sum(dim=-1, keepdim=True).clamp(min=1e-20)  # rows seeing nothing: all 0
        logq = torch.log_softmax(torch.where(rows[..., None], masked_scores.float(), 0.0), dim=-1)
        kl = (torch.xlogy(target, target) - target * logq.masked_fill(target == 0, 0.0)).sum(dim=-1)
        return kl.sum() / rows.sum().clamp(min=1)

    # ------------------------------------------------------------------ whole model
    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        return self.w("embed.weight")[ids]

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self._fp32_lin(hidden, "head")

    def backbone(self, ids: torch.Tensor, engram_rows: torch.Tensor | None, ctx: dict | None = None):
        """ids [B, T] -> (final-normed hidden [B*T, d], taps [B*T, n_taps*d])."""
        cfg = self.cfg
        self.refresh_weights()
        B, T = ids.shape
        N = B * T
        ctx = ctx if ctx is not None else {}
        ctx.update(sources={}, topk={}, candidates=None, indexer=ctx.get("indexer", []))
        pos = torch.arange(T, device=ids.device).repeat(B)
        h = self.embed(ids.reshape(-1)).float()
        x = h[:, None, :].expand(N, cfg.hc_mult, h.shape[-1]).contiguous()
        pre = torch.zeros(N, cfg.hc_mult, device=ids.device)
        pre[:, 0] = 1.0
        taps = []
        for L in range(cfg.num_hidden_layers):
            if L in cfg.engram_layer_ids:
                x = self._engram(L, x, engram_rows[:, :, cfg.engram_layer_ids.index(L)].reshape(N, -1))
            if L in cfg.dspark_target_layer_ids:
                taps.append(x.float().mean(dim=1))
            x, pre = self._block(f"layers.{L}.", x, pre,
                                 lambda hh, L=L: self._attention(L, hh, B, T, pos, ctx),
                                 (cfg.n_routed_experts, cfg.num_experts_per_tok))
        out = self._norm(mhc.collapse(x, pre), "norm.weight")
        return out, (torch.cat(taps, dim=-1) if taps else None)

    def _engram(self, L: int, x: torch.Tensor, row_ids: torch.Tensor) -> torch.Tensor:
        e = f"layers.{L}.engram."
        rows = self.w(e + "embed.weight")[row_ids]  # [N, cols, head_dim]
        kv = engram_project(rows, lambda r: self.lin(r, e + "wkv"), x.dtype)
        return engram_mix(x, kv, self.w(e + "q_weight"), self.w(e + "k_weight"), self.cfg.rms_norm_eps)

    # ------------------------------------------------------------------ DSpark
    def main_x(self, taps: torch.Tensor) -> torch.Tensor:
        return self._norm(self.lin(taps, "mtp.0.main_proj"), "mtp.0.main_norm.weight")

    def draft_block(self, ids: torch.Tensor, mx: torch.Tensor, anchors: torch.Tensor, markov_prev: torch.Tensor):
        """Draft blocks at `anchors` [B, P] (last committed positions p) of sequences `ids` [B, T] whose main_x
        is `mx` [B, T, d]; block row i's Markov input is `markov_prev` [B, P, Bk] (the draft loop feeds its own
        previous choice; training feeds the true token). Returns (logits [B, P, Bk, V], confidence logits
        [B, P, Bk])."""
        cfg = self.cfg
        B, T = ids.shape
        P, Bk, W, d = anchors.shape[1], cfg.dspark_block_size, cfg.sliding_window, cfg.hidden_size
        M = B * P * Bk
        y = torch.gather(ids, 1, anchors + 1)  # [B, P]
        block_ids = torch.cat((y[..., None], torch.full((B, P, Bk - 1), cfg.dspark_noise_token_id,
                                                        device=ids.device, dtype=ids.dtype)), dim=-1)
        bpos = (anchors[..., None] + 1 + torch.arange(Bk, device=ids.device)).reshape(-1)
        ring_pos = anchors[..., None] - W + 1 + torch.arange(W, device=ids.device)  # [B, P, W]
        ring_ok = ring_pos >= 0
        h = self.embed(block_ids.reshape(-1)).float()
        x = h[:, None, :].expand(M, cfg.hc_mult, d).contiguous()
        pre = torch.zeros(M, cfg.hc_mult, device=ids.device)
        pre[:, 0] = 1.0
        all_pos = torch.arange(T, device=ids.device).repeat(B)
        for s in range(cfg.n_dspark):
            L = cfg.num_hidden_layers + s
            role, a = self.roles[L], f"mtp.{s}.attn."
            ring_kv = self._window_kv(role, a, mx.reshape(B * T, d), all_pos).view(B, T, -1)
            ring = torch.gather(ring_kv[:, None].expand(B, P, T, -1), 2,
                                ring_pos.clamp(min=0)[..., None].expand(-1, -1, -1, ring_kv.shape[-1]))

            def attend(hh, role=role, a=a, ring=ring):
                H, hd = cfg.num_attention_heads, cfg.head_dim
                _, q = self._query(role, a, hh, bpos)
                kvb = self._window_kv(role, a, hh, bpos).view(B, P, Bk, hd)
                keys = torch.cat((ring, kvb), dim=2).float()  # [B, P, W + Bk, hd]
                ok = torch.cat((ring_ok, torch.ones(B, P, Bk, dtype=torch.bool, device=hh.device)), dim=-1)
                sc = torch.einsum("bpihd,bpkd->bpihk", q.view(B, P, Bk, H, hd).float(), keys) * hd ** -0.5
                p = self._softmax_with_sink(sc.masked_fill(~ok[:, :, None, None, :], float("-inf")), a)
                o = torch.einsum("bpihk,bpkd->bpihd", p, keys).reshape(M, H, hd)
                return self._output(role, a, o, bpos, hh.dtype)

            x, pre = self._block(f"mtp.{s}.", x, pre, attend,
                                 (cfg.dspark_n_routed_experts, cfg.dspark_num_experts_per_tok))
        last = f"mtp.{cfg.n_dspark - 1}."
        collapsed = mhc.collapse(x, pre).float()
        base = self.logits(self._norm(collapsed, last + "norm.weight"))
        e = self.w(last + "markov_head.embed.weight").float()[markov_prev.reshape(-1)]
        logits = base + e @ self.w(last + "markov_head.head.weight").float().t()
        conf = torch.cat((collapsed, e), dim=-1) @ self.w(last + "confidence_head.proj.weight").float().t()
        return logits.view(B, P, Bk, -1), conf.view(B, P, Bk)

    # ------------------------------------------------------------------ training step
    def losses(self, ids: torch.Tensor, engram_rows: torch.Tensor | None, anchors: torch.Tensor,
               draft_weight: float = 1.0, confidence_weight: float = 0.1, indexer_weight: float = 1.0) -> Losses:
        """ids [B, T+1] (inputs and targets), anchors [B, P] in [0, T-2]."""
        cfg = self.cfg
        inp, tgt = ids[:, :-1], ids[:, 1:]
        B, T = inp.shape
        ctx: dict = {"indexer": []}
        hidden, taps = self.backbone(inp, engram_rows, ctx)
        logits = self.logits(hidden)  # [B*T, V] fp32
        lm = F.cross_entropy(logits, tgt.reshape(-1))
        lm_acc = (logits.argmax(-1) == tgt.reshape(-1)).float().mean()
        zero = logits.sum() * 0
        indexer = torch.stack(ctx["indexer"]).mean() if ctx["indexer"] else zero
        draft, confidence, draft_acc = zero, zero, zero.detach()
        if cfg.n_dspark and taps is not None and anchors.numel():
            Bk = cfg.dspark_block_size
            mx = self.main_x(taps.detach()).view(B, T, -1)
            rows = anchors[..., None] + 1 + torch.arange(Bk, device=ids.device)  # backbone row predicting row i
            valid = rows < T
            prev = torch.gather(inp, 1, rows.clamp(max=T - 1).reshape(B, -1)).view_as(rows)
            d_logits, conf = self.draft_block(inp, mx, anchors, prev)
            teacher = logits.detach().view(B, T, -1)
            t_rows = torch.gather(teacher, 1, rows.clamp(max=T - 1).reshape(B, -1, 1).expand(-1, -1, teacher.shape[-1]))
            t_prob = torch.softmax(t_rows.view(*rows.shape, -1), dim=-1)
            logq = torch.log_softmax(d_logits, dim=-1)
            per_row = -(t_prob * logq).sum(-1)
            draft = per_row[valid].mean()
            hit = (d_logits.argmax(-1) == t_prob.argmax(-1)).float()
            draft_acc = hit[valid].mean().detach()
            confidence = F.binary_cross_entropy_with_logits(conf[valid], hit[valid])
        total = lm + draft_weight * draft + confidence_weight * confidence + indexer_weight * indexer
        return Losses(total, lm.detach(), draft.detach(), confidence.detach(), indexer.detach(), lm_acc.detach(),
                      draft_acc)

    @torch.no_grad()
    def balance_router(self, rate: float) -> None:
        """Aux-loss-free balancing (DeepSeek-V3): raise the selection bias of under-loaded experts, lower others."""
        for name, load in self.loads.items():
            bias = self.raw(name)
            bias.add_(rate * torch.sign(load.mean() - load))
        self.loads = {}

    # ------------------------------------------------------------------ checks
    @torch.no_grad()
    def reference_logits(self, ids: torch.Tensor, engram_rows: torch.Tensor | None) -> torch.Tensor:
        """Backbone logits [B, T, V] in eval mode (what `load_model` of the export computes)."""
        was = self.training
        self.eval()
        try:
            hidden, _ = self.backbone(ids, engram_rows)
            return self.logits(hidden).view(*ids.shape, -1)
        finally:
            self.train(was)


def init_weights(net: TinyNet, seed: int) -> None:
    """A seeded start: unit norms, 1/sqrt(fan-in) projections (outputs scaled down by depth), identity-leaning
    mHC mixing, zero sinks and router biases."""
    cfg = net.cfg
    g = torch.Generator().manual_seed(seed)
    depth = 1 / math.sqrt(2 * (cfg.num_hidden_layers + cfg.n_dspark))
    hc = cfg.hc_mult
    for name in net.names():
        p = net.raw(name)
        shape = tuple(p.shape)

        def normal(std: float) -> torch.Tensor:
            return torch.randn(shape, generator=g) * std

        if name.endswith(("norm.weight", "q_weight", "k_weight")):
            value = torch.ones(shape)
        elif name.endswith(("attn_sink", "gate.bias", "gate.bias_vl")):
            value = torch.zeros(shape)
        elif name.endswith("_fn"):
            value = normal(0.1 / math.sqrt(shape[1]))
        elif name.endswith("_base"):
            value = torch.zeros(shape)
            value[2 * hc:] = (torch.eye(hc) * 4.0).flatten()  # comb starts close to the identity
        elif name.endswith("_scale"):
            value = torch.ones(shape)
        elif name == "embed.weight" or name.endswith(("markov_head.embed.weight", "engram.embed.weight")):
            value = normal(1.0)
        elif name.endswith(("wo_b.weight", "w2.weight")) or (name.endswith("engram.wkv.weight")):
            value = normal(depth / math.sqrt(shape[1]))
        elif name.endswith(("markov_head.head.weight", "confidence_head.proj.weight")):
            value = normal(0.1 / math.sqrt(shape[1]))
        else:
            value = normal(1 / math.sqrt(shape[1]))
        p.data.copy_(value)
