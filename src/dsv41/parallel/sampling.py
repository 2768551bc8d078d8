"""Keyed sampling when each rank holds only a vocabulary shard of the logits.

`sample_token_sharded` picks the same token as `dsv41.runtime.sampling.sample_token` applied to the full row, and
every rank gets the same answer, while only a few numbers per rank cross the link instead of the whole row:

- the keyed Gumbel noise of token v depends only on (seed, step, v), so each rank computes its own slice of it;
- greedy / plain temperature: each rank proposes the best (score, id) of its slice; the largest wins, ties to the
  lowest id (what `argmax` over the full row does);
- top-k: the k-th largest value is found from every rank's top-k values;
- min-p and top-p need the softmax normaliser: the global max and the rank-ordered sum of the per-shard
  `sum(exp(x - max))` are gathered (the logsumexp). top-p then needs the head of the globally sorted row: every rank
  sends its best `candidates` survivors, the merged list is exact down to the smallest "last value sent", and if the
  nucleus reaches past that point the exchange repeats with twice as many.

Every rank receives the same gathered numbers and does the same arithmetic in the same order, so the choice is
identical on all ranks. It equals the single-rank choice exactly except in one knife-edge case: the single-rank
softmax sums the whole row in torch's order, this one sums shard by shard, so a token whose cumulative probability
lies within ~1e-16 (relative) of the top-p / min-p threshold could fall on the other side.
"""

from __future__ import annotations

import torch

from dsv41.runtime.sampling import GREEDY_BELOW, SamplingParams, keyed_gumbel
from dsv41.parallel.comm import Comm

NEG_INF = float("-inf")


def _gather(comm: Comm, t: torch.Tensor) -> torch.Tensor:
    """Rank-order concatenation along dim 0 through the comm's device (NCCL needs GPU tensors), back on CPU.
    The arithmetic stays on the CPU, like the engine's sampler, so that the choice is bit-for-bit the same."""
    device = getattr(comm, "device", None)
    return comm.gather_cat(t.to(device) if device is not None else t, dim=0).cpu()


def _best(values: torch.Tensor, offset: int, comm: Comm) -> int:
    """Global argmax (lowest id on ties) of a row split over ranks; `values` is this rank's slice."""
    if values.numel():
        local = torch.argmax(values)  # first maximum inside the slice
        proposal = torch.tensor([[float(values[local]), float(int(local) + offset)]], dtype=torch.float64)
    else:
        proposal = torch.tensor([[NEG_INF, -1.0]], dtype=torch.float64)
    proposals = _gather(comm, proposal)
    # slices are in rank order, so the first rank holding the maximum holds its lowest id
    winner = int(torch.argmax(proposals[:, 0]))
    return int(proposals[winner, 1])


def _global_max(values: torch.Tensor, comm: Comm) -> float:
    local = values.max() if values.numel() else torch.tensor(NEG_INF, dtype=torch.float64)
    return float(_gather(comm, local.reshape(1).to(torch.float64)).max())


def _global_sum(partial: torch.Tensor, comm: Comm) -> torch.Tensor:
    parts = _gather(comm, partial.reshape(1).to(torch.float64))
    total = parts[0].clone()
    for part in parts[1:]:
        total += part
    return total


def _kth_largest(values: torch.Tensor, k: int, comm: Comm) -> float:
    local = torch.topk(values, min(k, values.numel())).values if values.numel() else values
    merged = _gather(comm, local.to(torch.float64))
    return float(torch.topk(merged, k).values[-1])


def _nucleus(scaled: torch.Tensor, offset: int, top_p: float, comm: Comm, candidates: int) -> torch.Tensor:
    """Global ids of the top-p nucleus of `scaled` (this rank's slice, -inf = filtered), same on every rank."""
    row_max = _global_max(scaled, comm)
    norm = _global_sum(torch.exp(scaled - row_max).sum(), comm)
    want = candidates
    while True:
        take = min(want, scaled.numel())
        values, local_ids = torch.topk(scaled, take, sorted=True) if take else (scaled, scaled.long())
        # sort by (value desc, id asc), the order of a stable descending argsort over the full row
        ids = local_ids + offset
        order = torch.argsort(ids)
        values, ids = values[order], ids[order]
        values, order = torch.sort(values, descending=True, stable=True)
        ids = ids[order]
        # a rank that could not send all its survivors marks how far the merged list is trustworthy
        last_value = values[-1].item() if take else NEG_INF
        done = take >= scaled.numel() or last_value == NEG_INF  # nothing finite left unsent
        exhausted = torch.tensor([1.0 if done else 0.0], dtype=torch.float64)
        last = torch.tensor([last_value], dtype=torch.float64)
        all_values = _gather(comm, values.to(torch.float64))
        all_ids = _gather(comm, ids.to(torch.float64))
        flags = _gather(comm, torch.cat([exhausted, last]).reshape(1, 2))
        ids_sorted = torch.argsort(all_ids)
        all_values, all_ids = all_values[ids_sorted], all_ids[ids_sorted]
        all_values, order = torch.sort(all_values, descending=True, stable=True)
        all_ids = all_ids[order].long()
        cut_values = flags[flags[:, 0] == 0, 1]
        trusted = int((all_values > cut_values.max()).sum()) if cut_values.numel() else all_values.numel()
        probs = torch.exp(all_values - row_max) / norm
        mass_before = torch.cumsum(probs, dim=0) - probs
        drop = (mass_before >= top_p).nonzero()
        first_drop = int(drop[0]) if drop.numel() else all_values.numel()
        if first_drop < trusted or trusted == all_values.numel():
            keep = all_ids[:first_drop]
            return keep[torch.isfinite(all_values[:first_drop])]
        want *= 2


def sample_token_sharded(local_logits: torch.Tensor, vocab_offset: int, params: SamplingParams, seed: int,
                         step: int, comm: Comm, candidates: int = 64) -> int:
    """The token `sample_token(full_row, params, seed, step)` would pick, from this rank's slice of the row
    (`local_logits` [V_r], covering ids `vocab_offset .. vocab_offset + V_r - 1`). All ranks must call it together."""
    local_logits = local_logits.cpu()
    if params.greedy:
        return _best(local_logits, vocab_offset, comm)
    scaled = local_logits.to(torch.float64) / max(params.temperature, GREEDY_BELOW)
    vocab = int(_global_sum(torch.tensor(float(scaled.numel())), comm))
    if 0 < params.top_k < vocab:
        kth = _kth_largest(scaled, params.top_k, comm)
        scaled = scaled.masked_fill(scaled < kth, NEG_INF)
    if params.min_p > 0.0:
        row_max = _global_max(scaled, comm)
        norm = _global_sum(torch.exp(scaled - row_max).sum(), comm)
        probs = torch.exp(scaled - row_max) / norm
        scaled = scaled.masked_fill(probs < params.min_p * (1.0 / norm), NEG_INF)
    ids = torch.arange(vocab_offset, vocab_offset + scaled.numel())
    if params.top_p < 1.0:
        keep = _nucleus(scaled, vocab_offset, params.top_p, comm, candidates)
        mine = keep[(keep >= vocab_offset) & (keep < vocab_offset + scaled.numel())]
        allowed = torch.full_like(scaled, NEG_INF)
        allowed[mine - vocab_offset] = scaled[mine - vocab_offset]
        scaled = allowed
    return _best(scaled + keyed_gumbel(seed, step, ids), vocab_offset, comm)
