"""Build a `Model` from a checkpoint folder, checking every tensor's name and shape on the way.

Names are the release's (no `model.` prefix); each linear may be stored natively, as FP8 blocks, MXFP4 or EXL3
(`dsv41.weights.Linear` detects which). With `world > 1` each rank reads only its own slices (see
docs/TENSOR_PARALLEL.md for the split). Tensors nobody reads (vision tower, `bias_vl`, DSpark blocks when the
drafter is off) are allowed; any other tensor the model does not consume is reported as unexpected.
"""

from __future__ import annotations

from pathlib import Path
from typing import Callable

import torch

from ..config import LayerRole, ModelConfig
from dsv41.engram.hashing import EngramConstants, EngramHasher
from dsv41.engram.shards import shard_file_name
from dsv41.engram.tables import EngramTable
from dsv41.parallel.comm import Comm, LocalComm
from ..errors import CheckpointError
from ..weights import Checkpoint
from ..weights.linear import Linear, split_range
from . import mhc
from .attention import Attention, AttentionParams, CompressorParams, IndexerParams
from .dspark import DSpark
from .engram import EngramLayer, engram_wkv_input_range
from .moe import MoE, Expert
from .rope import rope_tables
from .rowwise import RowInvariant
from .transformer import Block, Model, VocabShard

# prefixes of tensors that exist in release checkpoints but are not part of the text forward
_IGNORED_PREFIXES = ("vision.", "aligner.", "image_start", "image_end", "image_newline")
_IGNORED_SUFFIXES = (".ffn.gate.bias_vl",)


_LINEAR_PARTS = ("weight", "scale", "trellis", "suh", "svh", "mul1", "mcg", "bias")


class WeightReader:
    """Reads tensors and linears for one rank and remembers what it read (to report unexpected tensors)."""

    def __init__(self, ckpt: Checkpoint, dtype: torch.dtype, device: torch.device):
        self.ckpt = ckpt
        self.dtype = dtype
        self.device = device
        self.used: set[str] = set()

    def tensor(self, name: str, shape: tuple[int, ...], rows: tuple[int, int] | None = None,
               dtype: torch.dtype | None = None) -> torch.Tensor:
        self.ckpt.expect(name, shape)
        self.used.add(name)
        t = self.ckpt.get(name) if rows is None else self.ckpt.get_slice(name, 0, *rows)
        return t.to(device=self.device, dtype=dtype or torch.float32)

    def optional(self, name: str, shape: tuple[int, ...], **kw) -> torch.Tensor | None:
        return self.tensor(name, shape, **kw) if self.ckpt.has(name) else None

    def linear(self, prefix: str, out_features: int, in_features: int, *, split: str | None = None, rank: int = 0,
               world: int = 1, block: int | None = None) -> RowInvariant:
        """The linear stored under `prefix`; `split` keeps this rank's outputs (`col`) or inputs (`row`)."""
        lin = Linear.from_checkpoint(self.ckpt, prefix, expected_shape=(out_features, in_features),
                                     split=split if world > 1 else None, rank=rank, world=world, block=block,
                                     device=self.device)
        self.used.update(f"{prefix}.{part}" for part in _LINEAR_PARTS if self.ckpt.has(f"{prefix}.{part}"))
        return RowInvariant(lin)

    def unexpected(self) -> list[str]:
        return [n for n in self.ckpt.names()
                if n not in self.used and not n.startswith(_IGNORED_PREFIXES) and not n.endswith(_IGNORED_SUFFIXES)]


