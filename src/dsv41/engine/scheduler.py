"""Which rows run each step: admission, decode, chunked prefill with a bounded share (docs/ENGINE.md §5).

- Admission, FIFO with two classes (foreground before background): a request needs a free ring slot, pages for
  prompt + max tokens, and free memory above the floor. It waits, never fails, for any of them; only a request
  that cannot be admitted even with nothing else live is given up on, after `admit_timeout_s`.
- Every running sequence with a token to absorb gets its decode row in every step.
- Prompts are prefilled in chunks, oldest first, at most `prefill_chunk` rows a step in all. While streams are
  decoding, prefill gets at most `prefill_share` of the engine's time (measured: the time of a step beyond a
  decode-only step's, over the last few seconds), so running streams keep flowing.
"""

from __future__ import annotations

import math
import time
from collections import deque
from dataclasses import dataclass
from typing import Callable

from .block_manager import BlockManager
from .request import Sequence, Status


@dataclass
class SchedulerConfig:
    prefill_chunk: int = 2048
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

    def admit(self) -> list[Sequence]:
        """Admit from the head of the queues while everything fits; returns the requests given up on."""
        given_up = []
        for queue in (self.waiting, self.waiting_bg):
            while queue:
                seq = queue[0]
                if self.blocks.can_allocate(seq.reserve_tokens) and self._memory_ok():
                    queue.popleft()
                    seq.slot, seq.pages = self.blocks.allocate(seq.reserve_tokens)
                    seq.status = Status.RUNNING
                    self.running.append(seq)
                    self.starved_since = None
                    continue
                if not self.running:  # it cannot fit even alone (memory floor): wait a bounded time
                    now = self.clock()
                    self.starved_since = self.starved_since or now
                    if now - seq.arrival > self.config.admit_timeout_s:
                        queue.popleft()
                        seq.status = Status.FINISHED
                        given_up.append(seq)
                        continue
                return given_up  # FIFO: nobody overtakes the head
        return given_up

    # ------------------------------------------------------------------ one step
    def _prefill_allowed(self, decoding: bool) -> bool:
        return not decoding or self._prefill_s <= self.config.prefill_share * self._total_s

    def schedule(self) -> list[tuple[Sequence, int]]:
        """(sequence, tokens to absorb) for the next step: every decode row, then prefill chunks."""
        work = [(s, s.pending) for s in self.running if not s.prefilling and s.pending > 0]
        budget = self.config.prefill_chunk if self._prefill_allowed(bool(work)) else 0
        for seq in self.running:
            if budget <= 0:
                break
            if seq.prefilling:
                n = min(seq.prompt_len - seq.num_computed, budget)
                if n == seq.prompt_len - seq.num_computed:
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
