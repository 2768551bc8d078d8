"""Which rows run each step: admission, decode, chunked prefill with a bounded share (docs/ENGINE.md §5).

- Admission, FIFO with two classes (foreground before background): a request needs a free ring slot, pages for
  prompt + max tokens, and free memory above the floor (a group: a slot per sibling, the prompt's full pages once
  and each sibling's own pages, all at once). It waits, never fails, for any of them; only a request
  that cannot be admitted even with nothing else live is given up on, after `admit_timeout_s`.
- Every running sequence with a token to absorb gets its decode row in every step; a group's siblings wait for
  their leader's prefill (up to `hold_at`), then run as sequences of their own.
- Prompts are prefilled in chunks, oldest first, at most `prefill_chunk` rows a step in all. While streams are
  decoding, prefill gets at most `prefill_share` of the engine's time (measured: the time of a step beyond a
  decode-only step's, over the last few seconds), so running streams keep flowing.
- A step with no decode rows waits on nobody: its prefill may take up to `prefill_chunk_alone` rows (a longer chunk
  decodes each EXL3 weight once for more rows: docs/perf/prefill.md). Chunking never changes a bit (chunked ==
  one-shot), so the choice is free to follow the load.
"""

from __future__ import annotations

import math
import time
from collections import deque
from dataclasses import dataclass
from typing import Callable

from .block_manager import BlockManager
from .request import Sequence, Status
from .sessions import DiskHit


@dataclass
class SchedulerConfig:
    prefill_chunk: int = 2048
    prefill_chunk_alone: int = 0  # most prefill rows of a step without decode rows; 0 (or less) = prefill_chunk
    prefill_share: float = 0.5
    mem_floor_bytes: int = 0
    admit_timeout_s: float = 30.0
    share_window_s: float = 5.0  # the prefill share is measured over about this much recent time


