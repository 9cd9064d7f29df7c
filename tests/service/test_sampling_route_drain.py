"""The route stage and a drain: a call whose route is still being looked up (the checkpoint read runs
off the event loop) counts as running, so a drain waits for it; one still routing when a
shutdown's deadline cancels the running calls is refused as they are (503)."""

from __future__ import annotations

import asyncio
from pathlib import Path
from types import SimpleNamespace

import pytest

from trine.engine.api import SampleRequest, SampleResult, SampleUsage, SamplingOptions
from trine.service.errors import ShuttingDown
from trine.service.models import Replica, ServedModel
from trine.service.sampling import SampleCall
from trine.service.sampling.run import Runner


class _Engine:
    def __init__(self):
        self.sampled = 0

    async def sample(self, req):
        self.sampled += 1
        return SampleResult(req.request_id, [], None, SampleUsage())


class _SlowRouting:
    """A route stage whose lookup waits until released."""

    def __init__(self, rep: Replica):
        self.rep, self.release = rep, asyncio.Event()

    async def replica(self, call: SampleCall) -> Replica:
        await self.release.wait()
        return self.rep


def _call(model: ServedModel) -> SampleCall:
    run = SimpleNamespace(id="run", session_id="s", inflight_run_id=None, checkpoint_id=None)
    req = SampleRequest("r1", [1, 2, 3], SamplingOptions(max_tokens=1))
    return SampleCall.of(SimpleNamespace(id="key"), run, model, req)


def _runner(routing) -> Runner:
    return Runner(routing=routing, records=None, adapters=None, spawn=None, on_lost=None)


def test_a_call_being_routed_counts_as_running_and_then_runs():
    async def main():
        rep = Replica(0, _Engine())
        routing = _SlowRouting(rep)
        runner = _runner(routing)
        task = asyncio.ensure_future(runner.sample(_call(ServedModel("m", Path("."), [rep]))))
        await asyncio.sleep(0)
        assert runner.running() == 1  # a drain waits for it
        routing.release.set()
        res = await task
        assert res.request_id == "run/r1" and rep.engine.sampled == 1
        assert runner.running() == 0 and rep.inflight_samples == 0

    asyncio.run(main())


def test_a_call_still_routing_at_the_shutdown_deadline_is_refused_and_never_runs():
    async def main():
        rep = Replica(0, _Engine())
        routing = _SlowRouting(rep)
        runner = _runner(routing)
        task = asyncio.ensure_future(runner.sample(_call(ServedModel("m", Path("."), [rep]))))
        await asyncio.sleep(0)
        assert await runner.cancel_all(wait=0.1) == 0  # nothing runs on a replica yet
        routing.release.set()
        with pytest.raises(ShuttingDown):
            await task
        assert rep.engine.sampled == 0 and runner.running() == 0

    asyncio.run(main())
