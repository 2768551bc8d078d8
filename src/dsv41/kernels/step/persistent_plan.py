"""The persistent step's schedule (issue 37 item 1): work items, their order, the flags between them, and what the
schedule costs against one kernel launch an op. Plain Python (no torch): the plan is host-side policy that a
persistent kernel reads as an int32 table, and that the CPU tests check without a GPU.

The model. A step is a list of ops in program order (`Op`): each op is `tiles` work items of the same kind (a
column block of an EXL3 product, a split of the attention core, an mHC site's row block), and needs earlier ops'
results (`Need`). An op's items are counted into `groups` flags (one counter each, the items split into equal
consecutive groups): a need waits for ALL of the producer's groups, or for the ONE group that covers the consumer
tile's share (`per_group=True`: tile i of the consumer reads group i * groups // tiles: a split-K column block's
reduction waits for its own splits, not the whole product); an op of several groups also counts every item into
one flag of its whole, which an all-groups need waits on (one wait, not one a group). Items keep their kernels'
arithmetic (the same tile, the same reduction order), so the schedule changes when an item runs, never what it
computes: graph == eager == persistent stays bitwise by construction.

The queue. Items are numbered op by op in program order; every wait names a flag of an EARLIER op, so the queue
order is a topological order of the items. Workers (an SM's resident blocks) take items in queue order — from a
shared counter (`dynamic`) or from per-worker lists that are each in queue order (`static`) — and spin on a flag
until it reaches its count. Deadlock-free with every worker resident: the earliest unfinished item waits only on
earlier items, all of which were taken (queue order) and are running or done, so by induction everything finishes
(`check_lists` refuses per-worker lists out of queue order, where this fails). Flags count up across steps
(`epoch` x the group's size), so a replayed step needs no reset launch.

The costs (`simulate`, `kernel_chain`): an item's time on a worker (`Op.cost_us`), a flag's latency from the
producer's release to the consumer's acquire (`flag_us`, ~0.5-1 us through L2), and for the launch-per-op chain a
gap a kernel boundary (the grid's drain and the next launch's fill; with PDL the fill overlaps the tail). These are
inputs: bench/persistent_plan.py sets them from measured numbers and predicts the step both ways.
"""

from __future__ import annotations

import heapq
import math
from dataclasses import dataclass

MAX_WAITS = 4  # flags an item may wait on (the table's fixed width; `encode` refuses more)


@dataclass(frozen=True)
class Need:
    """A dependency on an earlier op: all of its groups, or the one group covering this tile's share."""

    op: str
    per_group: bool = False


@dataclass(frozen=True)
class Op:
    name: str
    tiles: int
    cost_us: float  # one item's time on one worker, its inputs ready
    needs: tuple[Need, ...] = ()
    groups: int = 1  # flags this op's items count into (tiles split into equal consecutive groups)

    def __post_init__(self):
        if self.tiles < 1 or self.groups < 1 or self.tiles % self.groups:
            raise ValueError(f"op {self.name}: {self.tiles} tiles do not split into {self.groups} equal groups")
        if not self.cost_us >= 0:
            raise ValueError(f"op {self.name}: cost {self.cost_us} us")

    @property
    def group_size(self) -> int:
        return self.tiles // self.groups


@dataclass(frozen=True)
class Item:
    index: int  # queue position
    op: int  # index into Plan.ops
    tile: int
    flags: tuple[int, ...]  # the flags this item's completion counts into: its group's (and its op's whole, if any)
    waits: tuple[tuple[int, int], ...]  # (flag, count it must reach this step)


@dataclass
class Plan:
    ops: list[Op]
    items: list[Item]
    flag_targets: list[int]  # a flag's count at the end of one step (its group's size, or the op's tiles)


