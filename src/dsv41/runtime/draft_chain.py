"""The DSpark chain on the device: the Markov head row by row, each row's keyed choice feeding the next, and the
confidence head, with no host read until the pass's end (MODEL.md §10; the reference: `model/dspark.py`
`DSpark._chain`).

The reference chain reads the host once a drafted row (`choose(row, i) -> int`: the keyed choice of
`runtime/sampling.py`, whose T > 0 draw moves the row to the CPU). Here the choice at every absolute position is
computed where the logits are, as tensors:

- `KeyedChoice` is the reference's `choose` callable (`sample_token(logits, params, seed, step0 + i)`), carrying its
  sampling parameters so that the device chain can compute the same draw;
- `ChainSampling` holds those parameters for the pass's sequences as tensors (per sequence: greedy, 1 / temperature
  as the divisor, top-k, min-p, top-p; per drafted row the two keys of `(seed, step)`: `sampling._step_keys`);
- `keyed_choices(rows, ...)` is `sample_token` for one row of every sequence at once: the greedy argmax of the fp32
  row, or the keyed Gumbel-max over the row filtered in `filter_logits`' order (top-k, min-p, top-p) — written
  without boolean indexing or Python-valued shapes, so it is capturable and syncs nothing. Every op is the
  reference's own on the same row (softmax, sort, cumsum and argmax along the row; the noise's logs per row on a
  contiguous [V] row, as `keyed_gumbel` makes it), so on the CPU the choice is `sample_token`'s bit for bit
  (tests/test_runtime_draft_chain.py). On a GPU the draw runs on the device's float64 ops, where the reference's
  moves the row to the CPU: the two could differ only where the device's float64 log / softmax / cumsum round a
  top-p or min-p boundary or a near tie of the noisy scores differently — a draft is a guess, verified by the
  target's own keyed choice, so replies never change (drafted == serial);
- `chain(...)` is `DSpark._chain` for all sequences: the Markov head's product and the confidence head per
  sequence with the reference's ops (`markov_head @ e`, a matrix-vector product, as the reference computes it), the
  choices over all sequences' row at once. `Chained.read()` is the pass's one host read (ids and confidences).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch

from .sampling import GREEDY_BELOW, SamplingParams, _hash32, _step_keys, sample_token

NEG_INF = float("-inf")


@dataclass(frozen=True)
class KeyedChoice:
    """The keyed choice of drafted row i: the request's draw at generation step `step0 + i` (the reference chain's
    `choose(logits_row, i)`)."""

    params: SamplingParams
    step0: int

    def __call__(self, logits: torch.Tensor, i: int) -> int:
        return sample_token(logits, self.params, self.params.seed, self.step0 + i)


@dataclass(frozen=True)
class Flags:
    """Which parts of the draw a pass needs (a graph's variant: a greedy pass runs argmaxes only)."""

    sampled: bool = False
    top_k: bool = False
    min_p: bool = False
    top_p: bool = False


def sampling_rows(chooses: Sequence, rows: int, vocab: int) -> tuple[list[list[int]], list[list[float]], Flags]:
    """Host side: per sequence `[greedy, top_k, key1_0, key2_0, ..]` (ints, `rows` drafted rows) and
    `[divisor, min_p, top_p]` (floats) of its choose (None: greedy), and the flags. Raises TypeError for a choose
    that is neither (the caller then runs the reference chain)."""
    ints, floats, flags = [], [], Flags()
    for c in chooses:
        if c is not None and not isinstance(c, KeyedChoice):
            raise TypeError(type(c).__name__)
        if c is None or c.params.greedy:
            ints.append([1, 0] + [0] * (2 * rows))
            floats.append([1.0, 0.0, 1.0])
            continue
        p = c.params
        keys = [k for i in range(rows) for k in _step_keys(p.seed, c.step0 + i)]
        ints.append([0, int(p.top_k)] + keys)
        floats.append([max(p.temperature, GREEDY_BELOW), float(p.min_p), float(p.top_p)])
        flags = Flags(True, flags.top_k or 0 < p.top_k < vocab, flags.min_p or p.min_p > 0.0,
                      flags.top_p or p.top_p < 1.0)
    return ints, floats, flags


def keyed_choices(rows: torch.Tensor, ints: torch.Tensor, floats: torch.Tensor, i: int, flags: Flags) -> torch.Tensor:
    """The keyed choice of row i of every sequence: rows [Q, V] fp32 (one per sequence), `ints` [Q, 2 + 2 * rows]
    and `floats` [Q, 3] float64 from `sampling_rows` (on the device). Returns the ids [Q] int64 (`sample_token`)."""
    greedy_ids = torch.argmax(rows, dim=-1)
    if not flags.sampled:
        return greedy_ids
    sampled_ids = torch.argmax(keyed_scores(rows, ints, floats, i, flags), dim=-1)
    return torch.where(ints[:, 0] != 0, greedy_ids, sampled_ids)


def keyed_scores(rows: torch.Tensor, ints: torch.Tensor, floats: torch.Tensor, i: int, flags: Flags) -> torch.Tensor:
    """`filter_logits(row) + keyed_gumbel(seed, step0 + i, ids)` for every row [Q, V] float64 (the sampled rows')."""
    V = rows.shape[-1]
    scaled = rows.to(torch.float64) / floats[:, 0:1]
    if flags.top_k:  # the k-th largest value (`topk(...).values[-1]`), rows without top-k keep everything
        k = ints[:, 1:2]
        kth = torch.sort(scaled, dim=-1, descending=True).values.gather(1, (k - 1).clamp(0, V - 1))
        kth = torch.where((k > 0) & (k < V), kth, torch.full_like(kth, NEG_INF))
        scaled = scaled.masked_fill(scaled < kth, NEG_INF)
    if flags.min_p:
        probs = torch.softmax(scaled, dim=-1)
        min_p = floats[:, 1:2]
        drop = (probs < min_p * probs.max(dim=-1, keepdim=True).values) & (min_p > 0.0)
        scaled = scaled.masked_fill(drop, NEG_INF)
    if flags.top_p:
        top_p = floats[:, 2:3]
        order = torch.argsort(scaled, dim=-1, descending=True, stable=True)
        probs = torch.softmax(scaled.gather(1, order), dim=-1)
        mass_before = torch.cumsum(probs, dim=-1) - probs
        drop = (mass_before >= top_p) & (top_p < 1.0)
        scaled = scaled.masked_fill(torch.zeros_like(drop).scatter(1, order, drop), NEG_INF)
    ids = torch.arange(V, device=rows.device)
    high = _hash32(ids ^ ints[:, 2 + 2 * i:3 + 2 * i])
    low = _hash32(high ^ ints[:, 3 + 2 * i:4 + 2 * i])
    uniform = (((high << 21) | (low >> 11)).to(torch.float64) + 0.5) / float(1 << 53)
    # the noise's logs row by row, each over a contiguous [V] as `keyed_gumbel` takes them (the CPU's vector loop
    # splits a row where the reference splits it)
    noise = torch.stack([-torch.log(-torch.log(uniform[q])) for q in range(rows.shape[0])])
    return scaled + noise


@dataclass
class Chained:
    """The chain's results on the device: ids [Q, rows] int64, confidences [Q, rows] fp32, the rows' logits
    [Q, rows, V] fp32 (when asked)."""

    ids: torch.Tensor
    confidence: torch.Tensor
    logits: torch.Tensor | None = None

    def packed(self) -> torch.Tensor:
        """ids and confidences as one float64 [Q, 2, rows] (ids < 2^53 exact): what the one host read takes."""
        return torch.stack((self.ids.to(torch.float64), self.confidence.to(torch.float64)), dim=1)

    @staticmethod
    def read(packed: torch.Tensor) -> list[tuple[list[int], list[float]]]:
        """THE host read of a draft pass: per sequence (ids, confidences)."""
        return [([int(t) for t in ids], list(conf)) for ids, conf in packed.tolist()]


def chain(heads, collapsed: torch.Tensor, base: torch.Tensor, ys: torch.Tensor, ints: torch.Tensor,
          floats: torch.Tensor, flags: Flags, rows: int, logits: bool = False) -> Chained:
    """`DSpark._chain` for Q sequences on the device: collapsed [Q * rows, d] (raw), base [Q * rows, V] fp32 (the
    shared head's logits), ys [Q] int64 (each sequence's token before its block). `heads`: the `DSpark` record
    (markov_embed, markov_head, confidence_proj). No host read."""
    Q = ys.shape[0]
    head, proj = heads.markov_head.float(), heads.confidence_proj.float()
    prev, ids, conf, out = ys, [], [], []
    for i in range(rows):
        e = heads.markov_embed.index_select(0, prev).float()  # [Q, rank]: the previous choice's embedding
        e = [e[q].clone() for q in range(Q)]  # each its own vector, as the reference's (BLAS may read by alignment)
        row = torch.stack([base[q * rows + i] + head @ e[q] for q in range(Q)])
        conf.append(torch.cat([torch.sigmoid(proj @ torch.cat((collapsed[q * rows + i].float(), e[q])))
                               for q in range(Q)]))
        prev = keyed_choices(row, ints, floats, i, flags)
        ids.append(prev)
        if logits:
            out.append(row)
    return Chained(torch.stack(ids, dim=1), torch.stack(conf, dim=1), torch.stack(out, dim=1) if logits else None)
