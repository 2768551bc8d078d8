"""A persistent step's executor (issue 37 item 1): one launch of long-lived programs that take work items from a
shared queue in `persistent_plan` order, wait on device flags for the items they read, run the item, and release
its flags. The mechanism proven on a toy op set (a GEMV column block, an elementwise SwiGLU-style product, an
add) against the same items launched an op each; the step's real ops join as item kinds once they run here.

Bits. An item is the body of the op's own kernel program for that tile (the `_item_*` functions below are the ONE
implementation both paths call), so the persistent step and the launch-an-op chain compute every output with the
same operations in the same order: bitwise equal, whatever program runs which item and when (tests).

Ordering. A producer's program stores its outputs, meets a block barrier (every thread's stores issued), then one
atomic add with release semantics at GPU scope to each of its flags. A consumer polls the flag with volatile loads
(no stale L1 copy), then an atomic add of 0 with acquire semantics, a block barrier, and reads the inputs with
`.cg` loads (L2: the producer ran on another SM, whose writes this SM's L1 never saw). Weights are read-only and
loaded as usual (a real kernel prefetches them before the wait: they depend on no flag).

No reset between steps: the queue and the flags are int64 counters that only grow. Step e (1, 2, ...) takes queue
tickets from base = (e - 1) x (items + programs) (every program takes one ticket past the last item to learn it is
done), and waits for count x e on a flag (the plan's per-step count). e lives on the device (`state`): the program
that takes the step's very last ticket (every program has read e by then) stores e + 1, so a CUDA graph of the
launch replays step after step with no host argument changing. Deadlock-free while every program is resident
(the queue is a topological order: persistent_plan), which `programs` <= the SMs x blocks an SM keeps; a wait that
outlives `limit` (global-timer nanoseconds on a GPU, polls in the interpreter) records the item in `status` and goes
on, so a broken table fails the step on the host (`PersistentStep.check`) instead of hanging the GPU.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from dsv41.kernels.step import persistent_plan as pp
from dsv41.kernels.step.engram_gate import limit_of

GEMV, SWIGLU, ADD = 0, 1, 2  # item kinds
OP_FIELDS = 7  # kind, a, b, w, out (arena offsets), k, n
BLOCK_N = 16  # an item's output columns (a GEMV tile's column block; an elementwise tile's elements)
BLOCK_K = 16
STATUS = 8  # the first items whose wait timed out, recorded in order


@triton.jit
def _item_gemv(arena, a, w, out, k, n, tile, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    cols = tile * BLOCK_N + tl.arange(0, BLOCK_N)
    acc = tl.zeros([BLOCK_N], dtype=tl.float32)
    for k0 in range(0, k, BLOCK_K):
        kk = k0 + tl.arange(0, BLOCK_K)
        x = tl.load(arena + a + kk, cache_modifier=".cg")
        wt = tl.load(arena + w + kk[:, None] * n + cols[None, :])
        acc += tl.sum(x[:, None] * wt, axis=0)
    tl.store(arena + out + cols, acc)


@triton.jit
def _item_elementwise(arena, kind, a, b, out, tile, BLOCK_N: tl.constexpr):
    j = tile * BLOCK_N + tl.arange(0, BLOCK_N)
    x = tl.load(arena + a + j, cache_modifier=".cg")
    y = tl.load(arena + b + j, cache_modifier=".cg")
    if kind == 1:  # SWIGLU: silu(x) * y
        v = x / (1.0 + tl.exp(-x)) * y
    else:  # ADD
        v = x + y
    tl.store(arena + out + j, v)


@triton.jit
def _run_item(arena, ops_ptr, op, tile, OPF: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    f = ops_ptr + op * OPF
    kind = tl.load(f)
    if kind == 0:
        _item_gemv(arena, tl.load(f + 1), tl.load(f + 3), tl.load(f + 4), tl.load(f + 5), tl.load(f + 6), tile,
                   BLOCK_N, BLOCK_K)
    else:
        _item_elementwise(arena, kind, tl.load(f + 1), tl.load(f + 2), tl.load(f + 4), tile, BLOCK_N)


@triton.jit
def _op_kernel(arena, ops_ptr, op, OPF: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """One op as its own launch: program i runs item i."""
    _run_item(arena, ops_ptr, op, tl.program_id(0), OPF, BLOCK_N, BLOCK_K)


@triton.jit
def _persistent_kernel(arena, ops_ptr, table_ptr, n_items, queue_ptr, flags_ptr, epoch_ptr, status_ptr, limit,
                       ROW: tl.constexpr, MAXW: tl.constexpr, OPF: tl.constexpr, NSTATUS: tl.constexpr,
                       BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, TIMER: tl.constexpr):
    epoch = tl.load(epoch_ptr)
    tickets = n_items + tl.num_programs(0)  # a step's: every item's and every program's last
    base = (epoch - 1) * tickets
    q = tl.atomic_add(queue_ptr, 1, sem="relaxed", scope="gpu") - base
    while q < n_items:
        row = table_ptr + q * ROW
        op = tl.load(row)
        tile = tl.load(row + 1)
        f0 = tl.load(row + 2)
        f1 = tl.load(row + 3)
        nw = tl.load(row + 4)
        for w in tl.static_range(MAXW):
            if w < nw:
                flag = flags_ptr + tl.load(row + 5 + 2 * w)
                want = tl.load(row + 6 + 2 * w) * epoch
                seen = tl.load(flag, volatile=True)
                if TIMER:
                    start = tl.extra.cuda.globaltimer()
                    now = start
                    while (seen < want) & (now - start < limit):
                        seen = tl.load(flag, volatile=True)
                        now = tl.extra.cuda.globaltimer()
                else:
                    polls = 0
                    while (seen < want) & (polls < limit):
                        seen = tl.load(flag, volatile=True)
                        polls += 1
                seen = tl.atomic_add(flag, 0, sem="acquire", scope="gpu")
                if seen < want:  # timed out: record the item, go on (the host fails the step)
                    slot = tl.atomic_add(status_ptr, 1, sem="relaxed", scope="gpu")
                    if slot < NSTATUS:
                        tl.store(status_ptr + 1 + slot, base + q)
        tl.debug_barrier()
        _run_item(arena, ops_ptr, op, tile, OPF, BLOCK_N, BLOCK_K)
        tl.debug_barrier()  # every thread's stores issued before the release
        tl.atomic_add(flags_ptr + f0, 1, sem="release", scope="gpu")
        if f1 >= 0:
            tl.atomic_add(flags_ptr + f1, 1, sem="release", scope="gpu")
        q = tl.atomic_add(queue_ptr, 1, sem="relaxed", scope="gpu") - base
    if q == tickets - 1:  # the step's last ticket: every program has read this epoch; the next launch runs e + 1
        tl.store(epoch_ptr, epoch + 1)


@dataclass(frozen=True)
class Step:
    """One op of a toy step over a fp32 arena: `kind` (GEMV: out[n] = a[k] @ w[k, n]; SWIGLU: silu(a) * b; ADD:
    a + b; elementwise ops have k = 0), arena offsets, and the names of the ops whose outputs it reads."""

    name: str
    kind: int
    a: int
    out: int
    n: int
    b: int = 0
    w: int = 0
    k: int = 0
    reads: tuple[str, ...] = ()


class PersistentStep:
    """The toy step's tables on `arena`'s device, run either way: `run()` (one persistent launch of `programs`
    programs, the flags and queue counting on) or `run_launches()` (a launch an op, in order)."""

    def __init__(self, steps: list[Step], arena: torch.Tensor, programs: int, wait_s: float = 1.0):
        if arena.dtype != torch.float32 or arena.dim() != 1:
            raise ValueError("the arena is a 1-D fp32 tensor")
        for s in steps:
            if s.n % BLOCK_N or s.k % BLOCK_K:
                raise ValueError(f"op {s.name}: n = {s.n}, k = {s.k} must be multiples of {BLOCK_N} / {BLOCK_K}")
        self.steps, self.arena, self.programs = steps, arena, programs
        self.plan = pp.build([pp.Op(s.name, s.n // BLOCK_N, 1.0, tuple(pp.Need(r) for r in s.reads))
                              for s in steps])
        dev = arena.device
        self.table = torch.tensor(pp.encode(self.plan), dtype=torch.int64, device=dev).contiguous()
        self.ops = torch.tensor([[s.kind, s.a, s.b, s.w, s.out, s.k, s.n] for s in steps], dtype=torch.int64,
                                device=dev).contiguous()
        self.flags = torch.zeros(len(self.plan.flag_targets), dtype=torch.int64, device=dev)
        self.queue = torch.zeros(1, dtype=torch.int64, device=dev)
        self.status = torch.zeros(1 + STATUS, dtype=torch.int64, device=dev)
        self.state = torch.ones(1, dtype=torch.int64, device=dev)  # the next step's number (the kernel counts it)
        self.limit, self.timer = limit_of(wait_s, dev)  # the Engram gate's deadline: timer ns, or polls

    def run(self) -> None:
        """One step: one launch, no host-side state (capturable: replays run the next steps)."""
        _persistent_kernel[(self.programs,)](
            self.arena, self.ops, self.table, len(self.plan.items), self.queue, self.flags, self.state,
            self.status, self.limit, ROW=self.table.shape[1],
            MAXW=pp.MAX_WAITS, OPF=OP_FIELDS, NSTATUS=STATUS, BLOCK_N=BLOCK_N, BLOCK_K=BLOCK_K, TIMER=self.timer)

    def run_launches(self) -> None:
        for i, s in enumerate(self.steps):
            _op_kernel[(s.n // BLOCK_N,)](self.arena, self.ops, i, OPF=OP_FIELDS, BLOCK_N=BLOCK_N, BLOCK_K=BLOCK_K)

    def check(self) -> None:
        """Raises if a wait of the steps run so far timed out (reads the status back: the host's check)."""
        late = int(self.status[0])
        if late:
            items = [int(v) for v in self.status[1:1 + min(late, STATUS)]]
            raise RuntimeError(f"persistent step: {late} flag waits timed out (queue tickets {items})")
