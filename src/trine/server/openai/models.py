"""What a request's `model` names, the `/v1/models` listing, and the sampling runs requests run in.

`model` is a served base model (its name, as `trine serve` prints it) or a sampler checkpoint the
caller's key owns: its id (`ck_...`), its `trio://` URI, or a `tinker://` URI. Another key's
checkpoint answers exactly like a missing one (404).

Every OpenAI request samples through the service's ordinary sampling path, in a sampling run of
the caller's "openai" session (one run per key and model, created on first use), so it is metered,
priced and reported by `trine usage` like any other sampling request.
"""

from __future__ import annotations

from dataclasses import dataclass

from ...service import ApiKey, Checkpoint, InvalidRequest, NotFound, SamplingRunSpec, Service
from ...uris import TINKER_SCHEME
from ..tinker.state import to_trio_uri
from .errors import OpenAIError

SESSION_SDK = "openai"


@dataclass(frozen=True)
class ModelTarget:
    """A resolved `model`: the served base model, and the sampler checkpoint on it (if any)."""

    model: str  # as the caller named it; responses echo it
    base: str  # served model name
    checkpoint: Checkpoint | None = None

    @property
    def uri(self) -> str:
        return self.checkpoint.uri if self.checkpoint else ""


def _not_found() -> OpenAIError:
    # the name is not echoed: it may be another key's checkpoint
    return OpenAIError(
        404,
        "The model does not exist or you do not have access to it. "
        "GET /v1/models lists the served models and your sampler checkpoints.",
        param="model",
        code="model_not_found",
    )


def resolve(service: Service, key: ApiKey, model: str) -> ModelTarget:
    """The target `model` names for `key`; 404 (model_not_found) for anything else."""
    ck = None
    try:
        if model.startswith("trio://"):
            ck = service.ownership.readable_by_uri(key, model)
        elif model.startswith(TINKER_SCHEME):  # the Tinker front end's name for a trio:// checkpoint
            ck = service.ownership.readable_by_uri(key, to_trio_uri(model))
        else:
            try:
                return ModelTarget(model, service.queries.model(model).name)
            except NotFound:
                ck = service.ownership.checkpoint(key, model)
        base = service.queries.model(ck.base_model).name
    except (NotFound, InvalidRequest):
        raise _not_found() from None
    return ModelTarget(model, base, ck)


def listing(service: Service, key: ApiKey) -> list[dict]:
    """The served base models, then the key's sampler checkpoints (newest last)."""
    created = int(service.started_at)
    served = [m.name for m in service.queries.models()]
    out = [
        {"id": name, "object": "model", "created": created, "owned_by": "trine", "root": name, "parent": None}
        for name in served
    ]
    cks, _ = service.queries.checkpoints(key)
    for ck in cks:
        if ck.kind == "SAMPLER" and ck.base_model in served:
            out.append(card(ck))
    return out


def card(ck: Checkpoint) -> dict:
    return {
        "id": ck.uri,
        "object": "model",
        "created": int(ck.created_at),
        "owned_by": ck.api_key_id,
        "root": ck.base_model,
        "parent": ck.base_model,
        "checkpoint_id": ck.id,
    }


def model_card(service: Service, key: ApiKey, target: ModelTarget) -> dict:
    if target.checkpoint is not None:
        return card(target.checkpoint)
    return {
        "id": target.base,
        "object": "model",
        "created": int(service.started_at),
        "owned_by": "trine",
        "root": target.base,
        "parent": None,
    }


class SamplingRuns:
    """The caller's sampling run for a target, created on first use and remembered per server."""

    def __init__(self, service: Service):
        self.service = service
        self._sessions: dict[str, str] = {}  # api key id -> its "openai" session
        self._runs: dict[tuple[str, str, str], str] = {}  # (key, base, checkpoint uri) -> run id

    def run_id(self, key: ApiKey, target: ModelTarget, *, fresh: bool = False) -> str:
        """The run to sample `target` in; `fresh` replaces one that was ended (e.g. its session was
        closed through the control plane). Synchronous: no two callers can race to create one."""
        slot = (key.id, target.base, target.uri)
        if slot in self._runs and not fresh:
            return self._runs[slot]
        svc = self.service
        session = self._sessions.get(key.id)
        if session is None or fresh:
            session = self._sessions[key.id] = svc.runs.create_session(key, SESSION_SDK).id
        run = svc.runs.create_sampling_run(key, session, SamplingRunSpec(target.base, target.uri))
        self._runs[slot] = run.id
        return run.id
