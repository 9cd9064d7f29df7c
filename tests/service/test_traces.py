"""service/traces.py on stored timings written by hand (no engine): lanes per replica, rows that never
overlap, spans only for the points a request reached, a cycle per (replica, number) holding this
session's events, tokens and cost from the usage rows, and another key's session not found."""

from __future__ import annotations

import asyncio
import time

import pytest
from serverutil import serve

from trine.engine.api import SampleRequest, SamplingOptions
from trine.metering.events import UsageEvent
from trine.metering.rates import RateCard
from trine.service import SamplingRunSpec
from trine.service.errors import NotFound
from trine.service.ownership import Ownership
from trine.service.traces import Traces, chrome_trace
from trine.store import Session, Store, Timing

T0 = 1_800_000_000.0


@pytest.fixture()
def env(tmp_path):
    store = Store(tmp_path)
    key, _ = store.create_key("alice")
    store.add_session(Session("ss_1", key.id, "ACTIVE", "test", T0, T0))
    traces = Traces(store=store, ownership=Ownership(store=store), rate_card=RateCard.load(home=tmp_path))
    yield store, key, traces
    store.close()


def timing(key, run_id: str, rid: str, op: str, replica: int, accepted: float, **points) -> Timing:
    return Timing(
        key.id, "ss_1", run_id, rid, op, "m", replica, points.pop("status", "succeeded"), accepted, **points
    )


def sample(store, key, rid, replica, accepted, started, prefilled, ended, status="succeeded", **usage):
    times = dict(started=started, prefilled=prefilled, ended=ended, status=status)
    store.add_timing(timing(key, "sr_1", rid, "sample", replica, accepted, **times))
    if usage:
        store.add_usage(UsageEvent(ended, key.id, "ss_1", "sr_1", "m", "sample", rid, **usage))


def event(store, key, eid, op, accepted, cycle, span, step, **usage):
    times = dict(started=span[0], ended=span[1], op_started=step[0], op_ended=step[1], cycle=cycle)
    store.add_timing(timing(key, "tr_1", eid, op, 0, accepted, **times))
    if usage:
        store.add_usage(UsageEvent(span[1], key.id, "ss_1", "tr_1", "m", op, eid, **usage))


def test_lanes_rows_and_tokens(env):
    store, key, traces = env
    # two overlapping samples on replica 0, one on replica 1, one cancelled while queued
    sample(store, key, "a", 0, T0, T0 + 1, T0 + 2, T0 + 5, prefill=10, prefill_cached=16, sample=4)
    sample(store, key, "b", 0, T0 + 0.5, T0 + 1.5, T0 + 2.5, T0 + 6, prefill=26, sample=8)
    sample(store, key, "c", 1, T0, T0 + 1, T0 + 2, T0 + 3, prefill=5, sample=2)
    sample(store, key, "d", 0, T0 + 7, 0, 0, T0 + 8, status="cancelled")
    # a forward_backward and an optim step in one cycle, another step in the next
    event(store, key, "e1", "forward_backward", T0, 1, (T0 + 1, T0 + 3), (T0 + 1, T0 + 2.5), train=12)
    event(store, key, "e2", "optimize_step", T0, 1, (T0 + 1, T0 + 3), (T0 + 2.5, T0 + 3))
    event(store, key, "e3", "forward_backward", T0 + 3, 2, (T0 + 4, T0 + 5), (T0 + 4, T0 + 5), train=7)
    tl = traces.timeline(key, "ss_1")
    by = {}
    for s in tl.spans:
        by.setdefault((s.replica, s.lane), []).append(s)
    assert len(by[(0, "prefill")]) == 2 and len(by[(1, "prefill")]) == 1
    assert {s.row for s in by[(0, "decode")]} == {0, 1}  # a and b decode at once: two rows
    assert [s.request_id for s in by[(0, "queue")] if s.request_id == "d"] == ["d"]  # queued only
    assert not any(s.request_id == "d" for lane in ("prefill", "decode") for s in by[(0, lane)])
    a_prefill = next(s for s in by[(0, "prefill")] if s.request_id == "a")
    assert a_prefill.tokens == {"prefill": 10, "prefill_cached": 16} and a_prefill.cost > 0
    assert (a_prefill.start, a_prefill.end) == (T0 + 1, T0 + 2)
    cycles = sorted(by[(0, "cycle")], key=lambda s: s.start)
    assert [c.args["cycle"] for c in cycles] == [1, 2] and cycles[0].tokens == {"train": 12}
    assert [c.args["events"] for c in cycles] == [2, 1]
    steps = sorted(by[(0, "train")], key=lambda s: s.start)
    assert [s.name for s in steps] == ["forward_backward", "optimize_step", "forward_backward"]
    assert steps[0].tokens["train"] == 12 and steps[1].tokens["train"] == 0
    # the Chrome form: a process per replica, no two spans of one thread overlapping
    trace = chrome_trace(tl)
    names = {e["pid"]: e["args"]["name"] for e in trace["traceEvents"] if e["name"] == "process_name"}
    assert sorted(names.values()) == ["m replica 0", "m replica 1"]
    rows = {}
    for e in trace["traceEvents"]:
        if e["ph"] == "X":
            rows.setdefault((e["pid"], e["tid"]), []).append((e["ts"], e["ts"] + e["dur"]))
    for spans in rows.values():
        spans.sort()
        assert all(a[1] <= b[0] for a, b in zip(spans, spans[1:]))


