"""What the Tinker front end keeps beside the service: the ids the SDK computes and the path form.

Tinker names a training client `<session_id>:train:<model_seq_id>` (the SDK computes that id itself
for create-from-state) and checkpoints `tinker://<run>/<weights|sampler_weights>/<name>`; trine's
service knows training runs by their own ids and checkpoints by `trio://<run>/<state|weights>/<name>`.
This module keeps the ids; the pure path mapping is `trine.uris`, which the SDK shares. Runs,
events, ordering and metering stay in the service.

Invariants
- A model id maps to one training run, owned by the key that created it; anyone else gets 404.
- The maps live in memory: after a restart the old runs are INTERRUPTED anyway (their weights are
  gone), and checkpoints stay reachable by their `tinker://` paths, which need no map.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from fastapi import Request

from ... import uris
from ...engine.api import CustomLoss
from ...service import ApiKey, InvalidRequest, NotFound, Service, ServiceError
from ..http.context import caller_key, service_of
from .futures import FutureTable
from .stability import StabilityRecords


def to_trio_uri(path: str, field: str = "path") -> str:
    """`tinker://<run>/weights/<name>` -> `trio://<run>/state/<name>`; a bad path is a 400 naming
    `field`, the request field that carried it."""
    try:
        return uris.to_trio_uri(path, field)
    except ValueError as e:
        raise InvalidRequest(str(e)) from None


@dataclass
class Model:
    run_id: str
    api_key_id: str
    session_id: str


@dataclass
class StoredLoss:
    """A custom loss kept for its session (custom_losses.py); `fingerprint`: the create body's."""

    api_key_id: str
    session_id: str
    loss: CustomLoss
    fingerprint: str


@dataclass
class TinkerState:
    models: dict[str, Model] = field(default_factory=dict)  # tinker model id -> its training run
    # (session, sampling_session_seq_id) -> (sampling run, base_model, source uri) it was made for
    samplers: dict[tuple[str, int], tuple[str, str, str]] = field(default_factory=dict)
    futures: FutureTable = field(default_factory=FutureTable)
    stability: StabilityRecords = field(default_factory=StabilityRecords)
    custom_losses: dict[str, StoredLoss] = field(default_factory=dict)  # loss id -> its graph

    def model(self, key: ApiKey, model_id: str) -> Model:
        m = self.models.get(model_id)
        if m is None or m.api_key_id != key.id:
            raise NotFound(
                "model_id not found: use the id create_model returned to this API key (ids "
                "do not survive a server restart; restore from a saved state)",
                code="model_not_found",
            )
        return m


def state_of(request: Request) -> TinkerState:
    app = request.app
    if not hasattr(app.state, "tinker"):
        app.state.tinker = TinkerState()
    return app.state.tinker


def caller(request: Request) -> tuple[Service, TinkerState, ApiKey]:
    """The service, the Tinker state and the authenticated key of a request."""
    from .bodies import pb

    if pb is None:
        raise ServiceError(
            "the Tinker API needs the `tinker` package (Python >= 3.11): pip install tinker==0.38.0",
            code="tinker_unavailable",
            status=501,
        )
    return service_of(request), state_of(request), caller_key(request)


def model_id_of(session_id: str, model_seq_id: int) -> str:
    return f"{session_id}:train:{model_seq_id}"


def optimizer_config(family: str) -> dict:
    """The client's OptimizerConfig of a run's optimizer family (AdamOptimizerConfig or
    DimuonOptimizerConfig, version 1)."""
    return {"type": "dimuon", "version": 1} if family == "dimuon" else {"type": "adamw"}
