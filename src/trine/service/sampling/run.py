"""The run stage: a `SampleCall` on its replica, until the engine answers or it is cancelled.

`sample` routes the call and runs it, on another replica when one is lost; `stream` runs it once,
yielding the engine's deltas. While a call runs it counts against its replica's load and is
cancellable (`cancel`, `cancel_all`); what a cancelled call computed is metered through the record
stage, once.

Invariants
- The replica has the call's weights before the engine sees it: its inflight target (inflight.py)
  or its checkpoint (adapters.py).
- A stream its consumer closes early (a client that went away) is cancelled in the engine at once
  and metered for what it computed: its client may already hold every token but the last. So is a
  call its client cancels (`cancel`, Tinker's cancel_future).
- The engine answers a cancel once per request: whoever gets the answer meters it; `_metered` tells
  the call's own stream that `cancel_all` already did.
- At a shutdown's deadline `cancel_all` cancels every running call at once, without waiting on a
  busy engine for longer than its bound; their callers get 503 `server_shutting_down`, as does a
  call still being routed then. `running()` counts calls from their route on, so a drain waits
  for them.
- Engine ValueErrors (the engine's one check of a request) become 400s.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import functools
import logging
from typing import AsyncIterator

from ...engine.api import EngineLost, SampleCancelled, SampleDelta, SampleResult
from ..adapters import AdapterCache
from ..callbacks import ReplicaLost, Spawn
from ..errors import Conflict, InvalidRequest, ServiceError, ShuttingDown
from ..gate import RESTART_SECONDS, WorkGate
from ..inflight import Inflight
from ..models import Replica
from .call import SampleCall
from .record import Records
from .route import Routing

log = logging.getLogger("trine.service")


class Runner:
    def __init__(
        self,
        *,
        routing: Routing,
        records: Records,
        adapters: AdapterCache,
        spawn: Spawn,
        on_lost: ReplicaLost,
        inflight: Inflight | None = None,
        gate: WorkGate | None = None,
    ):
        self.routing = routing
        self.records = records  # meters what cancelled calls computed
        self.adapters = adapters
        self.inflight = inflight  # the inflight targets inflight sampling runs follow
        self.gate = gate  # tells a shutdown's cancel from a client's
        self._spawn = spawn
        self._on_lost = on_lost
        self._serving: dict[tuple[str, str], SampleCall] = {}  # dedup -> the call, on its replica
        self._routing = 0  # calls waiting for their route
        self._cancelled_all = False  # a shutdown's deadline has passed: no call starts any more
        self._metered: set[str] = set()  # engine request ids cancel_all metered
        self._unanswered: set[asyncio.Future] = set()  # cancel_all's cancels no engine has answered yet

    async def sample(self, call: SampleCall) -> SampleResult:
        """The engine's result for `call`, rerouted when its replica is lost."""
        m, lost = call.model, 0
        while True:  # one try per replica: a lost one is marked dead (faults.py), the route picks another
            await self._route(call)
            try:
                async with self._serving_on(call):
                    await self._ensure_weights(call)
                    return await call.replica.engine.sample(call.engine_req)
            except EngineLost as e:
                self._on_lost(m, call.replica, str(e))
                lost += 1
                if lost == len(m.replicas):
                    raise Conflict(
                        f"every engine replica of {m.name} was lost; try again later",
                        code="worker_lost",
                        status=503,
                    ) from None

    async def stream(self, call: SampleCall) -> AsyncIterator[SampleDelta | SampleResult]:
        """The engine's deltas (named as the client named the request), then its result, once the
        call no longer runs. Closing the iterator early cancels the call in the engine, which frees
        its KV blocks at once; what it computed until then is metered."""
        await self._route(call)
        res = None
        try:
            async with self._serving_on(call):
                await self._ensure_weights(call)
                async with contextlib.aclosing(call.replica.engine.sample_stream(call.engine_req)) as items:
                    async for item in items:  # closing this iterator closes the engine's: it cancels
                        if isinstance(item, SampleResult):
                            res = item
                        else:
                            yield dataclasses.replace(item, request_id=call.req.request_id)
        except EngineLost as e:
            self._on_lost(call.model, call.replica, str(e))
            raise Conflict(
                "the engine replica serving this request was lost; send it again",
                code="worker_lost",
                status=503,
            ) from None
        finally:
            if res is None:  # closed early, or failed: meter what the engine computed (if anything)
                self._spawn(self._record_cancelled(call))
        yield res

    def running(self) -> int:
        """Calls being routed or running on a replica."""
        return len(self._serving) + self._routing

    async def cancel(self, run_id: str, request_id: str) -> bool:
        """Cancel a running call (its client abandoned it): the engine frees its sequences and KV
        blocks at once, its waiters get SampleCancelled, and what it computed until then is
        metered, once. False if it is not running."""
        call = self._serving.get((run_id, request_id))
        if call is None:
            return False
        rep = call.replica
        self._meter_partial(call, await rep.engine.cancel(call.engine_id), rep)
        return True

    async def cancel_all(self, wait: float = 2.0) -> int:
        """Cancel every running call at once (a shutdown's deadline); how many. What each computed
        is metered (once) as its engine answers: waited for up to `wait` seconds, then left to
        answer later (an engine inside a training step answers when the step ends)."""
        self._cancelled_all = True
        answers = []
        for call in list(self._serving.values()):
            rep = call.replica
            answer = asyncio.ensure_future(rep.engine.cancel(call.engine_id))
            answer.add_done_callback(functools.partial(self._meter_answer, call, rep))
            answer.add_done_callback(self._unanswered.discard)
            self._unanswered.add(answer)
            answers.append(answer)
        if answers:
            await asyncio.wait(answers, timeout=wait)
        return len(answers)

    async def await_cancels(self, timeout: float) -> int:
        """Wait up to `timeout` seconds for the engines to answer `cancel_all`'s cancels, so what
        those calls computed is metered before the engines stop; how many are still unanswered."""
        if self._unanswered:
            await asyncio.wait(set(self._unanswered), timeout=timeout)
        return len(self._unanswered)

    async def _route(self, call: SampleCall) -> None:
        self._routing += 1
        try:
            call.replica = await self.routing.replica(call)
        finally:
            self._routing -= 1
        if self._cancelled_all:
            raise self._shutting_down(call)

    @contextlib.asynccontextmanager
    async def _serving_on(self, call: SampleCall):
        """Count the call against its replica's load while it runs; engine ValueErrors become 400s,
        a cancellation by shutdown a 503."""
        rep = call.replica
        rep.inflight_samples += 1
        self._serving[call.dedup] = call
        try:
            yield
        except ServiceError:
            raise
        except ValueError as e:
            raise InvalidRequest(str(e)) from None
        except SampleCancelled:
            if self.gate is None or not self.gate.draining:
                raise
            raise self._shutting_down(call) from None
        finally:
            rep.inflight_samples -= 1
            self._serving.pop(call.dedup, None)

    def _shutting_down(self, call: SampleCall) -> ShuttingDown:
        return ShuttingDown(
            f"request_id {call.req.request_id}: the server is shutting down and stopped this sample "
            "(what it computed is metered); send it again once the server has restarted",
            retry_after=RESTART_SECONDS,
        )

    async def _ensure_weights(self, call: SampleCall) -> None:
        """Make the call's replica hold the weights its run samples from: its inflight target, or its
        checkpoint."""
        r, rep = call.run, call.replica
        if r.inflight_run_id:
            await self.inflight.ensure(rep, r)
        elif r.checkpoint_id:
            await self.adapters.ensure(rep, r.checkpoint_id)

    async def _record_cancelled(self, call: SampleCall) -> None:
        """Meter a closed stream's partial work; engine.cancel() answers it once per request (a
        refused or already-finished request answers None)."""
        try:
            partial = await call.replica.engine.cancel(call.engine_id)
        except Exception:  # the replica is gone: it has nothing to report
            return
        if call.engine_id in self._metered:  # cancel_all metered it
            self._metered.discard(call.engine_id)
            return
        if partial is not None and partial.usage.prompt_tokens:
            self.records.cancelled(call, partial.usage)

    def _meter_answer(self, call: SampleCall, rep: Replica, answer: asyncio.Future) -> None:
        if answer.cancelled() or answer.exception() is not None:  # the replica is gone: nothing to report
            return
        try:
            self._meter_partial(call, answer.result(), rep)
        except Exception:  # a full disk, a closed store: the operator's log says so
            log.exception("metering the cancelled sample %s failed", call.engine_id)

    def _meter_partial(self, call: SampleCall, partial: SampleResult | None, rep: Replica) -> None:
        """Meter what a call cancelled on `rep` while running computed (its prompt, the tokens
        sampled so far), with its timing; `_metered` tells its own stream not to meter it again."""
        if partial is None or not partial.usage.prompt_tokens:
            return
        self._metered.add(call.engine_id)
        self.records.cancelled(call, partial.usage, rep)
