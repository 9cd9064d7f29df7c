"""`SampleCall`: one sample request as it goes through the stages, built once when it is accepted.

It holds what every stage reads: the caller's key, the sampling run, its served model, the request
as the front end built it (`req`: the client's request id, no weights) and as the engine runs it
(`engine_req`: an engine-wide id, the run's weights, the caller as tenant), the fingerprint a retry
must repeat, when it was accepted, and the replica the route stage chose (None until then; a
replica-loss retry replaces it).

Invariants
- `dedup` (sampling run id, client request id) names the request in the service; `engine_id` names
  it in the engine, `f"{run id}/{request id}"`, the same on every replica.
- Nothing but `replica` changes after the call is built.
"""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass

from ...engine.api import SampleRequest, WeightsIdentity
from ...store import ApiKey, SamplingRun
from ..meter import SampleWork
from ..models import Replica, ServedModel


@dataclass(eq=False)
class SampleCall:
    key: ApiKey  # the caller
    run: SamplingRun
    model: ServedModel  # the run's base model
    req: SampleRequest  # as the front end built it
    engine_req: SampleRequest  # as the engine runs it
    fingerprint: str  # the body a retry must repeat ("" = unchecked)
    accepted: float  # unix seconds the service accepted it
    replica: Replica | None = None  # where it runs (the route stage's choice)

    @classmethod
    def of(
        cls, key: ApiKey, run: SamplingRun, model: ServedModel, req: SampleRequest, fingerprint: str = ""
    ) -> SampleCall:
        """The call of `req`, accepted now."""
        return cls(key, run, model, req, engine_request(key, model, run, req), fingerprint, time.time())

    @property
    def dedup(self) -> tuple[str, str]:
        return (self.run.id, self.req.request_id)

    @property
    def engine_id(self) -> str:
        return self.engine_req.request_id

    def work(self, replica: Replica | None = None) -> SampleWork:
        """What its usage and timing rows name: its caller, its run, where it ran (`replica`, else
        the chosen one), when it came."""
        r, rep = self.run, self.replica if replica is None else replica
        req = self.req
        return SampleWork(
            self.key.id,
            r.session_id,
            r.id,
            self.model.name,
            req.request_id,
            req.generate,
            rep.index,
            self.accepted,
        )


def engine_id(run_id: str, request_id: str) -> str:
    """The engine-wide id of the request `request_id` of sampling run `run_id`."""
    return f"{run_id}/{request_id}"


def engine_request(key: ApiKey, m: ServedModel, r: SamplingRun, req: SampleRequest) -> SampleRequest:
    """`req` as the engine runs it: an engine-wide id, the run's weights (an inflight target's
    version is the engine's to resolve) and the caller as its tenant. The engine checks it."""
    return dataclasses.replace(
        req,
        request_id=engine_id(r.id, req.request_id),
        weights=WeightsIdentity(m.name, weights_name(r), 0),
        inflight=bool(r.inflight_run_id),
        tenant=key.id,
    )


def weights_name(r: SamplingRun) -> str | None:
    """What a sampling run's requests name as their adapter: its inflight target (the training run
    id), its checkpoint id, or None for the base model."""
    return r.inflight_run_id or r.checkpoint_id or None
