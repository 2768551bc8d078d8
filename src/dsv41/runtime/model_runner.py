"""`ModelRunner.execute(batch) -> StepOutput`: one step of many sequences over the KV pool, then the keyed sampler.

The runner owns the pool and a forward (`forward.execute(rows, pool) -> per row the fp32 logits of
row.logit_offsets()`: `PoolForward` on the CPU, the fast path where it is built). It keeps no per-request state:
everything a row needs travels in the `Row`; a step's forks (`Batch.copies`: a group's siblings taking a copy of
their leader's ring slot and partial page) are made before its forward. On every rank of a TP group the same `execute` runs (the forward's
collectives keep the ranks in step); only the driver (rank 0) samples and reports.

Per row: the sampled token from the last row's logits (the request's logit adjustments, then its grammar mask
applied first), the sampled token's
logprob and top logprobs, and the logprob (+ top) of each `scores` entry: the prompt's next tokens (prompt
logprobs) or a grammar's forced text. Logprobs are those of the raw model distribution, as `SerialEngine` reports
them.
"""

from __future__ import annotations

import torch

from ..engine.batch import Batch, Row, RowOutput, StepOutput
from ..engine.sampling import adjust_logits, sample_token, token_logprobs


def free_bytes(device: torch.device) -> int:
    """Memory left for new work: free device memory, or the host's MemAvailable on the CPU and on unified-memory
    GPUs (GB10: the GPU allocates from host memory, so the host's figure is the one that runs out)."""
    if device.type == "cuda" and not torch.cuda.get_device_properties(device).is_integrated:
        return int(torch.cuda.mem_get_info(device)[0])
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    return 0


def allowed_ids(mask: bytes, vocab: int, device) -> torch.Tensor:
    """bool [vocab] from an xgrammar bitmask (int32 words, bit v % 32 of word v // 32; ids past it disallowed)."""
    words = torch.frombuffer(bytearray(mask), dtype=torch.int32).to(device)
    ids = torch.arange(vocab, device=device)
    inside = ids < words.numel() * 32
    bits = (words[(ids // 32).clamp(max=max(words.numel() - 1, 0))] >> (ids % 32)) & 1
    return inside & bits.bool()


class ModelRunner:
    def __init__(self, forward, pool, *, driver: bool = True, knobs_tag: str = ""):
        self.forward, self.pool, self.driver, self.knobs_tag = forward, pool, driver, knobs_tag
        self.device = getattr(pool, "device", torch.device("cpu"))

    def free_bytes(self) -> int:
        return free_bytes(self.device)

    def execute(self, batch: Batch) -> StepOutput:
        if batch.knobs_tag != self.knobs_tag:
            raise RuntimeError(f"step {batch.step} was planned under {batch.knobs_tag!r}, this runner runs "
                               f"{self.knobs_tag!r}")
        for src_slot, dst_slot, src_page, dst_page in batch.copies:  # forks: before anything reads the slots
            self.pool.copy_slot(src_slot, dst_slot)
            if src_page >= 0:
                self.pool.copy_page(src_page, dst_page)
        logits = self.forward.execute(batch.rows, self.pool)
        if not self.driver:
            return StepOutput(batch.step)
        greedy = self._greedy_tokens(batch.rows, logits)
        return StepOutput(batch.step, [self._row(row, lg, greedy.get(i))
                                       for i, (row, lg) in enumerate(zip(batch.rows, logits))])

    @staticmethod
    @torch.inference_mode()
    def _greedy_tokens(rows: list[Row], logits: list) -> dict[int, int]:
        """The tokens of the rows drawn greedily with nothing to adjust or mask, in one launch and one read-back
        (a decode step of many such rows would otherwise wait on the device once a row): each row's argmax, the
        first maximum on every device, which is `sample_token`'s greedy choice. On a GPU the step kernels'
        `greedy_rows` (a program per chunk of a row, then one per row: torch's argmax of one row of the head is a
        single program) from one row on, the same index."""
        picks = []
        for i, (row, lg) in enumerate(zip(rows, logits)):
            s = row.sample
            if s is not None and s.adjust is None and s.mask is None and s.params().greedy:
                picks.append((i, lg[row.logit_offsets().index(len(row.token_ids) - 1)]))
        on_gpu = bool(picks) and picks[0][1].is_cuda
        if len(picks) < (1 if on_gpu else 2):
            return {}
        from ..kernels.step.argmax import greedy_ids

        tokens = greedy_ids(torch.stack([last for _, last in picks])).tolist()
        return {i: token for (i, _), token in zip(picks, tokens)}

    @torch.inference_mode()
    def _row(self, row: Row, logits: torch.Tensor | None, greedy: int | None = None) -> RowOutput:
        out = RowOutput(row.seq_id)
        at = {offset: i for i, offset in enumerate(row.logit_offsets())}
        for offset, token, top in row.scores:
            logprob, best = token_logprobs(logits[at[offset]], token, top)
            out.scored.append((logprob, best))
        s = row.sample
        if s is None:
            return out
        raw = logits[at[len(row.token_ids) - 1]]
        params = s.params()
        masked = raw
        if s.adjust is not None:
            masked = adjust_logits(raw, params, s.adjust[6], s.adjust[7], s.adjust[5])
            if not torch.isfinite(masked).any():
                out.error = "the sampling parameters (allowed_token_ids, bad_words, min_tokens) allow no token here"
                return out
        if s.mask is not None:
            masked = masked.float().masked_fill(~allowed_ids(s.mask, raw.shape[-1], raw.device), float("-inf"))
            if not torch.isfinite(masked).any():
                out.error = "the grammar allows no token at this point"
                return out
        out.token = sample_token(masked, params, s.seed, s.step) if greedy is None else greedy
        if s.logprobs is not None:
            out.logprob, out.top = token_logprobs(raw, out.token, s.logprobs)
        return out
