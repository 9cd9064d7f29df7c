"""`Sampling`: the service's part that runs sample requests, as four stages over one `SampleCall`.

accept (accept.py: ownership, retries, the work gate) -> route (route.py: the replica) -> run
(run.py: the engine, a replica-loss retry or the stream, cancels) -> record (record.py: the
outcome, usage and timing rows, the store a retry reads). `sample`, `sample_stream` and `cancel`
share them; their contracts are the package's (__init__.py).
"""

from __future__ import annotations

import contextlib
from typing import AsyncIterator

from ...engine.api import SampleDelta, SampleRequest
from ...metering.diagnostics import PrefixDiagnostics
from ...store import ApiKey, Store
from ..adapters import AdapterCache
from ..callbacks import ReplicaLost, Spawn
from ..gate import WorkGate
from ..inflight import Inflight
from ..meter import Meter
from ..models import ServedModel
from ..ownership import Ownership
from ..results import SampleOutcome
from ..routing import Router
from .accept import Acceptance
from .call import SampleCall
from .record import Records
from .route import Routing
from .run import Runner


class Sampling:
    """What front ends call: `sample`, `sample_stream`, `cancel`; and the drain's `running`,
    `cancel_all`, `await_cancels`."""

    def __init__(
        self,
        *,
        store: Store,
        ownership: Ownership,
        models: dict[str, ServedModel],
        adapters: AdapterCache,
        meter: Meter,
        spawn: Spawn,
        on_lost: ReplicaLost,
        router: Router | None = None,
        diagnostics: PrefixDiagnostics | None = None,
        inflight: Inflight | None = None,
        gate: WorkGate | None = None,
    ):
        self.records = Records(
            store=store,
            meter=meter,
            spawn=spawn,
            diagnostics=PrefixDiagnostics() if diagnostics is None else diagnostics,
        )
        self.acceptance = Acceptance(ownership=ownership, models=models, records=self.records, gate=gate)
        self.routing = Routing(store=store, adapters=adapters, router=Router() if router is None else router)
        self.runner = Runner(
            routing=self.routing,
            records=self.records,
            adapters=adapters,
            spawn=spawn,
            on_lost=on_lost,
            inflight=inflight,
            gate=gate,
        )

    @property
    def router(self) -> Router:
        """How requests are spread over a model's replicas (settable: benchmarks compare two)."""
        return self.routing.router

    @router.setter
    def router(self, router: Router) -> None:
        self.routing.router = router

    async def sample(
        self, key: ApiKey, sampling_run_id: str, req: SampleRequest, fingerprint: str = ""
    ) -> SampleOutcome:
        """Run one sampling request (`req` as the front end built it: the client's request id, no
        weights). Retries (same request_id) get the stored outcome, or join the request still
        running; `fingerprint` identifies the body a retry must repeat ("" = unchecked)."""
        return await self.acceptance.sample(key, sampling_run_id, req, fingerprint, self._sample)

    async def _sample(self, call: SampleCall) -> SampleOutcome:
        return await self.records.finished(call, await self.runner.sample(call))

    async def sample_stream(
        self, key: ApiKey, sampling_run_id: str, req: SampleRequest
    ) -> AsyncIterator[SampleDelta | SampleOutcome]:
        """Token chunks as the engine produces them (one per sequence per engine step), then the
        SampleOutcome (stored and metered like `sample`). Closing the iterator early cancels the
        request, which frees its KV blocks at once; what it computed until then is metered."""
        call = await self.acceptance.stream(key, sampling_run_id, req)
        async with contextlib.aclosing(self.runner.stream(call)) as items:
            async for item in items:
                yield item if isinstance(item, SampleDelta) else await self.records.finished(call, item)

    async def cancel(self, key: ApiKey, sampling_run_id: str, request_id: str) -> bool:
        """Cancel a running request (its client abandoned it): the engine frees its sequences and KV
        blocks at once, its waiters get SampleCancelled, and what it computed until then (its prompt,
        the tokens sampled so far) is metered, once: the engine answers a cancel once per request.
        False if it is not running."""
        r = self.acceptance.sampling_run(key, sampling_run_id)
        return await self.runner.cancel(r.id, request_id)

    def running(self) -> int:
        """Requests being routed or running on a replica (a drain waits for them)."""
        return self.runner.running()

    async def cancel_all(self, wait: float = 2.0) -> int:
        """Cancel every running request at once (a shutdown's deadline); how many (run.py)."""
        return await self.runner.cancel_all(wait)

    async def await_cancels(self, timeout: float) -> int:
        """Wait up to `timeout` seconds for the engines to answer `cancel_all`'s cancels; how many
        are still unanswered (run.py)."""
        return await self.runner.await_cancels(timeout)
