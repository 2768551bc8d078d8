"""The batched engine loop, torch-free: `step()` = schedule -> executor.execute(batch) -> postprocess -> events.

Every reply is the one its request gets alone (docs/ENGINE.md §4): a row's bits never depend on the other rows,
a prompt cut into chunks absorbs exactly as in one piece, and the keyed sampler draws token p from (seed, p,
logits) only. So this loop is free to batch, chunk and interleave as it likes; it decides only *when* rows run.

Events go out through each sequence's `emit` (the async bridge hands them to the request's stream): a
`PromptLogprobsEvent` once the prompt is in (when asked for), a `TokenEvent` per output token, then one
`FinishEvent` (after the request's slot and pages are back in the pool) or an `EngineFailure`.

A group (`add_group`: n > 1, best_of) prefills its prompt once: when the leader reaches `hold_at` the siblings
fork (`_fork`): the next `Batch` carries the copies (the leader's ring slot, the page its prompt leaves partial)
that the runtime makes before that step's forward, and from then on every sibling is a sequence of its own, the
same one it is alone (its seed, its last prompt token, its pages).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from .batch import DECODE, PREFILL, VERIFY, Batch, Row, RowOutput, RowSampling
from .block_manager import BlockManager
from .drafting import DRAFTERS, DraftConfig, DrafterStats, choose_depth, lookup_draft
from .params import banned_ids
from .overlap import OverlapLoop
from .interface import EngineFailure, EngineRejected, FinishEvent, PromptLogprobsEvent, TokenEvent
from .request import Sequence, SequenceGroup, Status
from .scheduler import Scheduler, SchedulerConfig
from .sessions import SessionCache, SessionConfig, prompt_mark

ROW_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096)
# seconds: queue (arrival -> first scheduled), prefill (first scheduled -> prompt in), inter-token gaps
TIME_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0)


class TimeHistogram:
    """Counts per TIME_BUCKETS bound (not cumulative; the last count is above every bound) and their sum."""

    def __init__(self):
        self.counts = [0] * (len(TIME_BUCKETS) + 1)
        self.sum = 0.0

    def observe(self, seconds: float) -> None:
        self.counts[next((i for i, b in enumerate(TIME_BUCKETS) if seconds <= b), len(TIME_BUCKETS))] += 1
        self.sum += seconds

    def figures(self) -> dict:
        return {"counts": list(self.counts), "sum": round(self.sum, 6)}


@dataclass
class EngineConfig:
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    prefill_mode: str = "full"  # "full" (exact) | "replay" (CED bounded replay: approximate, tagged)
    window: int = 128  # the model's sliding window (the replay segment)
    lookback: int = 0  # token ids before a chunk that the Engram n-grams need
    knobs_tag: str = ""  # every approximate setting in force ("" = exact)
    draft: DraftConfig = field(default_factory=DraftConfig)  # speculative drafting (engine/drafting.py)
    sessions: SessionConfig | None = None  # session entries in RAM (engine/sessions.py); None: off
    overlap: bool = True  # step k + 1 planned and launched while step k runs, where it can (engine/overlap.py)


class LLMEngine(OverlapLoop):
    def __init__(self, executor, blocks: BlockManager, config: EngineConfig, clock=time.monotonic):
        if config.prefill_mode not in ("full", "replay"):
            raise ValueError(f"prefill mode must be full or replay, got {config.prefill_mode!r}")
        self.executor, self.blocks, self.config, self.clock = executor, blocks, config, clock
        self.scheduler = Scheduler(config.scheduler, blocks, getattr(executor, "free_bytes", lambda: None), clock)
        # sessions resume only in full prefill: a replayed state is not the one a fresh prefill has
        disk = getattr(getattr(getattr(executor, "runner", None), "session_disk", None), "files", None)
        self.sessions = SessionCache(config.sessions, blocks, disk) \
            if config.sessions is not None and config.prefill_mode == "full" else None
        self.scheduler.sessions = self.sessions
        self._step_seqs: list[Sequence] = []  # the sequences with rows in the step now running
        watch = getattr(executor, "watch_aborts", None)
        if watch is not None:  # a long forward asks between its layers whether its step is still wanted
            watch(self.step_abandoned)
        self._freed_slots: list[int] = []
        self._freed_pages: list[int] = []
        self._copies: list[tuple[Sequence, list[int]]] = []  # forks made, copied before the next step's forward
        self.forks_total = 0
        self.step_no = 0
        self.aborted_steps = 0  # steps whose forward stopped early: every request in them had left
        self.prompt_tokens_total = 0
        self.generation_tokens_total = 0
        self.prefill_rows_total = 0
        self.decode_rows_total = 0
        self.round_seconds_total = 0.0
        self.last_round_s = 0.0
        self.rows_hist = {b: 0 for b in ROW_BUCKETS}
        self.times = {"queue": TimeHistogram(), "prefill": TimeHistogram(), "inter_token": TimeHistogram()}
        self._scheduled_at: dict[int, float] = {}  # seq id -> when its first row ran (until its prompt is in)
        self._last_token_at: dict[int, float] = {}  # seq id -> when its last token was reported
        self.drafters = {name: DrafterStats() for name in DRAFTERS}
        self._drafter_of: dict[int, str] = {}  # seq id -> the drafter of its verify row in this step
        self._inflight = None  # the launched step whose tokens are not read yet (engine/overlap.py)
        self.overlapped_steps = 0  # steps launched while the one before them ran
        self.discarded_rows = 0  # rows computed for a sequence that had finished meanwhile

    # ------------------------------------------------------------------ requests
    def add(self, seq: Sequence) -> None:
        self._check(seq)
        self._enqueue(seq)

    def add_group(self, seqs: list[Sequence]) -> None:
        """Siblings over one prompt (same prompt, budget, prompt logprobs and class; their own seeds, grammars,
        logprobs): admitted together, the prompt prefilled once, then forked. A group larger than the slots (or
        than the pool holds at once) is cut into groups that fit, each prefilling the prompt once."""
        first = seqs[0]
        for seq in seqs:
            self._check(seq)
            if (seq.prompt, seq.limit, seq.prompt_logprobs, seq.background) != \
                    (first.prompt, first.limit, first.prompt_logprobs, first.background):
                raise ValueError("the sequences of a group need the same prompt, budget, prompt logprobs and class")
        b = self.blocks
        shared = (first.prompt_len - 1) // b.page_tokens
        size = 1
        while size < len(seqs) and b.group_fits_alone(first.reserve_tokens, size + 1, shared):
            size += 1
        for at in range(0, len(seqs), size):
            part = seqs[at:at + size]
            if len(part) > 1:
                SequenceGroup(part)
            for seq in part:
                self._enqueue(seq)

    def _check(self, seq: Sequence) -> None:
        if not seq.prompt or seq.limit < 1:
            raise ValueError("a sequence needs a prompt token and room for one output token")
        if not self.blocks.fits_alone(seq.reserve_tokens):
            raise ValueError(f"{seq.prompt_len} prompt + {seq.limit} output tokens do not fit the pool")

    def _enqueue(self, seq: Sequence) -> None:
        if self.config.prefill_mode == "replay" and seq.prompt_logprobs is None:
            seq.replay_start = max(0, seq.prompt_len - self.config.window)
        if self.sessions is not None and seq.group is None:
            seq.mark_at = prompt_mark(seq.prompt_len, self.sessions.config.min_tokens)
        self._extend_forced(seq)  # text a grammar forces before the first sampled token
        self.scheduler.add(seq)

    def abort(self, seq: Sequence) -> None:
        """Cancel at any stage: queued, prefilling or decoding; everything it holds is freed at once."""
        if seq.status is Status.FINISHED:
            return
        self._finish(seq, "cancelled")

    def step_abandoned(self) -> bool:
        """Whether every sequence with rows in the running step was cancelled since it began (read from the forward's
        thread between layers: runtime/abort.py). A group's member counts only with its whole group cancelled (its
        siblings may wait for this prefill)."""
        seqs = self._step_seqs
        return bool(seqs) and all(s.cancel_requested and (s.group is None
                                                          or all(m.cancel_requested for m in s.group.members))
                                  for s in seqs)

    def has_work(self) -> bool:
        return self._inflight is not None or self.scheduler.has_work() or \
            (self.sessions is not None and self.sessions.pending)

    # ------------------------------------------------------------------ one step
    def step(self) -> bool:
        """Run (finish) one step; False when there was nothing to run. An executor failure fails the step's requests
        and is raised again (the caller decides whether the engine goes on). Overlapped: engine/overlap.py."""
        if self._inflight is not None:
            return self._overlapped_step()
        self._admit()
        for seq in self.scheduler.running:  # a group's leader resumed at its fork point: the siblings fork now
            if seq.hold_at is not None and seq.num_computed >= seq.hold_at:
                self._fork(seq)
        work = self.scheduler.schedule()
        self._drafter_of.clear()
        if not work:
            if self.sessions is not None and self.sessions.pending:
                self._housekeeping()
                return True
            return False
        now = self.clock()
        for seq, _ in work:
            if seq.prefilling and not seq.forked and seq.seq_id not in self._scheduled_at:
                self._scheduled_at[seq.seq_id] = now
                self.times["queue"].observe(now - seq.arrival)
        rows, planned = [], sum(n for seq, n in work if seq.prefilling)
        for seq, n in work:
            rows.append(self._row(seq, n, planned))
            planned += len(rows[-1].token_ids) if not seq.prefilling else 0
        copies = [entry for sib, entry in self._copies if sib.status is Status.RUNNING]
        self._copies = []
        batch = self._batch(rows, copies)
        if self._overlap_ready() and not any(r.n_draft or r.propose for r in rows):
            self._inflight = self._launch(work, rows, batch)
            return self._overlapped_step() if self._inflight is not None else True
        started = self.clock()
        out = self._call(work, self.executor.execute, batch)
        if out is not None:
            self._complete(work, rows, out, self.clock() - started)
        return True

    def _admit(self) -> None:
        for seq in self.scheduler.admit():
            seq.emit(EngineRejected(f"cannot admit the request: free memory stays under the floor "
                                    f"({self.config.scheduler.mem_floor_bytes} bytes) with nothing else running",
                                    code="insufficient_memory"))

    def _batch(self, rows: list[Row], copies: list) -> Batch:
        """The step's Batch: its rows, what was freed since the last one, the forks and session operations."""
        ops = {}
        if self.sessions is not None:
            ops, evicted = self.sessions.batch_ops()
            self._freed_pages += evicted
        batch = Batch(self.step_no, rows, self._freed_slots, self._freed_pages, self.config.knobs_tag,
                      copies=copies, **ops)
        self._freed_slots, self._freed_pages = [], []
        self.step_no += 1
        return batch

    def _complete(self, work, rows: list[Row], out, seconds: float) -> None:
        """A step's results: accounting, then each row's postprocessing. A sequence that finished after the step
        was launched (it stopped in the step before, or was cancelled) has its row computed and discarded: its
        slot and pages are already back, its reply unchanged."""
        self._loaded(out)
        prefill = sum(len(r.token_ids) for r in rows if r.phase == PREFILL)
        self.scheduler.observe(prefill, len(rows) - sum(r.phase == PREFILL for r in rows), seconds)
        self._account(rows, prefill, seconds)
        for (seq, n), row, result in zip(work, rows, out.rows):
            if seq.status is Status.FINISHED:
                self.discarded_rows += 1
                continue
            self._postprocess(seq, n, row, result)

    def _housekeeping(self) -> None:
        """A batch without rows: the session snapshots, restores and drops an idle engine still owes the runtime
        (so snapshots are taken and let go of promptly, and a drain can park every entry)."""
        ops, evicted = self.sessions.batch_ops()
        batch = Batch(self.step_no, [], self._freed_slots, self._freed_pages + evicted, self.config.knobs_tag,
                      **ops)
        self._freed_slots, self._freed_pages = [], []
        # between two steps: it takes the next step's number and is no round (rounds count forwards)
        self._loaded(self.executor.execute(batch))

    def _loaded(self, out) -> None:
        for seq_id, ok in getattr(out, "loads", ()):
            self.sessions.loaded(seq_id, bool(ok))

    def _sampling(self, seq: Sequence, drafts: list[int], mask: bytes | None) -> RowSampling:
        """The keyed draw after the sequence's tokens and `drafts` (its step, adjustments and grammar mask there:
        what a serial run uses at that position once the drafts are its tokens)."""
        p = seq.sampling
        sample = RowSampling(p.temperature, p.top_p, p.top_k, p.min_p, seq.seed, seq.produced + len(drafts),
                             seq.logprobs, mask)
        if p.adjusts:
            output = seq.tokens[seq.prompt_len:] + drafts
            penalised = p.presence_penalty or p.frequency_penalty or p.uses_prompt
            sample.adjust = [p.presence_penalty, p.frequency_penalty, p.repetition_penalty,
                             [list(b) for b in p.logit_bias],
                             None if p.allowed_token_ids is None else list(p.allowed_token_ids),
                             banned_ids(p, output, () if seq.ignore_eos else seq.stop_ids),
                             output if penalised else [], list(seq.prompt) if p.uses_prompt else []]
        return sample

    def _draft_cap(self, seq: Sequence) -> int:
        d = self.config.draft
        if not d.active:
            return 0
        cap = seq.draft if seq.draft is not None else (d.depth if d.default_on else 0)
        return max(0, min(cap, d.depth))

    def _drafts(self, seq: Sequence, planned: int) -> tuple[str, list[int]]:
        """The drafter and drafts this round verifies after y (the one token the sequence absorbs): the better
        of DSpark's proposal and a lookup match by tokens per second at their cost-chosen depths, cut where a
        serial run would not sample (budget, grammar end, forced text)."""
        d, cap = self.config.draft, min(self._draft_cap(seq), seq.limit - seq.produced - 1)
        if cap <= 0:
            return "", []
        options = []
        if d.dspark and seq.proposal:
            k, rate = choose_depth(seq.confidence, cap, d.cost, planned)
            options.append((rate, "dspark", seq.proposal[:k]))
        if d.lookup:
            found = lookup_draft(seq.tokens, cap, d.min_ngram, d.max_ngram)
            if found:
                c = (seq.lookup_accepted + 1) / (seq.lookup_drafted + 2)
                k, rate = choose_depth([c] * len(found), cap, d.cost, planned)
                options.append((rate, "lookup", found[:k]))
        options = [o for o in options if o[2]]
        if not options:
            return "", []
        _, name, drafts = max(options, key=lambda o: o[0])
        return name, drafts

    def _row(self, seq: Sequence, n: int, planned: int = 0) -> Row:
        a = seq.num_computed
        end = a + n
        sample, drafter, drafts, draft_samples = None, "", [], []
        if end == len(seq.tokens) and seq.produced < seq.limit:
            mask = seq.constraint.mask() if seq.constraint is not None else None
            sample = self._sampling(seq, [], mask)
            if n == 1 and not seq.prefilling:
                drafter, drafts = self._drafts(seq, planned)
                masks = seq.constraint.speculate(drafts) if drafts and seq.constraint is not None else None
                if masks is not None:
                    drafts = drafts[:len(masks)]
                draft_samples = [self._sampling(seq, drafts[:i + 1], masks[i] if masks else None)
                                 for i in range(len(drafts))]
        if drafts:
            self._drafter_of[seq.seq_id] = drafter
        scores = []
        for j, nxt in enumerate(range(a + 1, min(end + 1, len(seq.tokens)))):
            top = seq.prompt_logprobs if nxt < seq.prompt_len else seq.logprobs
            if top is not None:
                scores.append((j, seq.tokens[nxt], top))
        L = self.config.lookback
        phase = PREFILL if a < seq.prompt_len else VERIFY if drafts else DECODE
        propose = self._proposals(seq, planned) if sample is not None else 0
        return Row(seq.seq_id, seq.slot, seq.tokens[a:end] + drafts, a, seq.pages, phase,
                   seq.tokens[max(0, a - L):a] if L else [], sample, scores, seq.replay_start, len(drafts),
                   draft_samples, propose)

    def _proposals(self, seq: Sequence, planned: int) -> int:
        """DSpark drafts to ask after a sampling row of `seq`: a pass only where some window could pay for itself
        at the step's rows (sure drafts, measured cost)."""
        if not self.config.draft.dspark or self._draft_cap(seq) <= 0:
            return 0
        cap = min(self._draft_cap(seq), self.config.draft.block)
        return cap if choose_depth([1.0] * cap, cap, self.config.draft.cost, planned)[0] else 0

    def _postprocess(self, seq: Sequence, n: int, row: Row, out: RowOutput) -> None:
        drafter = self._drafter_of.pop(seq.seq_id, "")
        if drafter:
            self.drafters[drafter].count(row.n_draft, out.accepted)
            if drafter == "lookup":
                seq.lookup_drafted += row.n_draft
                seq.lookup_accepted += out.accepted
        seq.proposal, seq.confidence = list(out.proposal), list(out.confidence)
        if out.error is not None and not out.emitted:
            grammar = out.error.startswith("the grammar")
            self._fail(seq, out.error, rejected="grammar_dead_end" if grammar else "no_token_allowed")
            return
        a = seq.num_computed
        seq.num_computed += n
        scored = dict(zip((j for j, _, _ in row.scores), out.scored))
        if seq.prompt_logprobs is not None:
            seq.prompt_scores += [(lp, tuple(top)) for j, (lp, top) in sorted(scored.items()) if a + j + 1 < seq.prompt_len]
        if seq.hold_at is not None and seq.num_computed >= seq.hold_at:
            self._fork(seq)
        if seq.mark_at is not None and seq.num_computed >= seq.mark_at:
            if seq.num_computed == seq.mark_at:  # the prompt's entry: an identical resend resumes here
                self.sessions.take(seq.tokens[:seq.num_computed], seq.pages, seq.slot)
            seq.mark_at = None
        if a < seq.prompt_len <= seq.num_computed:
            if not seq.forked:  # a group's prompt counts once
                self.prompt_tokens_total += seq.prompt_len
            scheduled = self._scheduled_at.pop(seq.seq_id, None)
            if scheduled is not None:
                self.times["prefill"].observe(self.clock() - scheduled)
            if seq.prompt_logprobs is not None:
                seq.emit(PromptLogprobsEvent(((None, ()), *seq.prompt_scores)))
                seq.prompt_scores = []
        # forced text this step absorbed: after the prompt, or after the sampled token this step started with
        for q in range(seq.prompt_len if a < seq.prompt_len else a + 1, seq.num_computed):
            logprob, top = scored.get(q - a - 1, (None, ()))  # row q - 1 predicts position q
            self._report(seq, seq.unreported.popleft(), logprob, top)
        # the round's tokens: the accepted drafts (their rows are in the cache: the rejected rows' are not counted,
        # the next round writes over them), then the one chosen after them, each handled as a serial step would
        emitted = out.emitted or ([(out.token, out.logprob, out.top)] if out.token is not None else [])
        if emitted and row.phase != PREFILL:
            seq.decode_rounds += 1
            seq.round_tokens += len(emitted)
        for i, (token, logprob, top) in enumerate(emitted):
            seq.tokens.append(token)
            seq.num_computed += i < out.accepted
            seq.produced += 1
            self._report(seq, token, logprob, top)
            if seq.constraint is not None and seq.constraint.accept(token):
                return self._finish(seq, "stop")
            if token in seq.stop_ids and not seq.ignore_eos:
                return self._finish(seq, "stop")
            if seq.produced >= seq.limit:
                return self._finish(seq, "length")
        if out.error is not None:  # after accepted drafts: where a serial run fails too
            grammar = out.error.startswith("the grammar")
            return self._fail(seq, out.error, rejected="grammar_dead_end" if grammar else "no_token_allowed")
        if emitted:
            self._extend_forced(seq)
        elif not seq.prefilling and seq.pending == 0 and seq.produced >= seq.limit:
            self._finish(seq, "length")  # forced text filled the budget

    def _report(self, seq: Sequence, token: int, logprob, top) -> None:
        self.generation_tokens_total += 1
        now, last = self.clock(), self._last_token_at.get(seq.seq_id)
        if last is not None:
            self.times["inter_token"].observe(now - last)
        self._last_token_at[seq.seq_id] = now
        if seq.logprobs is not None:
            seq.emit(TokenEvent(token, logprob, tuple(tuple(t) for t in top)))
        else:
            seq.emit(TokenEvent(token))

    def _extend_forced(self, seq: Sequence) -> None:
        while seq.constraint is not None and seq.produced < seq.limit:
            forced = seq.constraint.forced(seq.limit - seq.produced)
            if not forced:
                return
            seq.tokens += forced
            seq.unreported.extend(forced)
            seq.produced += len(forced)

    def _fork(self, leader: Sequence) -> None:
        """The leader's prefill reached its group's fork point: every waiting sibling starts there, with a copy of
        the leader's ring slot and of the partial page (its full pages are already the leader's)."""
        leader.hold_at = None
        at, pt = leader.num_computed, self.blocks.page_tokens
        partial = at // pt if at % pt else None
        for sib in leader.group.awaiting():
            sib.awaiting_fork, sib.forked, sib.num_computed = False, True, at
            sib.prompt_scores = list(leader.prompt_scores)
            src, dst = (leader.pages[partial], sib.pages[partial]) if partial is not None else (-1, -1)
            self._copies.append((sib, [leader.slot, sib.slot, src, dst]))
            self.forks_total += 1

    # ------------------------------------------------------------------ ending
    def _release(self, seq: Sequence, promote: bool = True) -> None:
        if seq.loading:
            self.sessions.cancel_load(seq)
            seq.loading = False
        if seq.hold_at is not None and promote:  # a leader gone before its fork: the next sibling prefills
            waiting = seq.group.awaiting()
            if waiting:
                waiting[0].awaiting_fork = False
                waiting[0].hold_at = seq.hold_at if len(waiting) > 1 else None
        seq.hold_at = None
        slot = seq.slot
        freed = self.scheduler.remove(seq)
        self._scheduled_at.pop(seq.seq_id, None)
        self._last_token_at.pop(seq.seq_id, None)
        if slot is not None:
            self._freed_slots.append(slot)
        self._freed_pages += freed

    def _finish(self, seq: Sequence, reason: str) -> None:
        if self.sessions is not None and self.sessions.config.reply_entries and seq.slot is not None \
                and not seq.awaiting_fork and not seq.loading:
            # the turn's end: the next turn's prompt starts with these ids (the slot is read before it is reused)
            self.sessions.take(seq.tokens[:seq.num_computed], seq.pages, seq.slot)
        self._release(seq)  # the finish event goes out after the slot and pages are back
        per_round = round(seq.round_tokens / seq.decode_rounds, 3) if seq.decode_rounds else None
        seq.emit(FinishEvent(reason=reason, prompt_tokens=seq.prompt_len,
                             completion_tokens=seq.produced - len(seq.unreported), cached_tokens=seq.cached,
                             tag=self.config.knobs_tag,
                             tokens_per_round=per_round))

    def _fail(self, seq: Sequence, message: str, rejected: str = "") -> None:
        """`rejected`: the EngineRejected code when the request itself is at fault ("" = an engine failure)."""
        if seq.status is not Status.FINISHED:
            waiting = seq.group.awaiting() if seq.hold_at is not None else []
            self._release(seq, promote=False)
            seq.emit(EngineRejected(message, code=rejected) if rejected else EngineFailure(message))
            for sib in waiting:  # they wait for this prefill: the same failure
                self._fail(sib, message, rejected)

    def fail_all(self, message: str) -> None:
        for seq in list(self.scheduler.running) + list(self.scheduler.waiting) + list(self.scheduler.waiting_bg):
            self._fail(seq, message)

    def pool_idle(self) -> bool:
        """Nothing live holds a slot or a page: every page reference left is a session entry's (the engine's own
        accounting of an idle pool)."""
        b = self.blocks
        held = [0] * b.num_pages
        for entry in (self.sessions.index.entries.values() if self.sessions is not None else ()):
            for p in entry.pages:
                held[p] += 1
        return (b.ref_counts == held and len(b.free_slots) == b.num_slots
                and sorted(b.free_pages) == [p for p in range(b.num_pages) if not held[p]])

    # ------------------------------------------------------------------ figures
    def _account(self, rows: list[Row], prefill: int, seconds: float) -> None:
        self.prefill_rows_total += prefill
        self.decode_rows_total += sum(len(r.token_ids) for r in rows if r.phase != PREFILL)
        self.round_seconds_total += seconds
        self.last_round_s = seconds
        n = sum(len(r.token_ids) for r in rows)
        self.rows_hist[next((b for b in ROW_BUCKETS if n <= b), ROW_BUCKETS[-1])] += 1

    def _draft_figures(self) -> dict:
        d = self.config.draft
        return {"drafters": [n for n, on in (("dspark", d.dspark), ("lookup", d.lookup)) if on],
                "depth": d.depth, "default_on": d.default_on,
                "step_cost": [list(p) for p in d.cost.points],
                **{name: st.figures() for name, st in self.drafters.items()}}

    def stats(self) -> dict:
        b, s = self.blocks, self.scheduler
        return {
            "slots_busy": b.num_used_slots, "slots_total": b.num_slots,
            "pages_used": b.num_used_pages, "pages_total": b.num_pages, "page_tokens": b.page_tokens,
            "queue": s.num_waiting, "running": len(s.running), "forks_total": self.forks_total,
            "prefill_tokens_total": self.prefill_rows_total, "decode_tokens_total": self.decode_rows_total,
            "rounds": self.step_no, "round_seconds_total": round(self.round_seconds_total, 6),
            "last_round_s": round(self.last_round_s, 6),
            "rows_per_round": {str(k): v for k, v in self.rows_hist.items() if v},
            "prefill_mode": self.config.prefill_mode, "tag": self.config.knobs_tag,
            # a long prompt's progress (/health's batching.prefilling): the running sequences still prefilling;
            # read from the server's thread, so over a copy of the list the engine thread may change
            "prefilling": [{"seq": q.seq_id, "prompt_tokens": q.prompt_len, "prefilled": q.num_computed}
                           for q in list(s.running) if q.prefilling],
            "drafting": self._draft_figures(),
            "overlap": {"on": self._overlap_ready(), "steps": self.overlapped_steps,
                        "discarded_rows": self.discarded_rows},
            "sessions": self.sessions.figures() if self.sessions is not None else None,
            "seconds": {"bounds": list(TIME_BUCKETS), **{k: h.figures() for k, h in self.times.items()}},
        }
