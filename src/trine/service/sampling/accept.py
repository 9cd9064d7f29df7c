"""The accept stage: whether a sample request is new work, and if so its `SampleCall`.

A request is accepted when the key owns its sampling run, its request id is not a retry, the run
is ACTIVE and the `WorkGate` admits new work (not draining, not short of disk space).

Invariants
- A request id is served once per sampling run (`SingleFlight`, idempotency.py): a retry of
  `sample` joins the call still running or gets the stored outcome, each only with the same
  fingerprint (another is a 409 `request_id_reused`); a stream never reuses an id (409
  `request_id_conflict`).
- Ownership and the stored outcome come first: a retry of a finished request answers even after its
  run ended or while the server drains.
- The store is read off the event loop, once per new request (record.py, `Records.stored`).
"""

from __future__ import annotations

from typing import Awaitable, Callable

from ...engine.api import SampleRequest
from ...store import ApiKey, SamplingRun
from ..errors import Conflict
from ..gate import WorkGate
from ..idempotency import SingleFlight
from ..models import ServedModel
from ..ownership import Ownership
from ..results import SampleOutcome
from .call import SampleCall
from .record import Records


class Acceptance:
    def __init__(
        self,
        *,
        ownership: Ownership,
        models: dict[str, ServedModel],
        records: Records,
        gate: WorkGate | None = None,
    ):
        self.ownership = ownership
        self.models = models
        self.records = records  # the stored outcomes a retry gets
        self.gate = gate  # refuses new requests while draining or short of disk space
        self.running: SingleFlight[SampleOutcome] = SingleFlight(
            what=lambda k: f"request_id {k[1]}", code="request_id_reused"
        )

    def sampling_run(self, key: ApiKey, sampling_run_id: str) -> SamplingRun:
        """The key's sampling run (a 404 if it is not the key's)."""
        return self.ownership.sampling_run(key, sampling_run_id)

    async def sample(
        self,
        key: ApiKey,
        sampling_run_id: str,
        req: SampleRequest,
        fingerprint: str,
        work: Callable[[SampleCall], Awaitable[SampleOutcome]],
    ) -> SampleOutcome:
        """The outcome of `req`: stored, or of the call still running under its id, or of
        `work(call)` for a new call."""
        r = self.sampling_run(key, sampling_run_id)
        dedup = (r.id, req.request_id)
        if dedup not in self.running:
            stored = await self.records.stored(dedup)
            if stored is not None:
                self.running.check(dedup, stored[1], fingerprint)
                return SampleOutcome.from_json(stored[0])
            self._admit(r, req)
        return await self.running.run(dedup, fingerprint, lambda: work(self._call(key, r, req, fingerprint)))

    async def stream(self, key: ApiKey, sampling_run_id: str, req: SampleRequest) -> SampleCall:
        """The call of a streamed `req`; its id must be new in its sampling run."""
        r = self.sampling_run(key, sampling_run_id)
        dedup = (r.id, req.request_id)
        stored = await self.records.stored(dedup)
        if stored is not None or dedup in self.running:
            raise Conflict(
                f"request_id {req.request_id!r} was already used in sampling run {r.id}; send a new id",
                code="request_id_conflict",
            )
        self._admit(r, req)
        return self._call(key, r, req, "")

    def _admit(self, r: SamplingRun, req: SampleRequest) -> None:
        if r.status != "ACTIVE":
            raise Conflict(
                f"sampling run {r.id} has ended ({r.status}); create a new sampling client", code="run_ended"
            )
        if self.gate is not None:
            self.gate.admit(f"sample request_id {req.request_id}")

    def _call(self, key: ApiKey, r: SamplingRun, req: SampleRequest, fingerprint: str) -> SampleCall:
        return SampleCall.of(key, r, self.models[r.base_model], req, fingerprint)
