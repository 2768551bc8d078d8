"""The device-side Engram gate (docs/ENGINE.md §6 "The overlapped loop", RECIPE.md §2.9; issue 37 item 2).

Without it an Engram model's decode step cannot start before the host has its token ids: the rows are hashed from
them and read on the host, then travel in the step tables' one copy. With the gate (`DSV41_ENGRAM_GATE=1`, TP = 1,
CUDA) the step's graph is launched first, with its ids gathered on the device from the step before's sample, and
runs its embedding and the layers before the first Engram layer; there the gate kernel (kernels/step/engram_gate.py)
waits on the device for the rows. Meanwhile the host waits for the step before's sample, reads the ids, hashes,
reads the rows and publishes them (`EngramGate.feed`). Only a step whose graph replays does that (the gate's
`deferred` case); a step that is captured, runs eagerly or is the gate's first publishes before its launch (the
gate then passes at once), so nothing on the host ever waits behind the gate.

What one `EngramGate` (one per model) holds:
- a step number per gated step (`number`), carried in the step's tables (`GATE_STEP`), so a replayed graph waits for
  the step it runs;
- a pinned host pair `stage[2, capacity + 1]` and a device pair `rows[2, capacity]` (int64 words, the rows exactly
  as the tables carry them: `step_tables.byte_words`), alternating by step parity, and the device `word` holding the
  last published number;
- publishing step s (`publish`): wait for the copy that last read `stage[s % 2]` (step s - 2's, an event), write
  the words and s there, then on the gate's copy stream: wait for step s - 2's launch to be done with
  `rows[s % 2]` (an event recorded after that launch), copy the words up, then copy s into `word`. Stream order makes
  the rows land before the word; the kernel's acquire load of the word orders its reads of the rows after it;
- `status[STATUS_RING]`: the kernel records a step whose deadline (`DSV41_ENGRAM_WAIT_S`, default 300 s) passed
  unpublished; `check(steps)` (the runner, once a step's sample is in) raises `GateTimeout` for it, and for a step
  the host abandoned (`feed` failed: the word is published anyway so the device goes on, and the step fails).

The gate adds no arithmetic: the rows land where the tables' copy would have put them, and the graph decodes them
in the same ops, so tokens and logprobs are the same bits with the gate as without.
"""

from __future__ import annotations

import os

import numpy as np
import torch

from ..kernels.step.engram_gate import STATUS_RING, gate_rows
from .step_tables import byte_words

ENV_GATE = "DSV41_ENGRAM_GATE"
ENV_WAIT = "DSV41_ENGRAM_WAIT_S"
DEFAULT_WAIT_S = 300.0  # RECIPE.md §2.9's TF_DSV41_ENGRAM_WAIT_S
GATE_STEP = "gate.step"  # the step's number in its tables


def _gate_value(environ=None) -> str:
    return (os.environ if environ is None else environ).get(ENV_GATE, "").strip().lower()


def env_gate(environ=None) -> bool:
    """`DSV41_ENGRAM_GATE`: on unless 0 (where it can run: `for_model`; on by default since its GPU A/B:
    bench/results/decode_step_4ac1be8.json)."""
    return _gate_value(environ) not in ("0", "off", "false", "no")


def env_wait_s(environ=None) -> float:
    """`DSV41_ENGRAM_WAIT_S`: seconds the device waits at the gate for a step's rows before it gives up (300)."""
    value = (os.environ if environ is None else environ).get(ENV_WAIT, "").strip()
    wait = float(value) if value else DEFAULT_WAIT_S
    if not wait > 0:
        raise ValueError(f"{ENV_WAIT} must be a number of seconds > 0, got {value!r}")
    return wait


def for_model(model, max_rows: int, environ=None) -> "EngramGate | None":
    """The gate a built FastModel gets (`max_rows`: its most rows a step): on where asked for, the model has Engram
    layers and its device is CUDA. At TP > 1 (each rank gates its own rows; a follower's check reaches rank 0
    through parallel/executor.py's verdicts) only where `DSV41_ENGRAM_GATE` asks for it explicitly (1/on): that
    path has no GPU run yet."""
    if not env_gate(environ) or not model.engram or model.engram_hasher is None:
        return None
    if model.device.type != "cuda":
        return None
    if getattr(model.comm, "world", 1) != 1 and _gate_value(environ) not in ("1", "on", "true", "yes"):
        return None
    return EngramGate(model.device, env_wait_s(environ), max_rows=max_rows)