def test_a_trace_holds_the_latest_requests_and_counts_the_rest(env):
    store, key, traces = env
    for i in range(5):
        sample(
            store,
            key,
            f"r{i}",
            0,
            T0 + 10 * i,
            T0 + 10 * i + 1,
            T0 + 10 * i + 2,
            T0 + 10 * i + 3,
            sample=i + 1,
        )
    tl = traces.timeline(key, "ss_1", limit=2)
    assert (tl.requests, tl.left_out) == (2, 3)
    assert {s.request_id for s in tl.spans} == {"r3", "r4"}
    assert sorted(s.tokens["sample"] for s in tl.spans if s.lane == "decode") == [4, 5]
    assert chrome_trace(tl)["metadata"]["left_out"] == 3


def test_another_keys_session_is_not_found(env):
    store, _, traces = env
    bob, _ = store.create_key("bob")
    with pytest.raises(NotFound):
        traces.timeline(bob, "ss_1")


def test_a_stream_closed_early_is_timed_as_cancelled(tiny_model_dir, tmp_path):
    """A stream its consumer closes is metered for what it computed (service/sampling/run.py) and timed too:
    its queue and prefill spans, and a decode span up to the cancellation."""
    with serve(tiny_model_dir, tmp_path / "home") as srv:
        svc = srv.service
        key = svc.ownership.authenticate(srv.api_key)
        session = svc.runs.create_session(key, "test")
        run = svc.runs.create_sampling_run(key, session.id, SamplingRunSpec("tiny-llama"))
        long = SampleRequest("r1", list(range(5, 40)), SamplingOptions(max_tokens=1000, stop_at_eos=False))

        async def two_chunks_then_close():
            items = svc.sampling.sample_stream(key, run.id, long)
            for _ in range(2):
                await items.__anext__()
            await items.aclose()

        asyncio.run_coroutine_threadsafe(two_chunks_then_close(), svc.loop).result(60)
        for _ in range(100):  # the cancellation is metered (and timed) in the background
            rows, _ = svc.store.timings(key.id, session.id)
            if rows:
                break
            time.sleep(0.05)
        (t,) = rows
        assert t.status == "cancelled" and t.accepted <= t.started <= t.prefilled <= t.ended
        lanes = {s.lane for s in svc.traces.timeline(key, session.id).spans}
        assert {"prefill", "decode"} <= lanes
