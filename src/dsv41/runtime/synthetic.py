"""A full-shape synthetic rank: DeepSeek-V4.1-Flash's real shapes and the pack's K map, random valid EXL3 codes
generated directly on the device (no files, no download), for measuring the fast path at the real size.

What it holds is what a real rank of the EXL3 pack holds (RECIPE.md §2.1, §2.11; EXL3-ENGRAM.md §4.3): per layer
the attention projections (K=5; layer 0's wq_a and wkv K=6), compressor and indexer projections on their layers
(index wk K=8), the router (fp32, as the reference holds it), the routed experts as three stacks (K=3; K=2 on
layers 18-22), the shared expert (K=5; K=4 on layers 11-29), mHC and norms; the vocabulary half of the embedding
(bf16) and of the head (K=6); Engram's wkv (K=5 on layer 1, K=4 on layer 14) with each table replaced by a small
random table in the real row format (FP8 e4m3 + UE8M0 per 32, row id mod its size); and the three DSpark blocks
(K=4, 128 experts) plus main_proj, built and held but not run (the fast path has no drafter yet). Every
tensor-parallel slice is cut as the loader cuts it (`split_range`, whole 128-blocks). Weights are random but
unit-gain (suh scaled by 1/(sqrt(k)·rms of the codebook's values)) so activations stay finite through 40 layers.

`synthetic_rank(...) -> FastModel`; `synthetic_state(model, pos)` gives a sequence at position `pos` with random
window and compressed caches, so a decode step can be timed without a prefill; `synthetic_pool_sequence` writes one
into a KV pool for the forward over the pool in place.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from dsv41.config import LayerRole, ModelConfig
from dsv41.engram.hashing import EngramConstants, EngramHasher, head_shard
from dsv41.engram.shards import RowBytes, quantize_rows_fp8
from dsv41.kernels.exl3.layout import Exl3ExpertStack, Exl3Tensor
from dsv41.model.attention import AttentionParams, CompressorParams, IndexerParams
from dsv41.model.loader import _inter_block
from dsv41.model.quant import fp4_block_e4m3, fp4_block_ue8m0, fp8_block_ue8m0
from dsv41.model.rope import RopeTable, rope_tables
from dsv41.model.state import SequenceState
from dsv41.parallel.comm import Comm, LocalComm
from dsv41.weights import exl3
from dsv41.weights.linear import split_range

from .layers.attention import FastAttention
from .layers.linear import DequantLinear, Exl3Linear, PrefillWorkspace, prefill_workspace_needed
from .layers.moe import FusedMoE, StackedExperts
from .mhc_sites import HC
from .model import FastBlock, FastEngram, FastModel

# DeepSeek-V4.1-Flash's text config (MODEL.md §3.1)
REAL_TEXT_CONFIG = {
    "vocab_size": 129280, "hidden_size": 5120, "moe_intermediate_size": 2304, "num_hidden_layers": 40,
    "num_attention_heads": 64, "num_key_value_heads": 1, "head_dim": 512, "qk_rope_head_dim": 64,
    "q_lora_rank": 1280, "o_lora_rank": 1024, "o_groups": 8, "swiglu_limit": 10.0, "rms_norm_eps": 1e-20,
    "max_position_embeddings": 1048576, "rope_theta": 10000.0, "compress_rope_theta": 160000.0,
    "rope_scaling": {"rope_type": "yarn", "factor": 16, "beta_fast": 32, "beta_slow": 1,
                     "original_max_position_embeddings": 65536},
    "n_routed_experts": 384, "n_shared_experts": 1, "num_experts_per_tok": 6, "scoring_func": "sqrtsoftplus",
    "topk_method": "noaux_tc", "norm_topk_prob": True, "routed_scaling_factor": 1.5, "sliding_window": 128,
    "compress_ratios": [0, 0] + [2] * 18 + [1] * 20 + [0, 0, 0], "kv_source_layer_ids": [2, 8, 14, 20],
    "index_source_layer_ids": [2, 8, 14, 20, 24, 28, 32, 36], "index_n_heads": 32, "index_head_dim": 128,
    "index_topk": 512, "candidate_source_layer_id": 20, "candidate_topk_blocks": 2048, "candidate_block_size": 8,
    "hc_mult": 4, "hc_sinkhorn_iters": 20, "hc_eps": 1e-6, "engram_layer_ids": [1, 14],
    "engram_num_embeddings": [384006168, 384016682], "engram_max_ngram_size": 4, "engram_vocab_size": 16000000,
    "engram_n_heads": 8, "engram_head_dim": 256, "engram_pad_token_id": 2, "engram_compressed_vocab_size": 99092,
    "num_nextn_predict_layers": 3, "dspark_block_size": 5, "dspark_noise_token_id": 128799,
    "dspark_target_layer_ids": [37, 38, 39], "dspark_markov_rank": 256, "dspark_n_routed_experts": 128,
    "dspark_num_experts_per_tok": 3, "image_token_id": 129264, "bos_token_id": 0, "eos_token_id": 1,
}


def real_config() -> ModelConfig:
    return ModelConfig.from_dict({"model_type": "deepseek_v41", "text_config": REAL_TEXT_CONFIG,
                                  "quantization_config": {"quant_method": "exl3", "bits": 2.9, "codebook": "mul1"}})


def pack_k(part: str, L: int, cfg: ModelConfig) -> int:
    """The pack's K for a matrix of layer L (EXL3-ENGRAM.md §4.3; DSpark blocks 4)."""
    if L >= cfg.num_hidden_layers:
        return 4
    if part == "expert":
        return 2 if 18 <= L <= 22 else 3
    if part == "shared":
        return 4 if 11 <= L <= 29 else 5
    if part == "index_wk":
        return 8
    if part == "engram":
        return 5 if L == cfg.engram_layer_ids[0] else 4
    if part == "attn0":
        return 6 if L == 0 else 5
    return {"head": 6}.get(part, 5)