class GateTimeout(RuntimeError):
    """A gated step ran without its Engram rows (the deadline passed, or the host abandoned it)."""


class EngramGate:
    def __init__(self, device, wait_s: float = DEFAULT_WAIT_S, *, max_rows: int):
        """`max_rows`: the most rows of a gated step (the buffers are sized for them at the first read)."""
        self.device, self.max_rows = torch.device(device), int(max_rows)
        if not wait_s > 0:
            raise ValueError(f"the gate's deadline must be > 0 s, got {wait_s}")
        self.wait_s = float(wait_s)
        self.cuda = self.device.type == "cuda"
        self.last = 0  # the last step number given (the word starts at 0: step 1 is the first)
        self.formats: dict | None = None  # layer -> (kind, head_dim, stored shape past the rows): from the first read
        self.capacity = 0
        self.word = torch.zeros(1, dtype=torch.int64, device=self.device)
        self.status = torch.zeros(STATUS_RING, dtype=torch.int64, device=self.device)
        self.rows = self.stage = None
        self.stream = torch.cuda.Stream(self.device) if self.cuda else None
        self._copied: list = [None, None]  # per parity: the event after the last copy out of its stage
        self._launched: dict[int, object] = {}  # step -> the event after its launch (its rows read by then)
        self._abandoned: set[int] = set()
        self._steps: list[int] = []  # launched since the runner last took them (`take_steps`)
        self.published = 0
        self.fed = {"before": 0, "after": 0}  # steps published before their launch / after it (forward_pool)

    # ------------------------------------------------------------------ numbering, layout
    def number(self) -> int:
        """The next gated step's number (1, 2, ...)."""
        self.last += 1
        return self.last

    @property
    def ready(self) -> bool:
        """Whether the rows' shapes are known (after the first step's read): a step may then launch before them."""
        return self.formats is not None

    def learn(self, stored: dict) -> None:
        """The rows' formats from a step's read (`pool_step.engram_stored`: layer -> RowBytes), and the buffers
        sized for `max_rows` rows (every bucket the gate will see); they never move after (graphs hold them)."""
        formats = {L: (r.kind, r.head_dim, tuple(r.data.shape[1:])) for L, r in stored.items()}
        if self.formats is None:
            self.formats = formats
            self.capacity = self.words(self.max_rows)
            self.rows = torch.zeros(2, self.capacity, dtype=torch.int64, device=self.device)
            self.stage = torch.zeros(2, self.capacity + 1, dtype=torch.int64, pin_memory=self.cuda)
        elif formats != self.formats:
            raise RuntimeError(f"Engram rows of formats {formats}, the gate was sized for {self.formats}")

    def words(self, B: int) -> int:
        """int64 words of a B-row bucket's rows, every Engram layer's in order."""
        return sum(B * int(np.prod(shape[:-1])) * (-(-shape[-1] // 8)) for _, _, shape in self.formats.values())

    def placeholders(self, B: int) -> dict:
        """The tables' inputs that reserve the rows' place (zeros until the gate copies them in), in layer order."""
        return {f"engram.{L}": np.zeros((B, *shape), dtype=np.uint8) for L, (_, _, shape) in self.formats.items()}

    def region(self, tables) -> tuple[int, int]:
        """(first word, words) of the rows in `tables`: the Engram inputs, one after another."""
        spans = [tables.layout[f"engram.{L}"] for L in self.formats]
        at = spans[0][0]
        end = at
        for start, shape in spans:
            if start != end:
                raise RuntimeError("the Engram rows are not one span of the step tables")
            end += int(np.prod(shape))
        return at, end - at

    # ------------------------------------------------------------------ the host's part
    def feed(self, step: int, read, B: int) -> None:
        """Publish step `step`'s rows (a B-row bucket), `read()` -> layer -> RowBytes (hash and read: may wait for
        the step before's sample). If it fails the device is released anyway (the word published, the step
        abandoned: `check` raises for it) and the error goes on."""
        try:
            stored = read()
            self.learn(stored)
            words = np.concatenate([byte_words(np.ascontiguousarray(stored[L].data)).reshape(-1)
                                    for L in self.formats])
            if words.size != self.words(B):
                raise RuntimeError(f"Engram gate: {words.size} words of rows for a {B}-row step of "
                                   f"{self.words(B)}")
        except BaseException:
            self.abandon(step)
            raise
        self.publish(step, words)

    def abandon(self, step: int) -> None:
        """Release the device at step `step`'s gate without its rows (the host cannot give them): `check` raises."""
        self._abandoned.add(step)
        self.publish(step, None)

    def publish(self, step: int, words: np.ndarray | None) -> None:
        """Step `step`'s words into `rows[step % 2]`, then `step` into the word (module docstring); `None`: the word
        only (an abandoned step)."""
        if step <= self.published:
            raise RuntimeError(f"Engram gate: step {step} published after step {self.published}")
        p, W = step % 2, 0 if words is None else words.size
        if W > self.capacity:
            raise RuntimeError(f"Engram gate: {W} words of rows, the buffers hold {self.capacity}")
        if self._copied[p] is not None:
            self._copied[p].synchronize()  # step - 2's copies have read this stage (at once, as a rule)
        stage = self.stage[p] if self.stage is not None else torch.zeros(1, dtype=torch.int64)
        if W:
            stage[:W].numpy()[:] = words
        stage[-1] = step
        done = self._launched.pop(step - 2, None)
        if not self.cuda:
            if W:
                self.rows[p, :W].copy_(stage[:W])
            self.word.copy_(stage[-1:])
        else:
            with torch.cuda.stream(self.stream):
                if done is not None:
                    self.stream.wait_event(done)  # step - 2's gate has copied rows[p] out
                if W:
                    self.rows[p, :W].copy_(stage[:W], non_blocking=True)
                self.word.copy_(stage[-1:], non_blocking=True)  # after the rows: the copy stream's order
                self._copied[p] = torch.cuda.Event()
                self._copied[p].record(self.stream)
        self.published = step

    def launched(self, step: int) -> None:
        """Step `step`'s graph is launched (on the current stream): its gate reads `rows[step % 2]` before
        anything launched after it runs, so step + 2's copy waits for this event."""
        if self.cuda:
            event = torch.cuda.Event()
            event.record()
            self._launched[step] = event
        self._steps.append(step)

    # ------------------------------------------------------------------ the device's part
    def wait(self, tables) -> None:
        """The gate inside the step (`tables`: its StepTables over the graph's buffer): wait for the step's number,
        then its rows into the tables' Engram span."""
        at, W = self.region(tables)
        gate_rows(tables.packed, tables.layout[GATE_STEP][0], self.word, self.rows, at, W, self.status,
                  self.wait_s)

    # ------------------------------------------------------------------ after the step
    def take_steps(self) -> list[int]:
        """The steps launched since the last call (the runner checks them with the launch's sample)."""
        steps, self._steps = self._steps, []
        return steps

    def check(self, steps: list[int]) -> None:
        """Raise `GateTimeout` for a step among `steps` that ran without its rows (read once its sample is in:
        the status was written before)."""
        if not steps:
            return
        bad = [s for s in steps if s in self._abandoned]
        if len(bad) < len(steps):
            status = self.status.tolist()
            bad += [s for s in steps if status[s % STATUS_RING] == s and s not in bad]
        self._abandoned.difference_update(steps)
        if bad:
            raise GateTimeout(f"Engram gate: step(s) {sorted(bad)} ran without their Engram rows (not published "
                              f"within {ENV_WAIT}={self.wait_s:g} s, or the host's read failed); their requests "
                              "fail")


class GatedRows(dict):
    """A gated step's Engram rows for `FastModel._layers`: the first look-up (the first Engram layer) launches the
    gate, then decodes every layer's rows from the tables, as the ungated step decodes them at its start."""

    def __init__(self, gate: EngramGate, tables, decode):
        super().__init__()
        self._gate, self._tables, self._decode = gate, tables, decode

    def __missing__(self, layer):
        if not super().__len__():
            self._gate.wait(self._tables)
            self.update(self._decode(self._tables))
        return super().__getitem__(layer)