def load_model(path: str | Path, dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu",
               fake_quant: bool = True, rank: int = 0, world: int = 1, comm: Comm | None = None,
               dspark: bool | None = None, progress: Callable[[int, int, str], None] | None = None,
               engram_dir: str | Path | None = None) -> Model:
    """Load the checkpoint folder for this rank. `progress(done, total, "layers")` is called as layers load (the
    server turns it into systemd STATUS / EXTEND_TIMEOUT_USEC lines). `dspark`: load the drafter (True), skip it
    (False), or load it when the checkpoint has `mtp.*` tensors (None; HF exports drop them). `engram_dir`: the
    folder of this rank's packed Engram shard files (`dsv41 engram pack`); without it the tables come from shard
    files in the model folder or from the checkpoint's own tensors."""
    path = Path(path)
    cfg = ModelConfig.from_file(path)
    device = torch.device(device)
    comm = comm or LocalComm()
    reader = WeightReader(Checkpoint(path), dtype, device)
    if dspark is None:
        dspark = any(n.startswith("mtp.") for n in reader.ckpt.names())
    _check_tp(cfg, world)

    tokenizer = None
    if (path / "tokenizer.json").is_file():
        from ..tokenizer import Tokenizer
        tokenizer = Tokenizer.from_dir(path)

    tables = rope_tables(cfg)
    total = cfg.num_hidden_layers + (cfg.n_dspark if dspark else 0) + 1
    report = progress or (lambda done, total, what: None)
    blocks = []
    for L in range(cfg.num_hidden_layers):
        blocks.append(load_block(reader, cfg, cfg.role(L), tables, rank, world, fake_quant))
        report(L + 1, total, "layers")

    d, V = cfg.hidden_size, cfg.vocab_size
    vblock = 128 if _is_exl3(reader, "head") else 1  # EXL3 heads split in whole Hadamard blocks
    v0, v1 = split_range(V, world, rank, vblock)
    vocab = VocabShard(v0, v1, reader.tensor("embed.weight", (V, d), rows=(v0, v1), dtype=dtype),
                       reader.linear("head", V, d, split="col", rank=rank, world=world, block=vblock))
    final_norm = reader.tensor("norm.weight", (d,))

    engram, hasher = {}, None
    if cfg.engram_layer_ids:
        engram, hasher = _load_engram(reader, cfg, path, tokenizer, rank, world, comm, engram_dir)

    model = Model(cfg, blocks, vocab, final_norm, engram=engram, engram_hasher=hasher, dtype=dtype, device=device,
                  comm=comm, tokenizer=tokenizer)
    if cfg.n_dspark:
        if dspark:
            model.dspark = load_dspark(reader, cfg, tables, rank, world, fake_quant)
            report(total - 1, total, "layers")
        else:
            reader.used.update(n for n in reader.ckpt.names() if n.startswith("mtp."))

    extra = reader.unexpected()
    if extra:
        raise CheckpointError(f"unexpected tensor {extra[0]!r} in {path} ({len(extra)} not used by the model)")
    report(total, total, "layers")
    return model


def _check_tp(cfg: ModelConfig, world: int) -> None:
    if world < 1:
        raise CheckpointError(f"tensor-parallel world size must be >= 1, got {world}")
    for what, n in (("num_attention_heads", cfg.num_attention_heads), ("o_groups", cfg.o_groups)):
        if n % world:
            raise CheckpointError(f"TP={world} does not divide {what} = {n}")


def hc_params(reader: WeightReader, prefix: str, cfg: ModelConfig, site: str) -> mhc.HCParams:
    hc, d = cfg.hc_mult, cfg.hidden_size
    mix = (2 + hc) * hc
    return mhc.HCParams(reader.tensor(f"{prefix}hc_{site}_fn", (mix, hc * d)),
                        reader.tensor(f"{prefix}hc_{site}_base", (mix,)),
                        reader.tensor(f"{prefix}hc_{site}_scale", (3,)))