class Scheduler:
    def __init__(self, config: SchedulerConfig, blocks: BlockManager,
                 free_bytes: Callable[[], int | None] = lambda: None, clock: Callable[[], float] = time.monotonic):
        if config.prefill_chunk < 1 or not 0.0 < config.prefill_share <= 1.0:
            raise ValueError(f"prefill chunk >= 1 and share in (0, 1] needed, got {config.prefill_chunk}, "
                             f"{config.prefill_share}")
        self.config, self.blocks, self.free_bytes, self.clock = config, blocks, free_bytes, clock
        self.waiting: deque[Sequence] = deque()
        self.waiting_bg: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self._prefill_s = 0.0
        self._total_s = 0.0
        self._decode_step_s: float | None = None  # a decode-only step's time (moving average)
        self.starved_since: float | None = None  # nothing live, yet the head of the queue cannot be admitted
        self.sessions = None  # engine/sessions.py SessionCache, when sessions are on
        self._hit = None  # the entry the unit `_fits` just checked resumes from

    # ------------------------------------------------------------------ queue
    def add(self, seq: Sequence) -> None:
        seq.arrival = seq.arrival or self.clock()
        (self.waiting_bg if seq.background else self.waiting).append(seq)

    def remove(self, seq: Sequence) -> list[int]:
        """Take `seq` out wherever it is; returns the pages that became free (its slot is free again too)."""
        freed: list[int] = []
        if seq.status is Status.RUNNING:
            self.running.remove(seq)
            freed = self.blocks.free(seq.slot, seq.pages)
            seq.slot, seq.pages = None, []
        elif seq.status is Status.WAITING:
            queue = self.waiting_bg if seq.background else self.waiting
            if seq in queue:  # (a sequence never added has nothing to give back)
                queue.remove(seq)
        seq.status = Status.FINISHED
        return freed

    @property
    def num_waiting(self) -> int:
        return len(self.waiting) + len(self.waiting_bg)

    def has_work(self) -> bool:
        return bool(self.running or self.waiting or self.waiting_bg)

    # ------------------------------------------------------------------ admission
    def _memory_ok(self) -> bool:
        free = self.free_bytes() if self.config.mem_floor_bytes else None
        return free is None or free >= self.config.mem_floor_bytes

    def _unit(self, queue: deque) -> list[Sequence]:
        """The head of `queue` and the siblings admitted with it (a group's waiting members sit together)."""
        seq = queue[0]
        if seq.group is None:
            return [seq]
        unit = [m for m in seq.group.members if m.status is Status.WAITING]
        if list(queue)[:len(unit)] != unit:
            raise RuntimeError("a group's waiting members are not together at the head of the queue")
        return unit

    def _resumable(self, unit: list[Sequence]):
        """The session entry `unit` resumes from (None: it prefills from the start): a RAM entry or a parked one
        for a lone request, a RAM entry for a group (its leader resumes, then the siblings fork as usual)."""
        seq = unit[0]
        if self.sessions is None or seq.prompt_logprobs is not None or seq.replay_start:
            return None
        hit = self.sessions.find(seq.prompt)
        if len(unit) > 1:
            return hit
        return self.sessions.find_disk(seq.prompt, hit.length if hit is not None else 0) or hit

    def _room(self, unit: list[Sequence], hit) -> bool:
        """A slot per sequence and the pages the unit needs beyond those of the entry it resumes from."""
        resumed = self.sessions.shared_pages(hit) if self.sessions is not None else 0
        shared = unit[0].group.shared_pages(self.blocks.page_tokens) if len(unit) > 1 else 0
        need = self.blocks.group_pages(unit[0].reserve_tokens, len(unit), shared) - resumed
        return len(self.blocks.free_slots) >= len(unit) and need <= self.blocks.num_free_pages

    def _fits(self, unit: list[Sequence]) -> bool:
        """Room for `unit` now; session entries (not the one it resumes from) give their pages back to a live
        request that needs them, coldest first, and at last that one too."""
        if len(self.blocks.free_slots) < len(unit):  # entries hold no slot: no lookup (a prompt's pages hashed)
            return False  # while the head of the queue waits for one
        hit = self._resumable(unit)
        self._hit = hit
        while True:
            room = self._room(unit, hit)
            if room or self.sessions is None:
                return room and self._memory_ok()
            if not self.sessions.evict(keep=hit):
                if hit is None:
                    return False
                hit = self._hit = None  # even the entry it would resume from yields: it prefills from the start

    def _start(self, unit: list[Sequence]) -> None:
        hit, self._hit = self._hit, None
        seq, group = unit[0], unit[0].group
        if self.sessions is not None and seq.prompt_logprobs is None and not seq.replay_start:
            self.sessions.looked_up(seq.prompt_len)
        if isinstance(hit, DiskHit):
            seq.slot, seq.pages = self.blocks.allocate(seq.reserve_tokens)
            self.sessions.load(seq, hit)
            seq.status = Status.RUNNING
            self.running.append(seq)
            return
        shared = group.shared_pages(self.blocks.page_tokens) if len(unit) > 1 else 0
        resumed = hit.pages[:self.sessions.shared_pages(hit)] if hit is not None else []
        for member, (slot, pages) in zip(unit, self.blocks.allocate_group(seq.reserve_tokens, len(unit), shared,
                                                                          first=resumed)):
            member.slot, member.pages = slot, pages
            member.status = Status.RUNNING
            self.running.append(member)
        if hit is not None:  # the leader starts at the entry's length (its slot restored before the next forward)
            seq.num_computed = hit.length
            for member in unit:
                member.cached = hit.length
            self.sessions.resume(hit, seq.slot, seq.pages)
        if len(unit) > 1 and group.fork_at > 0:  # the leader prefills the shared part, then the others fork
            seq.hold_at = group.fork_at
            for member in unit[1:]:
                member.awaiting_fork = True

    def admit(self) -> list[Sequence]:
        """Admit from the head of the queues while everything fits (a group: all its waiting members at once);
        returns the requests given up on."""
        given_up = []
        for queue in (self.waiting, self.waiting_bg):
            while queue:
                unit = self._unit(queue)
                if self._fits(unit):
                    for _ in unit:
                        queue.popleft()
                    self._start(unit)
                    self.starved_since = None
                    continue
                if not self.running:  # it cannot fit even alone (memory floor): wait a bounded time
                    now = self.clock()
                    self.starved_since = self.starved_since or now
                    if now - unit[0].arrival > self.config.admit_timeout_s:
                        for seq in unit:
                            queue.popleft()
                            seq.status = Status.FINISHED
                            given_up.append(seq)
                        continue
                return given_up  # FIFO: nobody overtakes the head
        return given_up

    # ------------------------------------------------------------------ one step
    def _prefill_allowed(self, decoding: bool) -> bool:
        return not decoding or self._prefill_s <= self.config.prefill_share * self._total_s

    def _prefill_budget(self, decoding: bool) -> int:
        if not self._prefill_allowed(decoding):
            return 0
        if decoding:
            return self.config.prefill_chunk
        return max(self.config.prefill_chunk, self.config.prefill_chunk_alone)

    def schedule(self) -> list[tuple[Sequence, int]]:
        """(sequence, tokens to absorb) for the next step: every decode row, then prefill chunks."""
        work = [(s, s.pending) for s in self.running if not s.prefilling and s.pending > 0]
        budget = self._prefill_budget(bool(work))
        for seq in self.running:
            if budget <= 0:
                break
            if seq.prefilling and not seq.awaiting_fork and not seq.loading:
                end = seq.prompt_len if seq.hold_at is None else seq.hold_at  # a leader stops where its group forks
                if seq.mark_at is not None and seq.num_computed < seq.mark_at:
                    end = min(end, seq.mark_at)  # and every prompt where its session entry is taken
                n = min(end - seq.num_computed, budget)
                if seq.hold_at is None and n == seq.prompt_len - seq.num_computed:
                    n = seq.pending  # the prompt's last chunk takes any forced text after it along
                work.append((seq, n))
                budget -= n
        return work

    def observe(self, prefill_rows: int, decode_rows: int, seconds: float) -> None:
        """Account one executed step (for the prefill share): time-weighted, older time fading with e^-t/window."""
        fade = math.exp(-seconds / self.config.share_window_s)
        self._prefill_s *= fade
        self._total_s *= fade
        self._total_s += seconds
        if prefill_rows == 0:
            previous = self._decode_step_s
            self._decode_step_s = seconds if previous is None else 0.8 * previous + 0.2 * seconds
        elif decode_rows:
            self._prefill_s += max(0.0, seconds - (self._decode_step_s or 0.0))