def build(ops: list[Op]) -> Plan:
    """The items of `ops` in queue order with their flags and waits. Raises on a need of an unknown or later op
    (which would break the queue's topological order), a duplicate name, or more than MAX_WAITS flags an item."""
    index: dict[str, int] = {}
    first_flag: list[int] = []
    whole_flag: list[int] = []  # an op's flag of all its items (its only group's flag when groups == 1)
    targets: list[int] = []
    for i, op in enumerate(ops):
        if op.name in index:
            raise ValueError(f"op {op.name} appears twice")
        for need in op.needs:
            if need.op not in index:
                raise ValueError(f"op {op.name} needs {need.op}, which is not an earlier op")
        index[op.name] = i
        first_flag.append(len(targets))
        targets += [op.group_size] * op.groups
        if op.groups > 1:
            targets.append(op.tiles)
        whole_flag.append(len(targets) - 1)
    items: list[Item] = []
    for i, op in enumerate(ops):
        for t in range(op.tiles):
            waits: list[tuple[int, int]] = []
            for need in op.needs:
                p = index[need.op]
                producer = ops[p]
                if need.per_group:
                    waits.append((first_flag[p] + t * producer.groups // op.tiles, producer.group_size))
                else:
                    waits.append((whole_flag[p], producer.tiles))
            if len(waits) > MAX_WAITS:
                raise ValueError(f"op {op.name} tile {t} waits on {len(waits)} flags (at most {MAX_WAITS}): merge "
                                 f"its producers into fewer ops")
            group = first_flag[i] + t // op.group_size
            flags = (group,) if op.groups == 1 else (group, whole_flag[i])
            items.append(Item(len(items), i, t, flags, tuple(waits)))
    return Plan(list(ops), items, targets)


def encode(plan: Plan) -> list[list[int]]:
    """The table a persistent kernel reads, one row an item: [op, tile, group flag, whole flag (-1: none), n_waits,
    (flag, count) x MAX_WAITS] (unused waits -1, 0). The counts are a step's: the kernel waits for count x epoch
    (flags only ever count up, so step e's waits are met exactly when step e's producers are done)."""
    rows = []
    for it in plan.items:
        row = [it.op, it.tile, it.flags[0], it.flags[1] if len(it.flags) > 1 else -1, len(it.waits)]
        for w in range(MAX_WAITS):
            row += list(it.waits[w]) if w < len(it.waits) else [-1, 0]
        rows.append(row)
    return rows


def decode(rows: list[list[int]]) -> list[tuple[int, int, tuple[int, ...], tuple[tuple[int, int], ...]]]:
    """`encode`'s rows back as (op, tile, flags, waits): the round trip the tests check."""
    out = []
    for row in rows:
        n = row[4]
        waits = tuple((row[5 + 2 * w], row[6 + 2 * w]) for w in range(n))
        out.append((row[0], row[1], tuple(f for f in row[2:4] if f >= 0), waits))
    return out


def producers(plan: Plan) -> list[list[int]]:
    """Per flag, the queue positions of the items counting into it."""
    out: list[list[int]] = [[] for _ in plan.flag_targets]
    for it in plan.items:
        for f in it.flags:
            out[f].append(it.index)
    return out


def static_lists(plan: Plan, workers: int) -> list[list[int]]:
    """Per worker, its items in queue order: each op's tiles dealt round-robin starting where the last op ended
    (so a one-tile op does not always land on worker 0)."""
    lists: list[list[int]] = [[] for _ in range(workers)]
    w = 0
    for it in plan.items:
        lists[w].append(it.index)
        w = (w + 1) % workers
    return lists


def check_lists(plan: Plan, lists: list[list[int]]) -> None:
    """Refuses per-worker lists that miss or repeat an item or hold one out of queue order (then a worker could
    spin on a flag whose producer sits behind it in its own list, or behind another spinning worker's)."""
    seen = sorted(i for lst in lists for i in lst)
    if seen != list(range(len(plan.items))):
        raise ValueError("the workers' lists must hold every item exactly once")
    for w, lst in enumerate(lists):
        if any(b <= a for a, b in zip(lst, lst[1:])):
            raise ValueError(f"worker {w}'s items are not in queue order: a flag wait there can deadlock")


@dataclass
class Timeline:
    makespan_us: float
    start_us: list[float]
    finish_us: list[float]
    worker: list[int]
    spin_us: float  # summed time workers spent waiting on flags


def simulate(plan: Plan, workers: int, flag_us: float = 0.7, lists: list[list[int]] | None = None) -> Timeline:
    """The step's timeline: `dynamic` (lists None: a free worker takes the next item in queue order) or the given
    per-worker `lists`. An item starts when its worker is free and every flag it waits on has reached its count
    (the last producer's finish + flag_us); it then holds the worker for its op's cost. Deterministic."""
    n = len(plan.items)
    finish = [math.nan] * n
    start = [math.nan] * n
    who = [-1] * n
    flag_done = [0.0] * len(plan.flag_targets)  # when a flag reaches its count: the latest producer's finish
    flag_left = list(plan.flag_targets)
    spin = 0.0

    def run(it: Item, w: int, free_at: float) -> float:
        nonlocal spin
        ready = free_at
        for f, _count in it.waits:
            if flag_left[f]:
                raise RuntimeError(f"item {it.index} waits on flag {f} before all its producers were scheduled: "
                                   "the queue is not in topological order")
            ready = max(ready, flag_done[f] + flag_us)
        spin += ready - free_at
        start[it.index], who[it.index] = ready, w
        end = ready + plan.ops[it.op].cost_us
        finish[it.index] = end
        for f in it.flags:
            flag_done[f] = max(flag_done[f], end)
            flag_left[f] -= 1
        return end

    if lists is None:
        free = [(0.0, w) for w in range(workers)]
        heapq.heapify(free)
        for it in plan.items:  # queue order: the next free worker (ties: the lower worker) takes the next item
            t, w = heapq.heappop(free)
            heapq.heappush(free, (run(it, w, t), w))
    else:
        check_lists(plan, lists)
        # each worker walks its list; advance the worker whose next item comes first in queue order, so every
        # producer is scheduled before its consumers (the lists are in queue order: `check_lists`)
        pos = [0] * len(lists)
        free_at = [0.0] * len(lists)
        heads = [(lst[0], w) for w, lst in enumerate(lists) if lst]
        heapq.heapify(heads)
        while heads:
            q, w = heapq.heappop(heads)
            free_at[w] = run(plan.items[q], w, free_at[w])
            pos[w] += 1
            if pos[w] < len(lists[w]):
                heapq.heappush(heads, (lists[w][pos[w]], w))
    return Timeline(max(finish) if n else 0.0, start, finish, who, spin)


def kernel_chain(ops: list[Op], workers: int, gap_us: float) -> float:
    """The same ops as one launch each, back to back on one stream: an op starts `gap_us` after the one before it
    ends (the drain, the launch, the fill) and takes its waves (ceil(tiles / workers) x its item cost)."""
    total = 0.0
    for op in ops:
        total += gap_us + math.ceil(op.tiles / workers) * op.cost_us
    return total


def critical_path(plan: Plan, flag_us: float = 0.7) -> float:
    """The longest chain of item costs and flag hops: the step's time with unlimited workers (a floor of any
    schedule of these items)."""
    done = [0.0] * len(plan.flag_targets)
    longest = 0.0
    for it in plan.items:
        ready = max((done[f] + flag_us for f, _ in it.waits), default=0.0)
        end = ready + plan.ops[it.op].cost_us
        for f in it.flags:
            done[f] = max(done[f], end)
        longest = max(longest, end)
    return longest