class RandomEngramTable:
    """Stand-in for one Engram layer's table: `rows` random rows in the real row format, held on the host as the
    real tables are (a step reads them there and sends their bytes); hashed row id r reads row r mod rows (this
    rank's hash columns only, as `EngramTable.submit`)."""

    def __init__(self, constants: EngramConstants, rank: int, world: int, rows: int, device, gen: torch.Generator):
        self.cols = head_shard(constants.n_cols, rank, world)
        self.n_cols, self.head_dim = constants.n_cols, constants.head_dim
        values, scales = quantize_rows_fp8(torch.randn(rows, constants.head_dim, generator=gen, device=device))
        self.raw = torch.cat((values, scales), dim=-1).cpu().numpy()  # [rows, fp8_row_bytes]

    def submit(self, row_ids: torch.Tensor) -> "_ReadRows":
        c0, c1 = self.cols
        ids = torch.as_tensor(row_ids).cpu().numpy()
        if ids.shape[-1] == self.n_cols:
            ids = ids[..., c0:c1]
        return _ReadRows(RowBytes(self.raw[ids % self.raw.shape[0]], "fp8", self.head_dim))

    def gather(self, row_ids: torch.Tensor, device=None) -> torch.Tensor:
        return self.submit(row_ids).wait(device)


@dataclass
class _ReadRows:
    rows: RowBytes

    def wait_bytes(self) -> RowBytes:
        return self.rows

    def wait(self, device=None) -> torch.Tensor:
        return self.rows.decode("cpu" if device is None else device)


