"""A launched step's sample and the hand-over of its tokens to the step behind it (the overlapped loop, ENGINE.md §6).

`ModelRunner.launch(batch)` enqueues a step's forward and its greedy picks and returns a `PendingStep` at once; the
engine plans and launches the next step meanwhile, then asks `PendingStep.result()` for the tokens.

- `StepSample`: the tokens the step chose. Greedy rows (no mask, no adjustments) are each row's argmax on the device
  (`kernels.step.argmax.greedy_ids`: `sample_token`'s greedy choice), enqueued behind the forward, followed by an
  event. Everything that reads a value on the host (the other rows' keyed draws, logprobs, the ids themselves)
  runs on a side stream that waits for that event only (`host_reads`), so it never waits for the step launched
  behind this one on the main stream. On the CPU there are no streams: the same code runs in order.
- `PendingStep.result()` also runs the step's check (the Engram gate's: runtime/engram_gate.py), after the sample;
  `verdict()` runs only the check (a follower rank's launched step at TP > 1, joined with rank 0's read).
- `Handoff`: a follow row's token id (`Row.follows`) is its sequence's token in the previous step's sample. Where
  the forward takes it itself (`FastForward.takes_handoff`: every follow row in place) it plans the step's tables
  first, then gathers the ids on the device (`device_ids`: they never leave it) or, where Engram rows are hashed
  from them and no Engram gate runs, reads them on the host just before the hash (`host_ids`; with the gate the
  host reads them after the step's launch, for the hash alone); elsewhere `resolved` puts the host's ids into the
  rows before the forward (the pool forward, load-and-store rows).
"""

from __future__ import annotations

import contextlib
import dataclasses

import torch

from ..engine.batch import Row, StepOutput


def to_device(values: list[int], device: torch.device) -> torch.Tensor:
    """int64 ids on `device` without waiting for the stream (a pinned buffer, an asynchronous copy)."""
    t = torch.tensor(values, dtype=torch.int64)
    return t.pin_memory().to(device, non_blocking=True) if device.type == "cuda" else t.to(device)


class StepSample:
    def __init__(self, rows: list[Row], logits: list, device: torch.device, choose, side=None):
        """`choose(raw, sampling, greedy)` -> (token, error): the runner's keyed choice of one row; `side`: the
        runner's side stream (CUDA)."""
        self.rows, self.logits, self.device, self._choose = rows, logits, device, choose
        self.index = {r.seq_id: i for i, r in enumerate(rows) if r.sample is not None and not r.n_draft}
        self._at = {i: rows[i].logit_offsets().index(rows[i].first_choice) for i in self.index.values()}
        self.picks = [i for i, r in enumerate(rows) if self._greedy(r)]
        self.greedy = None
        if self.picks:
            from ..kernels.step.argmax import greedy_ids

            self.greedy = greedy_ids(torch.stack([self.last(i) for i in self.picks]))
        self.event, self.side = None, side
        if side is not None:
            self.event = torch.cuda.Event()
            self.event.record()
        self._choices: list | None = None

    @staticmethod
    def _greedy(row: Row) -> bool:
        s = row.sample
        return s is not None and not row.n_draft and s.adjust is None and s.mask is None and s.params().greedy

    def last(self, i: int) -> torch.Tensor:
        """Row i's logits at its sampled row."""
        return self.logits[i][self._at[i]]

    @contextlib.contextmanager
    def host_reads(self):
        """A context whose device work waits for this step's sample only (the side stream after its event)."""
        if self.side is None:
            yield
            return
        self.side.wait_event(self.event)
        with torch.cuda.stream(self.side):
            yield

    def choices(self) -> list[tuple[int | None, str | None] | None]:
        """Per row: (token, error) of its keyed choice, None for a row that does not sample (read once)."""
        if self._choices is None:
            with self.host_reads():
                greedy = dict(zip(self.picks, self.greedy.tolist())) if self.picks else {}
                self._choices = [self._choose(self.last(i), r.sample, greedy.get(i))
                                 if r.sample is not None and not r.n_draft else None
                                 for i, r in enumerate(self.rows)]
        return self._choices

    def token_of(self, seq_id: int) -> int:
        token, error = self.choices()[self.index[seq_id]]
        if token is None:
            raise RuntimeError(f"sequence {seq_id}: its step chose no token ({error}), yet a row follows it")
        return token

    def device_ids(self) -> torch.Tensor:
        """Every row's chosen id as int64 [rows] on the device (rows that do not sample: 0), without a host wait
        when every sampling row is a greedy pick (else the host's choices, copied up)."""
        if self.picks and len(self.picks) == len(self.index):
            if self.picks == list(range(len(self.rows))):
                return self.greedy
            ids = torch.zeros(len(self.rows), dtype=torch.int64, device=self.device)
            return ids.index_copy_(0, to_device(self.picks, self.device), self.greedy)
        return to_device([c[0] if c is not None and c[0] is not None else 0 for c in self.choices()], self.device)


