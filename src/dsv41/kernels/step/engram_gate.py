"""The Engram gate's kernel (docs/ENGINE.md §6 "The overlapped loop", RECIPE.md §2.9): inside the decode step's
graph, before the first Engram layer, wait on the device until the host has published the step's Engram rows, then
copy them into the step's tables.

The host (runtime/engram_gate.py) publishes step s by two copies on its own copy stream: the rows' words into
`rows[s % 2]`, then the number s into `word` (stream order: the rows are in device memory before the word changes).
Here each program:

- reads its step's number from the step's tables (so a replayed graph waits for the step it runs, not the one it
  was captured for) and polls `word` with volatile loads (no cached copy: each poll reads memory) until
  `word >= step` (the host publishes in step order, so the word only grows; the pair's parity and the host's wait
  for step s - 2's launch keep `rows[s % 2]` step s's until step s has read it);
- then an acquire load of `word` (an atomic add of 0, `sem="acquire"`): the rows' loads below are ordered after it,
  so they see what the copy before the word wrote; the rows are read with volatile loads too (nothing stale in L1);
- gives up at the deadline (`limit`: nanoseconds of the device's global timer, `DSV41_ENGRAM_WAIT_S`; in Triton's
  interpreter, which has no timer, that many polls): it records the step in `status[step % STATUS_RING]` and goes
  on with whatever the buffer holds, so a lost host never hangs the GPU; the host's check of the step
  (`EngramGate.check`) turns that into an error and the step's requests fail;
- copies its share of the W words from `rows[step % 2]` to `tables[dst_at:dst_at + W]`, where the one copy of the
  tables would have put them, so the graph decodes them exactly as without the gate (the same bytes: the same bits).

No arithmetic, no host sync: one launch, capturable in a CUDA graph. Portable (sm_90 and sm_121: volatile loads,
an acquire atomic, `%globaltimer`); launched without PDL (it must not start before the layer before it is done, and
it signals nothing early). On unified memory (GB10) the copies are the same copy-engine transfers.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

STATUS_RING = 64  # the timed-out steps' record: step s at s % STATUS_RING (far more than the steps in flight)
BLOCK = 1024  # words a program copies per loop
MAX_PROGRAMS = 16


@triton.jit
def _gate_kernel(tab_ptr, step_at, word_ptr, rows_ptr, row_stride, dst_at, W, status_ptr, limit,
                 RING: tl.constexpr, BLOCK: tl.constexpr, TIMER: tl.constexpr):
    step = tl.load(tab_ptr + step_at)
    seen = tl.load(word_ptr, volatile=True)
    if TIMER:  # nanoseconds of the global timer
        start = tl.extra.cuda.globaltimer()
        now = start
        while (seen < step) & (now - start < limit):
            seen = tl.load(word_ptr, volatile=True)
            now = tl.extra.cuda.globaltimer()
    else:  # the interpreter: polls
        polls = 0
        while (seen < step) & (polls < limit):
            seen = tl.load(word_ptr, volatile=True)
            polls += 1
    seen = tl.atomic_add(word_ptr, 0, sem="acquire", scope="gpu")
    if seen < step:  # the deadline: the step goes on with stale rows and the host fails it
        tl.store(status_ptr + step % RING, step)
    src = rows_ptr + (step % 2) * row_stride
    for off in range(tl.program_id(0) * BLOCK, W, tl.num_programs(0) * BLOCK):
        j = off + tl.arange(0, BLOCK)
        ok = j < W
        tl.store(tab_ptr + dst_at + j, tl.load(src + j, mask=ok, volatile=True), mask=ok)


def interpreted() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def limit_of(wait_s: float, device: torch.device) -> tuple[int, bool]:
    """(limit, TIMER): the deadline in the global timer's nanoseconds on a GPU; in the interpreter a count of
    polls (about a millisecond each there)."""
    timer = torch.device(device).type == "cuda" and not interpreted()
    return (int(wait_s * 1e9) if timer else max(1, int(wait_s * 1e3))), timer


def gate_rows(tables: torch.Tensor, step_at: int, word: torch.Tensor, rows: torch.Tensor, dst_at: int, W: int,
              status: torch.Tensor, wait_s: float) -> None:
    """Wait for the step whose number is `tables[step_at]` to be published (`word`), then copy its W words from
    `rows[step % 2]` into `tables[dst_at:dst_at + W]` (all int64, on one device); module docstring."""
    for name, t in (("tables", tables), ("word", word), ("rows", rows), ("status", status)):
        if t.dtype != torch.int64 or not t.is_contiguous() or t.device != tables.device:
            raise ValueError(f"the gate's {name} must be contiguous int64 on {tables.device}, got {t.dtype} "
                             f"on {t.device}")
    if rows.dim() != 2 or rows.shape[0] != 2 or W > rows.shape[1] or dst_at + W > tables.numel():
        raise ValueError(f"the gate copies {W} words from a pair {list(rows.shape)} to [{dst_at}, {dst_at + W}) "
                         f"of {tables.numel()}")
    if status.numel() != STATUS_RING:
        raise ValueError(f"the gate's status ring has {status.numel()} entries, expected {STATUS_RING}")
    limit, timer = limit_of(wait_s, tables.device)
    grid = (max(1, min(MAX_PROGRAMS, triton.cdiv(W, BLOCK))),)
    _gate_kernel[grid](tables, step_at, word, rows, rows.stride(0), dst_at, W, status, limit,
                       RING=STATUS_RING, BLOCK=BLOCK, TIMER=timer, num_warps=4)
