"""Build a `FastModel` for one rank from the checkpoint and config `model/loader.py` reads, no dense copies.

The reference loader's own readers (`load_block`, `_load_engram`, the same names, shapes, TP slices and checks)
read each layer into host memory in its stored form; this module moves every tensor to the device as it is and
wraps it in a fast layer: EXL3 groups as `Exl3Tensor`s, the routed experts of a layer as one `Exl3ExpertStack` per
projection (copied into the stack expert by expert), FP8 / MXFP4 / native tensors as stored. A layer's host copy
is dropped before the next one is read, so the host holds one layer at a time and the device the rank's stored
bytes plus the one declared prefill workspace (allocated here, at build). Nothing is dequantised: the reference
`Linear` objects are discarded unused.

Entry point for the serving stack: `build_fast_model(path, device, dtype, rank, world, comm) -> FastModel`, whose
`forward([(state, ids), ...], phase)` takes rows of several sequences (runtime/model.py). `sink=` is the seam of
`dsv41 prepare` (prepared/writer.py): it sees each block as built (and stores it), and may skip blocks it stored in
an earlier, interrupted run.
"""

from __future__ import annotations

from pathlib import Path
from typing import Callable, Protocol

import torch

from dsv41.config import ModelConfig
from dsv41.errors import CheckpointError
from dsv41.kernels.exl3.layout import Exl3ExpertStack
from dsv41.model.attention import AttentionParams, CompressorParams, IndexerParams
from dsv41.model.dspark import DSpark
from dsv41.model.loader import WeightReader, _check_tp, _load_engram, load_block
from dsv41.model.mhc import HCParams
from dsv41.model.rope import RopeTable, rope_tables
from dsv41.parallel.comm import Comm, LocalComm
from dsv41.weights import Checkpoint
from dsv41.weights.linear import split_range

from . import engram_gate
from .draft_fast import FastDSpark
from .layers.attention import FastAttention
from .layers.linear import PrefillWorkspace, fast_linear, prefill_workspace_needed
from .layers.moe import FusedMoE, StackedExperts
from .mhc_sites import HC
from .model import STEP_ROWS, FastBlock, FastEngram, FastModel


class _Mover:
    """Moves a layer's stored tensors to the device and wraps its linears, all sharing one prefill workspace."""

    def __init__(self, device: torch.device):
        self.device = device
        self.workspace = PrefillWorkspace(device)

    def t(self, x: torch.Tensor | None) -> torch.Tensor | None:
        return None if x is None else x.to(self.device)

    def lin(self, ref, fused_only: bool = False):
        return None if ref is None else fast_linear(ref.linear, self.workspace, self.device, fused_only)

    def hc(self, p: HCParams) -> HC:
        return HC(self.t(p.fn).float().t(), self.t(p.base).float(), self.t(p.scale).float())

    def attention(self, attn, rope_on_device: RopeTable) -> FastAttention:
        p, t, lin = attn.p, self.t, self.lin
        c, i = p.compressor, p.indexer
        w = AttentionParams(lin(p.wq_a), t(p.q_norm), lin(p.wq_b), lin(p.wkv), t(p.kv_norm), t(p.sink),
                            [lin(g) for g in p.wo_a], lin(p.wo_b))
        if c is not None:
            w.compressor = CompressorParams(lin(c.wkv), t(c.norm), lin(c.wgate), lin(c.index_wk), t(c.index_k_norm))
        if i is not None:
            w.indexer = IndexerParams(lin(i.wq_b), lin(i.weights_proj))
        return FastAttention(attn.cfg, attn.role, w, rope_on_device, local_heads=attn.heads,
                             fake_quant=attn.fake_quant)

    def experts(self, experts, name: str):
        """One stack per projection when every expert is EXL3 with one K and codebook, else per-expert layers."""
        lins = [[getattr(e, p).linear for p in ("w1", "w3", "w2")] for e in experts]
        if not all(lin.fmt == "exl3" for row in lins for lin in row):
            return [tuple(fast_linear(lin, self.workspace, self.device) for lin in row) for row in lins]
        stacks = []
        for j, proj in enumerate(("w1", "w3", "w2")):
            first = lins[0][j]
            codebook, shape = first.codebook, first.tensors["trellis"].shape
            parts = {k: torch.empty((len(lins), *v.shape), dtype=v.dtype, device=self.device)
                     for k, v in first.tensors.items() if k in ("trellis", "suh", "svh")}
            for e, row in enumerate(lins):
                lin = row[j]
                if lin.codebook != codebook or lin.tensors["trellis"].shape != shape:
                    raise CheckpointError(f"{lin.name}: routed experts of one projection must share K, codebook and "
                                          f"shape to be stacked ({first.name} differs)")
                for k, dst in parts.items():
                    dst[e].copy_(lin.tensors[k])
                lin.tensors = {}  # the host copy goes as soon as it is on the device
            stacks.append(Exl3ExpertStack.from_stacked(parts["trellis"], parts["suh"], parts["svh"], codebook,
                                                       f"{name}.experts.{proj}"))
        return StackedExperts(stacks[0], stacks[1], stacks[2], self.workspace)

    def moe(self, moe, name: str) -> FusedMoE:
        shared = [(self.lin(s.w1), self.lin(s.w3), self.lin(s.w2)) for s in moe.shared]
        return FusedMoE(self.t(moe.gate_weight), self.t(moe.gate_bias), self.experts(moe.experts, name), shared,
                        topk=moe.topk, route_scale=moe.route_scale, renorm=moe.renorm, swiglu_limit=moe.limit,
                        gate_temp=moe.gate_temp)

    def block(self, block, rope: RopeTable, prefix: str | None = None) -> FastBlock:
        return FastBlock(block.index, self.t(block.attn_norm), self.t(block.ffn_norm), self.hc(block.hc_attn),
                         self.hc(block.hc_ffn), self.attention(block.attn, rope),
                         self.moe(block.moe, f"{prefix or f'layers.{block.index}.'}ffn"))