@dataclasses.dataclass
class Handoff:
    """The follow rows of a step (row index -> the row index of its sequence in `sample`, the step before)."""

    sample: StepSample
    source: dict[int, int]

    @classmethod
    def of(cls, rows: list[Row], sample: StepSample | None) -> "Handoff | None":
        follows = [i for i, r in enumerate(rows) if r.follows]
        if not follows:
            return None
        if sample is None:
            raise RuntimeError("a follow row, yet no step was launched before it")
        missing = [rows[i].seq_id for i in follows if rows[i].seq_id not in sample.index]
        if missing:
            raise RuntimeError(f"follow rows of sequences {missing} that the step before did not sample")
        return cls(sample, {i: sample.index[rows[i].seq_id] for i in follows})

    def resolved(self, rows: list[Row]) -> list[Row]:
        """The rows with the host's ids in place of the follow rows' (waits for the previous step's sample)."""
        return [dataclasses.replace(r, token_ids=[self.sample.token_of(r.seq_id)], follows=False)
                if i in self.source else r for i, r in enumerate(rows)]

    def device_ids(self) -> torch.Tensor:
        """The previous step's ids on the device; row i's is at `source[i]`."""
        return self.sample.device_ids()

    def host_ids(self) -> list[int]:
        """The previous step's ids on the host (waits for its sample only); 0 for a row that chose none."""
        return [c[0] if c is not None and c[0] is not None else 0 for c in self.sample.choices()]


class PendingStep:
    """A launched step; `result()` waits for its sample (and only for it) and builds the StepOutput."""

    def __init__(self, step: int, sample: StepSample | None, loads: list, build, check=None):
        """`build(row, logits, choice=)` -> RowOutput (the runner's `_row`); `check()`: what must hold once the
        sample is in (the Engram gate's `check` of the step's gated buckets: raises where one ran without its
        rows)."""
        self.step, self.sample, self.loads, self._build, self._check = step, sample, loads, build, check
        self._out: StepOutput | None = None

    def result(self) -> StepOutput:
        if self._out is None:
            s = self.sample
            if s is None:
                self._out = StepOutput(self.step, loads=self.loads)
            else:
                choices = s.choices()
                with s.host_reads():
                    if self._check is not None:
                        self._check()
                    rows = [self._build(r, lg, choice=c) for r, lg, c in zip(s.rows, s.logits, choices)]
                self._out = StepOutput(self.step, rows, loads=self.loads)
        return self._out

    def verdict(self) -> str:
        """"" or why the step's check failed, without building its rows (waits for its sample only): a follower
        rank's launched step at TP > 1, whose verdict rank 0 joins with its own read (parallel/executor.py)."""
        if self._check is None or self.sample is None:
            return ""
        try:
            with self.sample.host_reads():
                self._check()
        except Exception as exc:  # noqa: BLE001 - handed to rank 0, which fails the step with it
            return f"{type(exc).__name__}: {exc}"
        return ""
