"""The persistent step's schedule (kernels/step/persistent_plan.py, issue 37 item 1), checked without a GPU: the
queue is a topological order of the items, every wait names the right producer flag and count, per-worker lists
out of queue order are refused, the simulated timelines honour every dependency (against an independent
recomputation) and always finish, the table round-trips, and the simple cases' times are what they must be."""

from __future__ import annotations

import random

import pytest

from dsv41.kernels.step import persistent_plan as pp
from dsv41.kernels.step.persistent_plan import Need, Op


def _random_ops(rng: random.Random, n_ops: int) -> list[Op]:
    ops: list[Op] = []
    for i in range(n_ops):
        groups = rng.choice([1, 1, 2, 4])
        tiles = groups * rng.randint(1, 6)
        earlier = [o.name for o in ops]
        needs = []
        for name in rng.sample(earlier, k=min(len(earlier), rng.randint(0, 2))):
            producer = next(o for o in ops if o.name == name)
            per_group = producer.groups > 1 and rng.random() < 0.6
            needs.append(Need(name, per_group=per_group))
        ops.append(Op(f"op{i}", tiles, rng.uniform(0.1, 5.0), tuple(needs), groups))
    return ops


def test_waits_name_the_producers_flags_and_come_earlier_in_the_queue():
    ops = [
        Op("site", 4, 1.0, groups=1),
        Op("proj", 8, 2.0, (Need("site"),), groups=8),  # 8 column blocks, a flag each
        Op("core_split", 16, 1.5, (Need("proj"),), groups=4),  # 4 heads blocks x 4 splits
        Op("combine", 4, 1.0, (Need("core_split", per_group=True),)),  # block i waits for its own 4 splits only
    ]
    plan = pp.build(ops)
    # flags: site 1; proj 8 groups + its whole; core_split 4 groups + its whole; combine 1
    assert len(plan.items) == 32 and len(plan.flag_targets) == 1 + 9 + 5 + 1
    owners = pp.producers(plan)
    for it in plan.items:
        for flag, count in it.waits:
            assert all(p < it.index for p in owners[flag]), "a wait on a later item"
            assert count == len(owners[flag]) == plan.flag_targets[flag]
    combine = [it for it in plan.items if plan.ops[it.op].name == "combine"]
    split_flags = [10 + g for g in range(4)]
    assert [it.waits for it in combine] == [((f, 4),) for f in split_flags]
    proj = [it for it in plan.items if plan.ops[it.op].name == "proj"]
    assert [it.flags for it in proj] == [(g, 9) for g in range(1, 9)] and all(it.waits == ((0, 4),) for it in proj)
    split = [it for it in plan.items if plan.ops[it.op].name == "core_split"]
    assert all(it.waits == ((9, 8),) for it in split), "all of proj: one wait on its whole flag, not 8"


def test_needs_of_unknown_or_later_ops_and_too_many_waits_are_refused():
    with pytest.raises(ValueError, match="not an earlier op"):
        pp.build([Op("a", 1, 1.0, (Need("b"),)), Op("b", 1, 1.0)])
    with pytest.raises(ValueError, match="twice"):
        pp.build([Op("a", 1, 1.0), Op("a", 1, 1.0)])
    with pytest.raises(ValueError, match="equal groups"):
        Op("a", 6, 1.0, groups=4)
    many = [Op(f"p{i}", 1, 1.0) for i in range(5)]
    with pytest.raises(ValueError, match="waits on 5 flags"):
        pp.build(many + [Op("b", 1, 1.0, tuple(Need(o.name) for o in many))])


def test_out_of_order_worker_lists_are_refused():
    plan = pp.build([Op("a", 2, 1.0), Op("b", 2, 1.0, (Need("a"),))])
    pp.check_lists(plan, [[0, 2], [1, 3]])
    with pytest.raises(ValueError, match="not in queue order"):
        pp.check_lists(plan, [[2, 0], [1, 3]])  # worker 0 would spin on b's wait before running a's tile 0
    with pytest.raises(ValueError, match="exactly once"):
        pp.check_lists(plan, [[0, 2], [1]])


@pytest.mark.parametrize("seed", range(12))
def test_simulated_timelines_honour_every_dependency_and_finish(seed):
    rng = random.Random(seed)
    ops = _random_ops(rng, rng.randint(2, 9))
    plan = pp.build(ops)
    flag_us = rng.choice([0.0, 0.7])
    owners = pp.producers(plan)
    for workers in (1, 3, 16):
        for lists in (None, pp.static_lists(plan, workers)):
            tl = pp.simulate(plan, workers, flag_us=flag_us, lists=lists)
            for it in plan.items:  # independent check: start >= every producer's finish + the flag's latency
                for flag, _ in it.waits:
                    latest = max(tl.finish_us[p] for p in owners[flag])
                    assert tl.start_us[it.index] >= latest + flag_us - 1e-9
                assert tl.finish_us[it.index] == pytest.approx(tl.start_us[it.index] + plan.ops[it.op].cost_us)
            # a worker runs one item at a time
            by_worker: dict[int, list[tuple[float, float]]] = {}
            for it in plan.items:
                by_worker.setdefault(tl.worker[it.index], []).append((tl.start_us[it.index], tl.finish_us[it.index]))
            for spans in by_worker.values():
                spans.sort()
                assert all(b[0] >= a[1] - 1e-9 for a, b in zip(spans, spans[1:]))
            assert tl.makespan_us >= pp.critical_path(plan, flag_us) - 1e-9
            assert tl.makespan_us >= sum(o.tiles * o.cost_us for o in ops) / workers - 1e-9


def test_simple_cases_take_what_they_must():
    chain = [Op("a", 1, 2.0), Op("b", 1, 3.0, (Need("a"),)), Op("c", 1, 1.0, (Need("b"),))]
    plan = pp.build(chain)
    assert pp.simulate(plan, 4, flag_us=0.5).makespan_us == pytest.approx(2 + 0.5 + 3 + 0.5 + 1)
    assert pp.critical_path(plan, 0.5) == pytest.approx(7.0)
    assert pp.kernel_chain(chain, 4, gap_us=5.0) == pytest.approx(3 * 5 + 6)
    wide = [Op("w", 132, 1.0)]
    assert pp.simulate(pp.build(wide), 132).makespan_us == pytest.approx(1.0)
    assert pp.simulate(pp.build(wide), 66).makespan_us == pytest.approx(2.0)
    # independent ops overlap in the persistent step; a launch each serialises them
    two = [Op("x", 10, 1.0), Op("y", 10, 1.0)]
    assert pp.simulate(pp.build(two), 20).makespan_us == pytest.approx(1.0)
    assert pp.kernel_chain(two, 20, gap_us=0.0) == pytest.approx(2.0)
    # a per-group wait lets the consumer start on the first group while the producer's second group still runs
    split = [Op("p", 2, 1.0, groups=2), Op("q", 2, 1.0, (Need("p", per_group=True),))]
    lists = [[0, 2], [1, 3]]
    tl = pp.simulate(pp.build(split), 2, flag_us=0.0, lists=lists)
    assert tl.start_us[2] == pytest.approx(1.0) and tl.makespan_us == pytest.approx(2.0)


def test_the_table_round_trips():
    rng = random.Random(7)
    plan = pp.build(_random_ops(rng, 8))
    rows = pp.encode(plan)
    assert all(len(r) == 5 + 2 * pp.MAX_WAITS for r in rows)
    assert pp.decode(rows) == [(it.op, it.tile, it.flags, it.waits) for it in plan.items]
