"""What the Tinker front end keeps beside the service: the ids the SDK computes and the path form.

Tinker names a training client `<session_id>:train:<model_seq_id>` (the SDK computes that id itself
for create-from-state) and checkpoints `tinker://<run>/<weights|sampler_weights>/<name>`; trine's
service knows training runs by their own ids and checkpoints by `trio://<run>/<state|weights>/<name>`.
This module maps one onto the other. Runs, events, ordering and metering stay in the service.

Invariants
- A model id maps to one training run, owned by the key that created it; anyone else gets 404.
- The maps live in memory: after a restart the old runs are INTERRUPTED anyway (their weights are
  gone), and checkpoints stay reachable by their `tinker://` paths, which need no map.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from fastapi import Request

from ...service import ApiKey, InvalidRequest, NotFound, Service, ServiceError
from ...service.stability import StabilityRecords
from ..context import caller_key, service_of
from .futures import FutureTable

TINKER_SCHEME = "tinker://"
_TO_TRIO = {"weights": "state", "sampler_weights": "weights"}
_TO_TINKER = {v: k for k, v in _TO_TRIO.items()}


def to_trio_uri(path: str, field: str = "path") -> str:
    """`tinker://<run>/weights/<name>` -> `trio://<run>/state/<name>` (sampler_weights -> weights);
    an error names `field`, the request field that carried `path`."""
    if not isinstance(path, str) or not path.startswith(TINKER_SCHEME):
        raise InvalidRequest(f"{field} {path!r}: use a tinker://<run>/<weights|sampler_weights>/<name> path "
                             "returned by save_state or save_weights_for_sampler")
    parts = path[len(TINKER_SCHEME):].split("/")
    if len(parts) != 3 or parts[1] not in _TO_TRIO or not parts[0] or not parts[2]:
        raise InvalidRequest(f"{field} {path!r}: expected tinker://<run>/<weights|sampler_weights>/<name>")
    return f"trio://{parts[0]}/{_TO_TRIO[parts[1]]}/{parts[2]}"


def to_tinker_path(uri: str) -> str:
    run, kind, name = uri[len("trio://"):].split("/", 2)
    return f"{TINKER_SCHEME}{run}/{_TO_TINKER[kind]}/{name}"


@dataclass
class Model:
    run_id: str
    api_key_id: str
    session_id: str


@dataclass
class TinkerState:
    models: dict[str, Model] = field(default_factory=dict)  # tinker model id -> its training run
    samplers: dict[tuple[str, int], str] = field(default_factory=dict)  # (session, seq) -> sampling run
    futures: FutureTable = field(default_factory=FutureTable)
    stability: StabilityRecords = field(default_factory=StabilityRecords)

    def model(self, key: ApiKey, model_id: str) -> Model:
        m = self.models.get(model_id)
        if m is None or m.api_key_id != key.id:
            raise NotFound("model_id not found: use the id create_model returned to this API key (ids "
                           "do not survive a server restart; restore from a saved state)",
                           code="model_not_found")
        return m


def state_of(request: Request) -> TinkerState:
    app = request.app
    if not hasattr(app.state, "tinker"):
        app.state.tinker = TinkerState()
    return app.state.tinker


def caller(request: Request) -> tuple[Service, TinkerState, ApiKey]:
    """The service, the Tinker state and the authenticated key of a request."""
    from .proto import pb
    if pb is None:
        raise ServiceError("the Tinker API needs the `tinker` package (Python >= 3.11): "
                           "pip install tinker==0.38.0", code="tinker_unavailable", status=501)
    return service_of(request), state_of(request), caller_key(request)


def model_id_of(session_id: str, model_seq_id: int) -> str:
    return f"{session_id}:train:{model_seq_id}"