def load_attention(reader: WeightReader, cfg: ModelConfig, role: LayerRole, prefix: str, rank: int, world: int
                   ) -> AttentionParams:
    """Attention weights of one layer (or DSpark block) for this rank: heads and output groups split."""
    d, hd, H, G = cfg.hidden_size, cfg.head_dim, cfg.num_attention_heads, cfg.o_groups
    ql, ol, hpg = cfg.q_lora_rank, cfg.o_lora_rank, cfg.heads_per_group
    a = prefix + "attn."
    h0, h1 = split_range(H, world, rank)
    g0, g1 = split_range(G, world, rank)
    sliced = any(reader.ckpt.has(f"{a}wo_a.slice.0.{part}") for part in ("trellis", "weight"))
    if sliced:  # the EXL3 pack stores one group per tensor
        wo_a = [reader.linear(f"{a}wo_a.slice.{g}", ol, hpg * hd) for g in range(g0, g1)]
        # the other ranks' groups are theirs to read, not unexpected tensors (TP fix by the dist helper)
        reader.used.update(f"{a}wo_a.slice.{g}.{part}" for g in range(G) for part in _LINEAR_PARTS)
    else:
        wo_a = [reader.linear(f"{a}wo_a", G * ol, hpg * hd, split="col", rank=g, world=G, block=ol)
                for g in range(g0, g1)]
    p = AttentionParams(
        wq_a=reader.linear(f"{a}wq_a", ql, d),
        q_norm=reader.tensor(f"{a}q_norm.weight", (ql,)),
        wq_b=reader.linear(f"{a}wq_b", H * hd, ql, split="col", rank=rank, world=world, block=hd),
        wkv=reader.linear(f"{a}wkv", hd, d),
        kv_norm=reader.tensor(f"{a}kv_norm.weight", (hd,)),
        sink=reader.tensor(f"{a}attn_sink", (H,))[h0:h1],
        wo_a=wo_a,
        wo_b=reader.linear(f"{a}wo_b", d, G * ol, split="row", rank=rank, world=world, block=ol),
    )
    if role.compresses:
        c = a + "compressor."
        ihd = cfg.index_head_dim
        has_index_k = role.scores
        p.compressor = CompressorParams(
            wkv=reader.linear(f"{c}wkv", hd, d),
            norm=reader.tensor(f"{c}norm.weight", (hd,)),
            wgate=reader.linear(f"{c}wgate", hd, d) if role.compress_ratio > 1 else None,
            index_wk=reader.linear(f"{a}indexer.wk", ihd, hd) if has_index_k else None,
            index_k_norm=reader.tensor(f"{a}indexer.k_norm.weight", (ihd,)) if has_index_k else None,
        )
    if role.scores:
        i = a + "indexer."
        p.indexer = IndexerParams(
            wq_b=reader.linear(f"{i}wq_b", cfg.index_n_heads * cfg.index_head_dim, ql),
            weights_proj=reader.linear(f"{i}weights_proj", cfg.index_n_heads, d),
        )
    return p


def _is_exl3(reader: WeightReader, prefix: str) -> bool:
    return reader.ckpt.has(prefix + ".trellis")


def load_moe(reader: WeightReader, cfg: ModelConfig, prefix: str, n_experts: int, topk: int, rank: int, world: int
             ) -> MoE:
    d, inter = cfg.hidden_size, cfg.moe_intermediate_size
    f = prefix + "ffn."
    block = _inter_block(inter, world)
    tp = dict(rank=rank, world=world, block=block)

    def expert(p: str) -> Expert:
        return Expert(w1=reader.linear(f"{p}w1", inter, d, split="col", **tp),
                      w2=reader.linear(f"{p}w2", d, inter, split="row", **tp),
                      w3=reader.linear(f"{p}w3", inter, d, split="col", **tp))

    experts = [expert(f"{f}experts.{e}.") for e in range(n_experts)]
    # n shared experts are stored as one expert n times as wide (DeepSeek's layout)
    shared_inter = inter * cfg.n_shared_experts
    sblock = _inter_block(shared_inter, world)
    shared = [Expert(w1=reader.linear(f"{f}shared_experts.w1", shared_inter, d, split="col", rank=rank, world=world,
                                      block=sblock),
                     w2=reader.linear(f"{f}shared_experts.w2", d, shared_inter, split="row", rank=rank, world=world,
                                      block=sblock),
                     w3=reader.linear(f"{f}shared_experts.w3", shared_inter, d, split="col", rank=rank, world=world,
                                      block=sblock))] if cfg.n_shared_experts else []
    return MoE(reader.tensor(f"{f}gate.weight", (n_experts, d)), reader.optional(f"{f}gate.bias", (n_experts,)),
               experts, shared, topk=topk, route_scale=cfg.routed_scaling_factor, renorm=cfg.norm_topk_prob,
               swiglu_limit=cfg.swiglu_limit, gate_temp=cfg.gate_temp)


def _inter_block(inter: int, world: int) -> int:
    """One split unit for w1/w3 outputs and w2 inputs alike, so the halves line up in every storage format:
    whole 128-column Hadamard blocks when the width allows (EXL3), else MXFP4/FP8 32-blocks, else single columns."""
    for block in (128, 32):
        if inter % (block * world) == 0:
            return block
    return 1