def _build_dspark(reader: WeightReader, cfg: ModelConfig, tables, ropes, mover: _Mover, rank: int, world: int,
                  fake_quant: bool) -> FastDSpark:
    """The DSpark drafter (`mtp.*`) in stored form, one block at a time as the backbone (`load_dspark`'s names,
    shapes and TP slices): the blocks as FastBlocks, main_proj a fast linear, the heads' tensors as stored."""
    n, d, V, r = cfg.num_hidden_layers, cfg.hidden_size, cfg.vocab_size, cfg.dspark_markov_rank
    blocks = []
    for s in range(cfg.n_dspark):
        role = cfg.role(n + s)
        ref = load_block(reader, cfg, role, tables, rank, world, fake_quant)
        blocks.append(mover.block(ref, ropes[role.rope_kind], f"mtp.{s}."))
        del ref
    last, t = f"mtp.{cfg.n_dspark - 1}.", mover.t
    # the Markov head in fp32 once (`DSpark._chain` widens it for every draft row: [vocab, rank], 132 MB at full shape)
    heads = DSpark(cfg, [], None, None, t(reader.tensor(f"{last}norm.weight", (d,))),
                   t(reader.tensor(f"{last}markov_head.embed.weight", (V, r))),
                   t(reader.tensor(f"{last}markov_head.head.weight", (V, r))).float(),
                   t(reader.tensor(f"{last}confidence_head.proj.weight", (1, d + r))))
    main_proj = mover.lin(reader.linear("mtp.0.main_proj", d, len(cfg.dspark_target_layer_ids) * d))
    return FastDSpark(cfg, blocks, main_proj, t(reader.tensor("mtp.0.main_norm.weight", (d,))), heads)


class BlockSink(Protocol):
    """Where `dsv41 prepare` takes the blocks as they are built (prepared/writer.py)."""

    def skip(self, index: int) -> object | None:
        """What stands for block `index` when it is already stored (it is then neither read nor built), else None."""

    def built(self, index: int, block: FastBlock) -> object:
        """Takes the built block; returns what the model's block list keeps in its place."""


