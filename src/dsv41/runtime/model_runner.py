"""`ModelRunner.execute(batch) -> StepOutput`: one step of many sequences over the KV pool, then the keyed sampler.

The runner owns the pool and a forward (`forward.execute(rows, pool) -> per row the fp32 logits of
row.logit_offsets()`: `PoolForward` on the CPU, the fast path where it is built). It keeps no per-request state:
everything a row needs travels in the `Row`; a step's forks (`Batch.copies`: a group's siblings taking a copy of
their leader's ring slot and partial page) are made before its forward. On every rank of a TP group the same `execute` runs (the forward's
collectives keep the ranks in step); only the driver (rank 0) reports (a launched step is sampled on every rank).

`launch(batch)` runs the same step without waiting for its tokens (the overlapped loop, docs/ENGINE.md §6): a
`PendingStep` whose `result()` reads them (runtime/step_handoff.py); a follow row's id comes from the step launched
before it.

Per row: the sampled token from the last row's logits (the request's logit adjustments, then its grammar mask
applied first), the sampled token's
logprob and top logprobs, and the logprob (+ top) of each `scores` entry: the prompt's next tokens (prompt
logprobs) or a grammar's forced text. Logprobs are those of the raw model distribution, as `SerialEngine` reports
them.
"""

from __future__ import annotations

import torch