def load_block(reader: WeightReader, cfg: ModelConfig, role: LayerRole, tables, rank: int, world: int,
               fake_quant: bool) -> Block:
    """A backbone layer (`layers.{L}.`) or a DSpark block (`mtp.{s}.`, its own expert count and top-k)."""
    L = role.index
    s = L - cfg.num_hidden_layers
    prefix = f"mtp.{s}." if role.is_dspark else f"layers.{L}."
    n_experts = cfg.dspark_n_routed_experts if role.is_dspark else cfg.n_routed_experts
    topk = cfg.dspark_num_experts_per_tok if role.is_dspark else cfg.num_experts_per_tok
    d = cfg.hidden_size
    attn = Attention(cfg, role, load_attention(reader, cfg, role, prefix, rank, world), tables[role.rope_kind],
                     local_heads=cfg.num_attention_heads // world, fake_quant=fake_quant)
    return Block(
        index=L,
        attn_norm=reader.tensor(f"{prefix}attn_norm.weight", (d,)),
        ffn_norm=reader.tensor(f"{prefix}ffn_norm.weight", (d,)),
        hc_attn=hc_params(reader, prefix, cfg, "attn"),
        hc_ffn=hc_params(reader, prefix, cfg, "ffn"),
        attn=attn,
        moe=load_moe(reader, cfg, prefix, n_experts, topk, rank, world),
    )


def load_dspark(reader: WeightReader, cfg: ModelConfig, tables, rank: int, world: int, fake_quant: bool) -> DSpark:
    """The DSpark drafter (`mtp.*`): its blocks load like backbone layers, then the tap projection and heads."""
    n, d, V, r = cfg.num_hidden_layers, cfg.hidden_size, cfg.vocab_size, cfg.dspark_markov_rank
    last = f"mtp.{cfg.n_dspark - 1}."
    blocks = [load_block(reader, cfg, cfg.role(n + s), tables, rank, world, fake_quant) for s in range(cfg.n_dspark)]
    n_taps = len(cfg.dspark_target_layer_ids)
    return DSpark(
        cfg=cfg,
        blocks=blocks,
        main_proj=reader.linear("mtp.0.main_proj", d, n_taps * d),
        main_norm=reader.tensor("mtp.0.main_norm.weight", (d,)),
        norm=reader.tensor(f"{last}norm.weight", (d,)),
        markov_embed=reader.tensor(f"{last}markov_head.embed.weight", (V, r)),
        markov_head=reader.tensor(f"{last}markov_head.head.weight", (V, r)),
        confidence_proj=reader.tensor(f"{last}confidence_head.proj.weight", (1, d + r)),
    )


def _load_engram(reader: WeightReader, cfg: ModelConfig, path: Path, tokenizer, rank: int, world: int, comm: Comm,
                 engram_dir: str | Path | None = None):
    if tokenizer is None:
        raise CheckpointError(f"{path}: tokenizer.json is required to hash Engram n-grams")
    constants = EngramConstants.from_config(cfg)
    hasher = EngramHasher.from_tokenizer(cfg, tokenizer)
    hc, d = cfg.hc_mult, cfg.hidden_size
    layers = {}
    for L in cfg.engram_layer_ids:
        shard = Path(engram_dir or path) / shard_file_name(L, rank, world)
        name = f"layers.{L}.engram.embed.weight"
        if engram_dir is not None and not shard.is_file():
            raise CheckpointError(f"{engram_dir}: Engram shard file {shard.name} (layer {L}, rank {rank} of {world}) "
                                  f"is missing; write it with `dsv41 engram pack --src ORIGINAL_CHECKPOINT --out "
                                  f"{engram_dir} --rank {rank} --tp {world}`")
        if shard.is_file():
            table = EngramTable.from_shard_file(shard, L, cfg, rank, world, constants=constants)
        elif reader.ckpt.has(name):
            table = EngramTable.from_checkpoint(reader.ckpt, L, cfg, rank, world, constants=constants)
        else:
            raise CheckpointError(f"{path}: Engram table of layer {L} missing: neither tensor {name!r} nor "
                                  f"shard file {shard.name}")
        reader.used.update(n for n in (name, f"layers.{L}.engram.embed.scale") if reader.ckpt.has(n))
        hd_e = constants.head_dim
        wkv_inputs = engram_wkv_input_range(hd_e, constants.n_cols, rank, world)
        if world > 1 and wkv_inputs != split_range(constants.n_cols * hd_e, world, rank, hd_e):
            raise CheckpointError(f"TP={world} does not split the {constants.n_cols} Engram hash columns evenly")
        e = f"layers.{L}.engram."
        wkv = reader.linear(f"{e}wkv", (hc + 1) * d, constants.n_cols * hd_e, split="row", rank=rank, world=world,
                            block=hd_e)
        layers[L] = EngramLayer(L, table, wkv, reader.tensor(f"{e}q_weight", (hc, d)),
                                reader.tensor(f"{e}k_weight", (hc, d)), cfg.rms_norm_eps, comm.sum_partials)
    return layers, hasher
