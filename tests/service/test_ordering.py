"""Per-run event ordering and the clock-cycle scheduler, with plain functions in place of the engine."""

from __future__ import annotations

import asyncio

import pytest

from trine.limits import FORWARD_BACKWARD as FB
from trine.limits import INIT_RUN
from trine.limits import OPTIMIZE_STEP as OPT
from trine.limits import SAVE_STATE as SAVE
from trine.service.errors import Conflict
from trine.service.events import Event
from trine.service.ordering import RunQueue, plan_cycle, split_phases
from trine.service.scheduler import ClockScheduler
from trine.store import EventRecord


def ev(index: int, type_: str, run: str = "r", eid: str | None = None, op=None) -> Event:
    record = EventRecord(eid or f"e{run}{index}", run, "", index, type_, 0, "accepted", 0.0, 0.0)
    return Event(record, command=op, op=op, replica=None)


def test_events_release_in_index_order_whatever_the_arrival_order():
    q = RunQueue("r")
    for e in (ev(3, OPT), ev(1, INIT_RUN), ev(2, FB)):
        q.add(e)
    assert [e.index for e in q.take_cycle()] == [1]  # init runs alone
    assert [e.index for e in q.take_cycle()] == [2, 3]  # fb + optim in one cycle
    assert q.take_cycle() == []


def test_a_gap_holds_back_later_events():
    q = RunQueue("r", next_index=2)
    q.add(ev(3, FB))
    assert not q.ready() and q.take_cycle() == []
    q.add(ev(2, FB))
    assert [e.index for e in q.take_cycle()] == [2, 3]


def test_index_reuse_is_a_conflict_but_the_same_event_is_not():
    q = RunQueue("r")
    q.add(ev(1, INIT_RUN, eid="a"))
    q.add(ev(1, INIT_RUN, eid="a"))  # the same event again: harmless
    with pytest.raises(Conflict):
        q.add(ev(1, INIT_RUN, eid="b"))
    q.take_cycle()
    with pytest.raises(Conflict):
        q.add(ev(1, FB, eid="c"))


def test_one_cycle_takes_chunks_then_one_step_then_saves():
    q = RunQueue("r")
    types = [SAVE, FB, FB, OPT, SAVE, FB, OPT]
    for i, t in enumerate(types, 1):
        q.add(ev(i, t))
    first = q.take_cycle()
    assert [e.type for e in first] == [SAVE, FB, FB, OPT, SAVE]
    share = split_phases(first)  # the engine's RunShare: its events by id
    assert [e.event_id for e in share.pre] == ["er1"] and [e.event_id for e in share.forward] == [
        "er2",
        "er3",
    ]
    assert [e.event_id for e in share.optim] == ["er4"] and [e.event_id for e in share.post] == ["er5"]
    assert [e.type for e in q.take_cycle()] == [FB, OPT]


def test_plan_stamps_every_event_with_the_cycle_number():
    a, b = RunQueue("a"), RunQueue("b")
    a.add(ev(1, FB, "a"))
    b.add(ev(1, FB, "b"))
    b.add(ev(2, OPT, "b"))
    plan = plan_cycle(7, [a, b])
    assert set(plan.runs) == {"a", "b"} and len(plan) == 3
    assert all(e.cycle == 7 for evs in plan.runs.values() for e in evs)
    assert plan.cycle.number == 7 and set(plan.cycle.runs) == {"a", "b"}  # the engine's cycle, as is
    assert [e.event_id for e in plan.cycle.runs["b"].forward + plan.cycle.runs["b"].optim] == ["eb1", "eb2"]


def test_scheduler_batches_runs_and_counts_cycles_per_step():
    """Pipelined submissions (fb + optim before waiting) take one cycle per step; a client that
    waits for each result before sending the next takes two."""

    async def main():
        plans = []

        async def execute(plan):
            plans.append({run: [e.type for e in evs] for run, evs in plan.runs.items()})
            await asyncio.sleep(0.01)

        sched = ClockScheduler(execute, gather_seconds=0.01)
        sched.start()
        index = {"a": 0, "b": 0}

        def submit(run, type_):
            index[run] += 1
            sched.queue(run).add(ev(index[run], type_, run))
            sched.notify()

        async def settle():
            while any(q.waiting for q in sched.queues.values()):
                await asyncio.sleep(0.005)
            await asyncio.sleep(0.03)

        for _ in range(3):  # pipelined, two runs at once
            for run in ("a", "b"):
                submit(run, FB)
                submit(run, OPT)
            await settle()
        pipelined = len(plans)
        for _ in range(3):  # naive: wait after every call
            submit("a", FB)
            await settle()
            submit("a", OPT)
            await settle()
        await sched.stop()
        return plans, pipelined

    plans, pipelined = asyncio.run(main())
    assert pipelined == 3  # 3 steps x 2 runs in 3 cycles, both runs batched in each
    assert all(p == {"a": [FB, OPT], "b": [FB, OPT]} for p in plans[:3])
    assert len(plans) - pipelined == 6  # 3 naive steps, 2 cycles each


def test_fixed_cycles_start_on_clock_ticks():
    async def main():
        starts = []

        async def execute(plan):
            starts.append(asyncio.get_running_loop().time())

        sched = ClockScheduler(execute, cycle_seconds=0.1)
        sched.start()
        for i in range(1, 4):
            sched.queue("r").add(ev(i, FB))
            sched.notify()
            await asyncio.sleep(0.12)
        await sched.stop()
        return starts

    starts = asyncio.run(main())
    assert len(starts) == 3
    gaps = [b - a for a, b in zip(starts, starts[1:])]
    assert all(abs(g - round(g / 0.1) * 0.1) < 0.03 for g in gaps)  # multiples of the cycle length


def forward(index: int, run: str, tokens: int) -> Event:
    from trine.engine.api import Forward, Loss, TrainDatum

    data = [TrainDatum([1] * tokens, [1] * tokens, [1.0] * tokens)]
    return ev(index, FB, run, op=Forward(data, Loss.parse("cross_entropy"), True, False, None))


def test_one_keys_long_queue_does_not_hold_back_another_keys_step():
    """Key A queued ten 1000-token batches and a step; key B one small batch and a step. With a
    4000-token cycle, B's step runs in the first cycle next to 2000 of A's tokens (not all 10000),
    and A's batches follow in order over the next cycles, its step after its last batch."""
    a, b = RunQueue("a", tenant="A"), RunQueue("b", tenant="B")
    for i in range(1, 11):
        a.add(forward(i, "a", 1000))
    a.add(ev(11, OPT, "a"))
    b.add(forward(1, "b", 100))
    b.add(ev(2, OPT, "b"))
    first = plan_cycle(1, [a, b], cycle_tokens=4000)
    assert [e.type for e in first.runs["b"]] == [FB, OPT]
    assert [e.index for e in first.runs["a"]] == [1, 2]
    taken = [e.index for e in first.runs["a"]]
    for n in range(2, 10):
        plan = plan_cycle(n, [a, b], cycle_tokens=4000)
        taken += [e.index for e in plan.runs.get("a", [])]
    assert taken == list(range(1, 12))
    assert plan_cycle(1, [RunQueue("c")]).runs == {}  # nothing ready: nothing planned
