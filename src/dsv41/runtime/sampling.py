"""Keyed sampling: temperature, top-k, top-p, min-p and seeds, reproducible token by token.

The random draw for token id `v` at generation step `s` is a pure function of `(seed, s, v)`: a counter-based
hash turns the triple into a uniform number, and Gumbel-max picks `argmax(logits / T + gumbel(seed, s, v))`.
Because no random stream is consumed, the same request replays identically whatever else the process did, and a
vocab shard `[v0, v1)` under tensor parallelism computes exactly its slice of the full draw (each rank takes the
argmax of its slice and the winners are compared) without exchanging random state.

Filters are applied in the order top-k, min-p, top-p on temperature-scaled logits; a temperature <= 0 is greedy.
top-k/top-p need the whole vocab row; a TP runner gathers the filtered threshold, not the noise.
"""

from __future__ import annotations

import torch

from ..engine.params import GREEDY_BELOW, SamplingParams, banned_ids, derive_seed

__all__ = ["GREEDY_BELOW", "SamplingParams", "adjust_logits", "banned_ids", "derive_seed", "keyed_uniform",
           "keyed_gumbel", "filter_logits", "sample_token", "token_logprobs"]

_M32 = 0xFFFFFFFF


def _mul32(x, c: int):
    """(x * c) mod 2**32 for x < 2**32 without leaving int64 (c split in 16-bit halves)."""
    lo = x * (c & 0xFFFF)
    hi = ((x * (c >> 16)) & 0xFFFF) << 16
    return (lo + hi) & _M32


def _hash32(x):
    """A 32-bit avalanche mix (lowbias32 constants); works on Python ints and int64 tensors alike."""
    x = x & _M32
    x = x ^ (x >> 16)
    x = _mul32(x, 0x7FEB352D)
    x = x ^ (x >> 15)
    x = _mul32(x, 0x846CA68B)
    x = x ^ (x >> 16)
    return x


def _step_keys(seed: int, step: int) -> tuple[int, int]:
    seed &= (1 << 64) - 1
    key = _hash32(_hash32(_hash32(seed & _M32) ^ (seed >> 32)) ^ (step & _M32))
    return _hash32(key ^ 0x9E3779B9), _hash32(key ^ 0x85EBCA77)


def keyed_uniform(seed: int, step: int, token_ids: torch.Tensor) -> torch.Tensor:
    """Uniform numbers in (0, 1), float64, one per id in `token_ids`; depends only on (seed, step, id)."""
    key1, key2 = _step_keys(seed, step)
    ids = token_ids.to(torch.int64)
    high = _hash32(ids ^ key1)
    low = _hash32(high ^ key2)
    bits53 = (high << 21) | (low >> 11)
    return (bits53.to(torch.float64) + 0.5) / float(1 << 53)


def keyed_gumbel(seed: int, step: int, token_ids: torch.Tensor) -> torch.Tensor:
    """Standard Gumbel noise keyed by (seed, step, token id)."""
    return -torch.log(-torch.log(keyed_uniform(seed, step, token_ids)))


def adjust_logits(logits: torch.Tensor, params: SamplingParams, output: list[int], prompt: list[int],
                  banned: list[int]) -> torch.Tensor:
    """One row of logits [V] adjusted as the request asks, in vLLM's order: repetition penalty (ids in prompt or
    output), frequency and presence penalties (output ids), logit_bias, then allowed_token_ids and the banned ids
    (see `banned_ids`) at -inf. Float32 out; the input is not modified. Logprobs stay those of the raw model."""
    out = logits.to(torch.float32).clone()
    vocab = out.shape[-1]
    if params.repetition_penalty != 1.0 and (output or prompt):
        seen = torch.tensor(sorted({t for t in list(prompt) + list(output) if 0 <= t < vocab}), dtype=torch.long,
                            device=out.device)
        values = out[seen]
        p = float(params.repetition_penalty)
        out[seen] = torch.where(values > 0, values / p, values * p)
    if (params.frequency_penalty or params.presence_penalty) and output:
        counts = torch.bincount(torch.tensor([t for t in output if 0 <= t < vocab], dtype=torch.long),
                                minlength=vocab).to(out.device, torch.float32)
        out -= float(params.frequency_penalty) * counts + float(params.presence_penalty) * (counts > 0).float()
    for token, bias in params.logit_bias:
        if 0 <= token < vocab:
            out[token] += float(bias)
    if params.allowed_token_ids is not None:
        keep = torch.zeros(vocab, dtype=torch.bool, device=out.device)
        keep[[t for t in params.allowed_token_ids if 0 <= t < vocab]] = True
        out = out.masked_fill(~keep, float("-inf"))
    if banned:
        out[[t for t in banned if 0 <= t < vocab]] = float("-inf")
    return out


def filter_logits(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """Temperature-scaled float64 logits with everything outside top-k / min-p / top-p set to -inf."""
    scaled = logits.to(torch.float64) / max(params.temperature, GREEDY_BELOW)
    vocab = scaled.shape[-1]
    if 0 < params.top_k < vocab:
        kth = torch.topk(scaled, params.top_k).values[-1]
        scaled = scaled.masked_fill(scaled < kth, float("-inf"))
    if params.min_p > 0.0:
        probs = torch.softmax(scaled, dim=-1)
        scaled = scaled.masked_fill(probs < params.min_p * probs.max(), float("-inf"))
    if params.top_p < 1.0:
        order = torch.argsort(scaled, descending=True, stable=True)
        probs = torch.softmax(scaled[order], dim=-1)
        # keep a token when the mass strictly before it is still short of top_p (the first always stays)
        mass_before = torch.cumsum(probs, dim=-1) - probs
        drop = order[mass_before >= params.top_p]
        scaled = scaled.index_fill(0, drop, float("-inf"))
    return scaled


def sample_token(logits: torch.Tensor, params: SamplingParams, seed: int, step: int) -> int:
    """Pick the next token id from one row of logits [V] (disallowed ids already at -inf)."""
    if params.greedy:  # argmax where the row is: the first maximum on every device, one id crosses, not the row
        return int(torch.argmax(logits.detach()))
    logits = logits.detach().cpu()  # the keyed noise is computed on the CPU; one row is cheap to move
    scaled = filter_logits(logits, params)
    noise = keyed_gumbel(seed, step, torch.arange(scaled.shape[-1]))
    return int(torch.argmax(scaled + noise))


def token_logprobs(logits: torch.Tensor, chosen: int, top: int) -> tuple[float, list[tuple[int, float]]]:
    """Log-probability of `chosen` under the model's raw distribution, and the `top` most likely (id, logprob)."""
    logp = torch.log_softmax(logits.to(torch.float32), dim=-1)
    best: list[tuple[int, float]] = []
    if top > 0:
        values, ids = torch.topk(logp, min(top, logp.shape[-1]))
        best = [(int(i), float(v)) for i, v in zip(ids, values)]
    return float(logp[chosen]), best