class _Random:
    """Random tensors on the device; EXL3 groups as uniformly random trellis words with unit-gain scales."""

    def __init__(self, device: torch.device, seed: int, workspace: PrefillWorkspace):
        self.device, self.workspace = device, workspace
        self.g = torch.Generator(device=device).manual_seed(seed)
        probe = torch.randint(-32768, 32768, (8, 8, 48), generator=torch.Generator().manual_seed(seed),
                              dtype=torch.int32).to(torch.int16)
        self.q_rms = float(exl3.decode_rotated(probe, "mul1").float().pow(2).mean().sqrt())

    def normal(self, *shape, std=1.0, mean=0.0, dtype=torch.float32) -> torch.Tensor:
        return (torch.randn(*shape, generator=self.g, device=self.device) * std + mean).to(dtype)

    def signs(self, *shape) -> torch.Tensor:
        return torch.randint(0, 2, shape, generator=self.g, device=self.device).float() * 2 - 1

    def group(self, k: int, n: int, K: int, lead: tuple = ()):
        trellis = torch.randint(-32768, 32768, (*lead, k // 16, n // 16, 16 * K), generator=self.g,
                                device=self.device, dtype=torch.int16)
        suh = (self.signs(*lead, k) / (math.sqrt(k) * self.q_rms)).half()
        return trellis, suh, self.signs(*lead, n).half()

    def linear(self, k: int, n: int, K: int, name: str, fused_only: bool = False) -> Exl3Linear:
        return Exl3Linear(Exl3Tensor.from_group(*self.group(k, n, K), "mul1", name), self.workspace, name,
                          fused_only=fused_only)

    def stack(self, E: int, k: int, n: int, K: int, name: str) -> Exl3ExpertStack:
        return Exl3ExpertStack.from_stacked(*self.group(k, n, K, (E,)), "mul1", name)

    def norm(self, n: int) -> torch.Tensor:
        return self.normal(n, std=0.1, mean=1.0)


def _block(r: _Random, cfg: ModelConfig, role: LayerRole, rope: RopeTable, rank: int, world: int) -> FastBlock:
    L, d, hd, hc = role.index, cfg.hidden_size, cfg.head_dim, cfg.hc_mult
    H, G = cfg.num_attention_heads, cfg.o_groups
    h0, h1 = split_range(H, world, rank)
    g0, g1 = split_range(G, world, rank)
    K = lambda part: pack_k(part, L, cfg)  # noqa: E731
    p = f"layers.{L}." if not role.is_dspark else f"mtp.{L - cfg.num_hidden_layers}."
    w = AttentionParams(
        r.linear(d, cfg.q_lora_rank, K("attn0"), p + "attn.wq_a"), r.norm(cfg.q_lora_rank),
        r.linear(cfg.q_lora_rank, (h1 - h0) * hd, K("attn"), p + "attn.wq_b"),
        r.linear(d, hd, K("attn0"), p + "attn.wkv"), r.norm(hd), r.normal(h1 - h0),
        [r.linear(cfg.heads_per_group * hd, cfg.o_lora_rank, K("attn"), f"{p}attn.wo_a.slice.{g}")
         for g in range(g0, g1)],
        r.linear((g1 - g0) * cfg.o_lora_rank, d, K("attn"), p + "attn.wo_b"))
    if role.compresses:
        w.compressor = CompressorParams(r.linear(d, hd, K("attn"), p + "attn.compressor.wkv"), r.norm(hd))
        if role.compress_ratio > 1:
            w.compressor.wgate = r.linear(d, hd, K("attn"), p + "attn.compressor.wgate")
        if role.scores:
            w.compressor.index_wk = r.linear(hd, cfg.index_head_dim, K("index_wk"), p + "attn.indexer.wk")
            w.compressor.index_k_norm = r.norm(cfg.index_head_dim)
    if role.scores:
        nh = cfg.index_n_heads
        w.indexer = IndexerParams(
            r.linear(cfg.q_lora_rank, nh * cfg.index_head_dim, K("attn"), p + "attn.indexer.wq_b"),
            DequantLinear("native", {"weight": r.normal(nh, d, std=d ** -0.5, dtype=torch.bfloat16)}, d, nh,
                          p + "attn.indexer.weights_proj"))
    attn = FastAttention(cfg, role, w, rope, local_heads=h1 - h0)

    E = cfg.dspark_n_routed_experts if role.is_dspark else cfg.n_routed_experts
    topk = cfg.dspark_num_experts_per_tok if role.is_dspark else cfg.num_experts_per_tok
    inter = cfg.moe_intermediate_size
    i0, i1 = split_range(inter, world, rank, _inter_block(inter, world))
    Ke = K("expert")
    experts = StackedExperts(r.stack(E, d, i1 - i0, Ke, p + "ffn.experts.w1"),
                             r.stack(E, d, i1 - i0, Ke, p + "ffn.experts.w3"),
                             r.stack(E, i1 - i0, d, Ke, p + "ffn.experts.w2"), r.workspace)
    shared_inter = inter * cfg.n_shared_experts
    s0, s1 = split_range(shared_inter, world, rank, _inter_block(shared_inter, world))
    Ks = K("shared")
    sp = p + "ffn.shared_experts."
    shared = [(r.linear(d, s1 - s0, Ks, sp + "w1"), r.linear(d, s1 - s0, Ks, sp + "w3"),
               r.linear(s1 - s0, d, Ks, sp + "w2"))] if cfg.n_shared_experts else []
    # the router's gate as the release stores it (bf16 in MODEL.md's tensor table): prefill's tiles take the tensor
    # cores on it and a decode row reads half the bytes; until 34de57d an fp32 gate here timed the IEEE fp32 paths
    moe = FusedMoE(r.normal(E, d, std=2 * d ** -0.5, dtype=torch.bfloat16), r.normal(E, std=0.3), experts, shared,
                   topk=topk, route_scale=cfg.routed_scaling_factor, renorm=cfg.norm_topk_prob,
                   swiglu_limit=cfg.swiglu_limit, gate_temp=cfg.gate_temp)
    mix = (2 + hc) * hc

    def hc_site() -> HC:
        return HC(r.normal(mix, hc * d, std=(hc * d) ** -0.5).t(), r.normal(mix, std=0.5),
                  torch.rand(3, generator=r.g, device=r.device) + 0.5)

    return FastBlock(L, r.norm(d), r.norm(d), hc_site(), hc_site(), attn, moe)


def synthetic_rank(cfg: ModelConfig | None = None, rank: int = 0, world: int = 2, device="cuda",
                   dtype: torch.dtype = torch.bfloat16, comm: Comm | None = None, layers: int | None = None,
                   dspark: bool = True, engram_rows: int = 1 << 16, seed: int = 0, drafter: bool = False) -> FastModel:
    """Rank `rank` of `world` at the real shapes (or `cfg`'s), its first `layers` backbone layers (all by
    default); `dspark` builds and holds the drafter's blocks too (what a real rank holds); `drafter` (with
    `dspark`) makes them the model's drafter (`FastModel.dspark`, runtime/draft_fast.py: the target layers' taps
    seed its rings, its pass can be timed) with random heads, instead of holding them unused."""
    cfg = cfg or real_config()
    device = torch.device(device)
    ws = PrefillWorkspace(device)
    r = _Random(device, seed, ws)
    ropes = {kind: RopeTable(t.inv_freq.to(device)) for kind, t in rope_tables(cfg).items()}
    n_layers = cfg.num_hidden_layers if layers is None else min(layers, cfg.num_hidden_layers)
    blocks = [_block(r, cfg, cfg.role(L), ropes[cfg.role(L).rope_kind], rank, world) for L in range(n_layers)]
    held = []
    if dspark and cfg.n_dspark:
        n = cfg.num_hidden_layers
        held = [_block(r, cfg, cfg.role(n + s), ropes["plain"], rank, world) for s in range(cfg.n_dspark)]
        d = cfg.hidden_size
        held.append(r.linear(len(cfg.dspark_target_layer_ids) * d, d, 4, "mtp.0.main_proj"))
        if drafter:
            from dsv41.model.dspark import DSpark

            from .draft_fast import FastDSpark

            V, rk = cfg.vocab_size, cfg.dspark_markov_rank
            heads = DSpark(cfg, [], None, None, r.norm(d), r.normal(V, rk, dtype=dtype), r.normal(V, rk, std=0.05),
                           r.normal(1, d + rk, std=(d + rk) ** -0.5, dtype=dtype))  # the Markov head fp32 (build.py)
            drafter, held = FastDSpark(cfg, held[:-1], held[-1], r.norm(d), heads), []
    d, V = cfg.hidden_size, cfg.vocab_size
    v0, v1 = split_range(V, world, rank, 128)
    engram, hasher = {}, None
    if cfg.engram_layer_ids:
        constants = EngramConstants.from_config(cfg)
        hasher = EngramHasher(cfg, torch.arange(V) % cfg.engram_compressed_vocab_size, constants)
        c0, c1 = head_shard(constants.n_cols, rank, world)
        for L in cfg.engram_layer_ids:
            if L >= n_layers:
                continue
            wkv = r.linear((c1 - c0) * constants.head_dim, (cfg.hc_mult + 1) * d, pack_k("engram", L, cfg),
                           f"layers.{L}.engram.wkv")
            engram[L] = FastEngram(L, RandomEngramTable(constants, rank, world, engram_rows, device, r.g), wkv,
                                   r.normal(cfg.hc_mult, d), r.normal(cfg.hc_mult, d), cfg.rms_norm_eps)
    head = r.linear(d, v1 - v0, pack_k("head", 0, cfg), "head", fused_only=True)
    model = FastModel(cfg, blocks, v0, v1, r.normal(v1 - v0, d, dtype=dtype), head, r.norm(d), ws, engram, hasher,
                      dtype, device, comm or LocalComm(), None, True, held, dspark=drafter or None)
    if prefill_workspace_needed():  # the prefill tile kernels alone need no dense copy of any matrix
        ws.allocate()
    return model


def synthetic_state(model: FastModel, pos: int, seed: int = 0) -> SequenceState:
    """A sequence at position `pos`: random window rows of every layer and compressed entries + index keys of
    every KV source as the fake quantisers leave them (open groups included), random Engram look-back."""
    cfg, dev = model.cfg, model.device
    g = torch.Generator(device=dev).manual_seed(seed)
    rnd = lambda *s: torch.randn(*s, generator=g, device=dev)  # noqa: E731
    state = model.new_state()
    state.pos = pos
    state.ids = [0] * pos
    for block in model.blocks:
        role = block.attn.role
        state.window(role.index).kv = fp8_block_ue8m0(rnd(min(pos, cfg.sliding_window), cfg.head_dim)).to(model.dtype)
        if role.compresses:
            src, r = state.source(role.index), role.compress_ratio
            C = pos // r
            src.kv = fp4_block_e4m3(rnd(C, cfg.head_dim)).to(model.dtype)
            if role.scores:
                src.index_k = fp4_block_ue8m0(rnd(C, cfg.index_head_dim)).to(model.dtype)
            if pos % r:
                src.open_v, src.open_s = rnd(pos % r, cfg.head_dim), rnd(pos % r, cfg.head_dim)
    if state.engram is not None:
        state.engram.ids = torch.randint(0, cfg.engram_compressed_vocab_size, state.engram.ids.shape)
    return state


def synthetic_pool_sequence(model: FastModel, pool, slot: int, page_ids: list[int], pos: int, seed: int = 0):
    """`synthetic_state(model, pos, seed)` written into the KV pool at ring slot `slot` and pages `page_ids` (window
    rows, entries and index keys, open groups), returned as the pool's view of it (`PoolSequence`, what a forward
    over the pool in place takes): a decode step over the pool timed without a prefill."""
    from dsv41.engine.batch import Row

    from .pool_forward import PoolSequence, decoder_start

    state = synthetic_state(model, pos, seed)
    for layer, win in state.windows.items():
        if win.kv is not None:
            pool.write_ring("window", layer, slot, pos - win.kv.shape[0], win.kv)
    for layer, src in state.sources.items():
        if src.kv is not None:
            pool.write_entries(layer, page_ids, 0, src.kv, src.index_k)
        pool.write_open(layer, slot, src.open_v, src.open_s)
    view = PoolSequence(pool, Row(slot, slot, [], pos, list(page_ids)), model.cfg, decoder_start(model.cfg))
    view.engram, view.ids = state.engram, state.ids
    return view