from ..engine.batch import Batch, Row, RowOutput, RowSampling, StepAborted, StepOutput
from .abort import AbortWatch
from .sampling import SamplingParams, adjust_logits, sample_token, token_logprobs
from .step_handoff import Handoff, PendingStep, StepSample


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
    def __init__(self, forward, pool, *, driver: bool = True, knobs_tag: str = "", drafter=None, session_disk=None):
        self.forward, self.pool, self.driver, self.knobs_tag = forward, pool, driver, knobs_tag
        self.device = getattr(pool, "device", torch.device("cpu"))
        self.drafter = drafter  # DSpark (runtime/draft_dspark.py) when loaded: rows with `propose` get drafts
        self.snapshots: dict[int, torch.Tensor] = {}  # session entry id -> its ring slot's bytes (Batch.saves)
        self.session_disk = session_disk  # runtime/session_disk.py: this rank's NVMe tier (--session-dir)
        # between layers of a long forward: whether its step is still wanted (rank 0 asks the engine; every rank
        # stops at the same layer: runtime/abort.py)
        model = getattr(forward, "model", None)
        self.abort_watch = AbortWatch(getattr(model, "comm", None),
                                      layers=getattr(getattr(model, "cfg", None), "num_hidden_layers", 40))
        forward.abort_watch = self.abort_watch
        self._last_sample = None  # the last launched step's sample: what its follow rows take their ids from
        self._side = None  # CUDA: the stream that reads a launched step's sample (runtime/step_handoff.py)

    def watch_aborts(self, probe) -> None:
        """The engine's `step_abandoned` (rank 0's runner only; the other ranks follow its answer)."""
        self.abort_watch.probe = probe

    def free_bytes(self) -> int:
        return free_bytes(self.device)

    def _before_forward(self, batch: Batch) -> list[list[int]]:
        """What a step does before its forward, in order: session snapshots, parks, restores and loads, the
        forks' copies, dropped snapshots. Returns the loads' report."""
        if batch.knobs_tag != self.knobs_tag:
            raise RuntimeError(f"step {batch.step} was planned under {batch.knobs_tag!r}, this runner runs "
                               f"{self.knobs_tag!r}")
        for entry_id, slot in batch.saves:  # session entries: a slot is read before anything writes it again
            self.snapshots[entry_id] = self.pool.snapshot_slot(slot)
        for entry_id, key, ids, pages in batch.parks:  # and pages an eviction freed, before anything reuses them
            if self.session_disk is not None and entry_id in self.snapshots:
                self.session_disk.park(key, ids, self.snapshots[entry_id], pages)
        for entry_id, slot, src_page, dst_page in batch.restores:  # sequences resuming from a session entry
            if entry_id not in self.snapshots:
                raise RuntimeError(f"step {batch.step}: session entry {entry_id} has no slot snapshot here")
            self.pool.restore_slot(self.snapshots[entry_id], slot)
            if src_page >= 0:
                self.pool.copy_page(src_page, dst_page)
        loads = self._load(batch.loads)
        for src_slot, dst_slot, src_page, dst_page in batch.copies:  # forks (after a resumed leader's restore)
            self.pool.copy_slot(src_slot, dst_slot)
            if src_page >= 0:
                self.pool.copy_page(src_page, dst_page)
        for entry_id in batch.drops:
            self.snapshots.pop(entry_id, None)
        return loads

    def launch(self, batch: Batch) -> PendingStep:
        """The step enqueued without waiting for its tokens (the overlapped loop, ENGINE.md §6): the forward, the
        greedy picks on the device and an event after them; `result()` reads the tokens. Its follow rows take their
        ids from the step launched before (`Handoff`: on the device where the forward can, else from the host's
        read of that step's sample). Steps without drafts (the engine runs those through `execute`). At TP > 1 every
        rank launches the same steps: each samples the gathered logits itself (the same keyed choice), so that its
        follow rows take the same ids; a follower's `PendingStep` is never read."""
        if any(r.n_draft or r.propose for r in batch.rows):
            raise ValueError(f"step {batch.step}: launch runs steps without drafts")
        loads = self._before_forward(batch)
        if not batch.rows:
            return PendingStep(batch.step, None, loads, self._row)
        handoff = Handoff.of(batch.rows, self._last_sample)
        rows = batch.rows
        try:
            if handoff is not None and getattr(self.forward, "takes_handoff", lambda rows: False)(rows):
                logits = self.forward.execute(rows, self.pool, handoff=handoff)
            else:
                rows = handoff.resolved(rows) if handoff is not None else rows
                logits = self.forward.execute(rows, self.pool)
        except StepAborted as exc:
            exc.output = StepOutput(batch.step, loads=loads)
            self._last_sample = None
            self._gate_steps()
            raise
        except BaseException:
            self._gate_steps()  # a failed launch's gated buckets are not checked with a later step
            raise
        if self.device.type == "cuda" and self._side is None:
            self._side = torch.cuda.Stream(self.device)
        self._last_sample = StepSample(rows, logits, self.device, self._choose, self._side)
        check = self._gate_steps()
        return PendingStep(batch.step, self._last_sample, loads, self._row, check=check)

    @property
    def gated(self) -> bool:
        """Whether this rank's forward has an Engram gate (its launched steps have a check: at TP > 1 every
        follower sends rank 0 its verdict of each launched step, parallel/executor.py)."""
        return getattr(getattr(self.forward, "model", None), "engram_gate", None) is not None

    def _gate_steps(self):
        """The Engram gate's check of the buckets the forward just launched (runtime/engram_gate.py), or None."""
        gate = getattr(getattr(self.forward, "model", None), "engram_gate", None)
        steps = gate.take_steps() if gate is not None else []
        return (lambda: gate.check(steps)) if steps else None

    def execute(self, batch: Batch) -> StepOutput:
        loads = self._before_forward(batch)
        if not batch.rows:
            return StepOutput(batch.step, loads=loads)
        self._last_sample = None  # a follow row follows a launched step only
        try:
            logits = self.forward.execute(batch.rows, self.pool)
        except StepAborted as exc:  # the step's requests all left: what ran before the forward still counts
            exc.output = StepOutput(batch.step, loads=loads)
            self._gate_steps()
            raise
        except BaseException:
            self._gate_steps()
            raise
        check = self._gate_steps()
        proposing = self.drafter is not None and any(r.propose for r in batch.rows)
        if not self.driver and not proposing:
            return StepOutput(batch.step)
        # followers choose too when drafts are asked: the draft pass runs on every rank from the chosen tokens
        # (the same logits on every rank, the same keyed choice)
        pairs = [(r, lg) for r, lg in zip(batch.rows, logits) if self.driver or r.propose]
        rows = [r for r, _ in pairs]
        greedy = self._greedy_tokens(rows, [lg for _, lg in pairs])
        outs = [self._row(row, lg, greedy.get(i)) for i, (row, lg) in enumerate(pairs)]
        if check is not None:  # the gated buckets had their Engram rows (read once the step's tokens are in)
            check()
        if proposing:
            self._propose(rows, outs)
        return StepOutput(batch.step, outs, loads=loads) if self.driver else StepOutput(batch.step)

    def _load(self, loads: list[list]) -> list[list[int]]:
        """Parked session entries into the sequences' slots and pages: [seq id, 1 if every rank loaded its file
        whole else 0] each (a rank that lacks it or finds it damaged makes the request prefill fresh everywhere)."""
        if not loads:
            return []
        got = [self.session_disk is not None and self.session_disk.load(key, slot, pages)
               for _, key, slot, pages in loads]
        comm = getattr(getattr(self.forward, "model", None), "comm", None)
        missing = torch.tensor([0.0 if ok else 1.0 for ok in got], device=self.device)
        if comm is not None and comm.world > 1:
            missing = comm.sum_partials(missing)
        return [[seq_id, int(m == 0)] for (seq_id, *_), m in zip(loads, missing.tolist())]

    def _propose(self, rows: list[Row], outs: list[RowOutput]) -> None:
        """The DSpark pass for the rows that ask it, from each row's last kept position and its last token."""
        asks, owners = [], []
        for row, out in zip(rows, outs):
            if row.propose and out.token is not None:
                s = row.sample
                params = SamplingParams(s.temperature, s.top_p, s.top_k, s.min_p, s.seed)
                last = row.start_pos + row.first_choice + out.accepted
                asks.append((row, last, out.token, params, s.step + out.accepted + 1, row.propose))
                owners.append(out)
        for out, (tokens, conf) in zip(owners, self.drafter.propose(self.pool, asks)):
            out.proposal, out.confidence = tokens, conf

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
            if s is not None and not row.n_draft and s.adjust is None and s.mask is None and s.params().greedy:
                picks.append((i, lg[row.logit_offsets().index(len(row.token_ids) - 1)]))
        on_gpu = bool(picks) and picks[0][1].is_cuda
        if len(picks) < (1 if on_gpu else 2):
            return {}
        from ..kernels.step.argmax import greedy_ids

        tokens = greedy_ids(torch.stack([last for _, last in picks])).tolist()
        return {i: token for (i, _), token in zip(picks, tokens)}

    @torch.inference_mode()
    def _row(self, row: Row, logits: torch.Tensor | None, greedy: int | None = None, choice=None) -> RowOutput:
        """`choice`: the row's (token, error) when already made (a launched step's sample), else `_choose`'s."""
        out = RowOutput(row.seq_id)
        at = {offset: i for i, offset in enumerate(row.logit_offsets())}
        for offset, token, top in row.scores:
            logprob, best = token_logprobs(logits[at[offset]], token, top)
            out.scored.append((logprob, best))
        s = row.sample
        if s is None:
            return out
        if not row.n_draft:
            out.token, out.error = choice or self._choose(logits[at[row.first_choice]], s, greedy)
            if out.token is not None and s.logprobs is not None:
                out.logprob, out.top = token_logprobs(logits[at[row.first_choice]], out.token, s.logprobs)
            return out
        # a verify window: the keyed choice at each row, kept while it equals the draft that follows (so the round
        # emits exactly the tokens serial decoding gives: accepted drafts, then the first choice that differs or the
        # one after the last draft)
        drafts = row.token_ids[row.first_choice + 1:]
        samplings = [s] + [d if isinstance(d, RowSampling) else RowSampling(*d) for d in row.draft_samples]
        for i, si in enumerate(samplings):
            raw = logits[at[row.first_choice + i]]
            token, out.error = self._choose(raw, si, None)
            if token is None:
                break
            logprob, top = token_logprobs(raw, token, si.logprobs) if si.logprobs is not None else (None, [])
            out.emitted.append((token, logprob, top))
            if i == len(drafts) or token != drafts[i]:
                out.token, out.logprob, out.top = token, logprob, top
                break
        out.accepted = len(out.emitted) - (out.token is not None)
        return out

    @staticmethod
    def _choose(raw: torch.Tensor, s: RowSampling, greedy: int | None) -> tuple[int | None, str | None]:
        """The keyed choice of one row (its adjustments, then its grammar mask), or the reason there is none."""
        params = s.params()
        masked = raw
        if s.adjust is not None:
            masked = adjust_logits(raw, params, s.adjust[6], s.adjust[7], s.adjust[5])
            if not torch.isfinite(masked).any():
                return None, "the sampling parameters (allowed_token_ids, bad_words, min_tokens) allow no token here"
        if s.mask is not None:
            masked = masked.float().masked_fill(~allowed_ids(s.mask, raw.shape[-1], raw.device), float("-inf"))
            if not torch.isfinite(masked).any():
                return None, "the grammar allows no token at this point"
        return (sample_token(masked, params, s.seed, s.step) if greedy is None else greedy), None