def build_fast_model(path: str | Path, device: str | torch.device = "cuda", dtype: torch.dtype = torch.bfloat16,
                     rank: int = 0, world: int = 1, comm: Comm | None = None, fake_quant: bool = True,
                     engram_dir: str | Path | None = None,
                     progress: Callable[[int, int, str], None] | None = None, sink: BlockSink | None = None,
                     dspark: bool | None = False) -> FastModel:
    """This rank's FastModel of the checkpoint folder `path` (the same folder and arguments as `load_model`).
    `dspark`: build the DSpark drafter (True; its tensors missing is a CheckpointError), build it when the
    checkpoint has it (None: what `serve` asks when it drafts with DSpark), or accept its tensors unbuilt (False,
    the default)."""
    path, device = Path(path), torch.device(device)
    cfg = ModelConfig.from_file(path)
    comm = comm or LocalComm()
    _check_tp(cfg, world)
    reader = WeightReader(Checkpoint(path), dtype, torch.device("cpu"))  # host, one layer at a time
    tokenizer = None
    if (path / "tokenizer.json").is_file():
        from dsv41.tokenizer import Tokenizer
        tokenizer = Tokenizer.from_dir(path)
    mover = _Mover(device)
    tables = rope_tables(cfg)
    ropes = {kind: RopeTable(table.inv_freq.to(device)) for kind, table in tables.items()}
    report = progress or (lambda done, total, what: None)
    blocks = []
    for L in range(cfg.num_hidden_layers):
        role = cfg.role(L)
        kept = sink.skip(L) if sink is not None else None
        if kept is not None:  # stored by an earlier run: its tensors count as used (its Engram's are read below)
            reader.used.update(n for n in reader.ckpt.names() if n.startswith(f"layers.{L}.") and ".engram." not in n)
        else:
            ref = load_block(reader, cfg, role, tables, rank, world, fake_quant)
            kept = mover.block(ref, ropes[role.rope_kind])
            del ref
            if sink is not None:
                kept = sink.built(L, kept)
        blocks.append(kept)
        report(L + 1, cfg.num_hidden_layers + 1, "layers")

    d, V = cfg.hidden_size, cfg.vocab_size
    vblock = 128 if reader.ckpt.has("head.trellis") else 1  # EXL3 heads split in whole Hadamard blocks
    v0, v1 = split_range(V, world, rank, vblock)
    embed = mover.t(reader.tensor("embed.weight", (V, d), rows=(v0, v1), dtype=dtype))
    head = mover.lin(reader.linear("head", V, d, split="col", rank=rank, world=world, block=vblock), fused_only=True)
    final_norm = mover.t(reader.tensor("norm.weight", (d,)))
    engram, hasher = {}, None
    if cfg.engram_layer_ids:
        layers, hasher = _load_engram(reader, cfg, path, tokenizer, rank, world, comm, engram_dir)
        engram = {L: FastEngram(L, e.table, mover.lin(e.wkv), mover.t(e.q_weight), mover.t(e.k_weight), e.eps)
                  for L, e in layers.items()}
    if dspark is None:
        dspark = any(n.startswith("mtp.") for n in reader.ckpt.names())
    drafter = None
    if dspark and cfg.n_dspark:
        drafter = _build_dspark(reader, cfg, tables, ropes, mover, rank, world, fake_quant)
    else:
        reader.used.update(n for n in reader.ckpt.names() if n.startswith("mtp."))
    extra = reader.unexpected()
    if extra:
        raise CheckpointError(f"unexpected tensor {extra[0]!r} in {path} ({len(extra)} not used by the model)")
    if prefill_workspace_needed():  # the tile kernels alone need no dense copy of any matrix
        mover.workspace.allocate()
    report(cfg.num_hidden_layers + 1, cfg.num_hidden_layers + 1, "layers")
    model = FastModel(cfg, blocks, v0, v1, embed, head, final_norm, mover.workspace, engram, hasher, dtype, device,
                      comm, tokenizer, fake_quant, dspark=drafter)
    model.engram_gate = engram_gate.for_model(model, STEP_ROWS)  # DSV41_ENGRAM_GATE (runtime/engram_gate.py)
    return model
