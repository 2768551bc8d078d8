"""The overlapped loop of `LLMEngine` (docs/ENGINE.md §6 "The overlapped loop"), torch-free: while step k runs,
step k + 1 is planned and launched behind it, then step k's tokens are read and postprocessed.

A step is launched (`executor.launch(batch)` -> a pending result) instead of executed; while it runs, the engine
plans the next step where every sequence it runs follows from the running step's samples (`_plan_following`:
follow rows, `Row.follows`, whose token id the runtime takes from the running step's sample itself), launches it,
and only then reads the running step's tokens (`_wait`) and postprocesses them. A sequence that stopped in step k
has its follow row in step k + 1 computed and discarded (`LLMEngine._complete`). Where the next step cannot follow
(prefill chunks, new admissions, forks, session operations, drafting, grammars, logit adjustments) it is planned
by the serial path once step k is read.
"""

from __future__ import annotations

from dataclasses import dataclass

from .batch import DECODE, FOLLOWS, Batch, Row, RowSampling, StepAborted
from .request import Sequence, Status


@dataclass
class InFlight:
    """A launched step: its (sequence, tokens) work, its rows, the executor's pending result, when it started."""

    work: list
    rows: list
    pending: object
    started: float


class OverlapLoop:
    """`LLMEngine`'s overlapped steps (a mixin: the engine's scheduler, rows, batches and postprocessing)."""

    def _overlap_ready(self) -> bool:
        """Whether steps may be launched ahead: asked for, an executor that launches (every one does), and no entries
        at a reply's end (a finished sequence's discarded row would write its slot before the entry's snapshot)."""
        return self.config.overlap and hasattr(self.executor, "launch") and \
            (self.sessions is None or not self.sessions.config.reply_entries)

    def _call(self, work, fn, batch):
        """`fn(batch)` (the executor's execute or launch) with the step's sequences watched by the abort probe;
        None when they all left meanwhile (StepAborted: each ends as cancelled), any other failure fails them and
        is raised again."""
        self._step_seqs = [seq for seq, _ in work]
        try:
            return fn(batch)
        except StepAborted as exc:
            self._aborted(work, exc)
            return None
        except BaseException as exc:
            for seq, _ in work:
                self._fail(seq, f"{type(exc).__name__}: {exc}")
            raise
        finally:
            self._step_seqs = []

    def _aborted(self, work, exc: StepAborted) -> None:
        """Every request of the step left while it ran: the forward stopped between layers and kept nothing (the
        states are stored back only after the last layer), so each ends as cancelled from the state before this
        step; the session loads the runner made before the forward still report."""
        self.aborted_steps += 1
        self._loaded(getattr(exc, "output", None))
        for seq, _ in work:
            if seq.status is not Status.FINISHED:
                self._finish(seq, "cancelled")

    def _launch(self, work, rows: list[Row], batch: Batch) -> "InFlight | None":
        """Hand the step to the executor without waiting for its tokens; None when its requests all left
        meanwhile (a long prefill forward that stopped between layers)."""
        started = self.clock()
        pending = self._call(work, self.executor.launch, batch)
        return None if pending is None else InFlight(work, rows, pending, started)

    def _overlapped_step(self) -> bool:
        """Step k is running: plan and launch step k + 1 behind it where it can follow, then read step k's tokens
        (the host's only wait) and postprocess them while step k + 1 runs."""
        running, self._inflight = self._inflight, None
        following = self._plan_following(running)
        try:
            if following is not None:
                self._inflight = self._launch(*following)
                self.overlapped_steps += self._inflight is not None
        finally:
            self._wait(running)
        return True

    def _wait(self, running: "InFlight") -> None:
        out = self._call(running.work, lambda _: running.pending.result(), None)
        if out is not None:
            self._complete(running.work, running.rows, out, self.clock() - running.started)

    def _may_follow(self, seq: Sequence) -> bool:
        """Whether the sequence's next row is known before its last token is: no grammar (its next mask is the
        matcher's after the token), no logit adjustments (penalties and banned words read the output), no lookup
        drafts (found from the token). DSpark drafts come from a proposal, which a row without `propose` does not
        make: such rows follow, unless the next row would ask a pass (`_plan_following`)."""
        return seq.constraint is None and not seq.sampling.adjusts and \
            (self._draft_cap(seq) == 0 or not self.config.draft.lookup)

    def _plan_following(self, running: "InFlight") -> tuple | None:
        """Step k + 1 planned while step k runs, or None where it cannot be (the serial path plans it after step
        k): every sequence with rows next must be one whose step-k row samples one token (prefill chunks, forks,
        new admissions, session operations, drafts and grammars wait for step k). Each such sequence that does
        not end by its budget at step k gets a follow row: its position, slot, pages, look-back and sampling are
        known; its token id is step k's sample, which the runtime hands over itself. A sequence that stops at
        step k (a stop id) has its follow row computed and discarded (`_complete`)."""
        if not self._overlap_ready():
            return None
        self._admit()
        if self._copies or (self.sessions is not None and self.sessions.pending):
            return None
        in_step, follow = set(), set()
        for (seq, _), row in zip(running.work, running.rows):
            in_step.add(seq.seq_id)
            if seq.status is not Status.RUNNING:
                continue  # cancelled since: nothing next
            if row.sample is None or row.n_draft or row.propose or not self._may_follow(seq):
                return None
            if seq.produced + 1 < seq.limit:
                follow.add(seq.seq_id)
        for seq in self.scheduler.running:
            if seq.seq_id not in in_step and seq.pending > 0 and not seq.awaiting_fork and not seq.loading:
                return None  # a prefill chunk (or a fork's first row) waits for the serial path
        work = [(seq, 1) for seq in self.scheduler.running if seq.seq_id in follow]
        if not work:
            return None
        rows = [self._follow_row(seq, planned) for planned, (seq, _) in enumerate(work)]
        if any(r.propose for r in rows):  # a DSpark pass after it: a drafting round, planned serially
            return None
        return work, rows, self._batch(rows, [])

    def _follow_row(self, seq: Sequence, planned: int) -> Row:
        """The row the serial path gives `seq` once its running step's token t is in: t at position
        len(tokens) (t is not yet among them), sampled at the next generation step (`_row` with one pending
        token and no grammar, adjustments or drafts)."""
        a, L, p = len(seq.tokens), self.config.lookback, seq.sampling
        sample = RowSampling(p.temperature, p.top_p, p.top_k, p.min_p, seq.seed, seq.produced + 1, seq.logprobs)
        return Row(seq.seq_id, seq.slot, [FOLLOWS], a, seq.pages, DECODE, seq.tokens[max(0, a - L):a] if L else [],
                   sample, [], seq.replay_start, propose=self._proposals(seq, planned), follows=True)
