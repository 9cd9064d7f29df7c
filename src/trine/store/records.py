"""Rows of the database as plain dataclasses; each table's columns are its dataclass's fields."""

from __future__ import annotations

import json
from dataclasses import dataclass


@dataclass
class ApiKey:
    id: str
    name: str
    key_hash: str
    created_at: float
    revoked_at: float | None = None


@dataclass
class Session:
    id: str
    api_key_id: str
    status: str  # ACTIVE, ENDED, CANCELLED
    sdk_version: str
    created_at: float
    updated_at: float
    # labels given at creation (see service/labels.py); runs made in the session inherit them
    name: str = ""
    tags: str = ""  # a JSON list of strings
    user_metadata: str = ""  # a JSON object of strings
    finish_reason: str = ""  # why its client closed it, as reported (Tinker: success, errored, ...)


@dataclass
class TrainingRun:
    id: str
    api_key_id: str
    session_id: str
    run_index: int
    base_model: str  # served model name
    lora_rank: int
    train_mlp: bool
    train_attn: bool
    train_unembed: bool
    seed: int | None
    source_checkpoint_uri: str
    restore_optimizer: bool
    status: str  # ACTIVE, ENDED, CANCELLED, INTERRUPTED (server restarted: in-memory state lost)
    created_at: float
    updated_at: float
    started: bool = False  # an event has been accepted: PATCH is no longer allowed
    last_cycle: int = 0
    name: str = ""  # labels given at creation (see service/labels.py)
    tags: str = ""  # a JSON list of strings
    user_metadata: str = ""  # a JSON object of strings
    optimizer: str = ""  # a JSON object: the settings of the last optim_step accepted (`type` its family)
    optimizer_family: str = "adamw"  # engine.api.OPTIMIZERS: fixed when the run is made
    # lora_rank 0 is full fine-tuning; its embedding rows that train (a JSON list; "" = all or none)
    trainable_token_indices: str = ""

    @property
    def tag_list(self) -> list[str]:
        return json.loads(self.tags) if self.tags else []

    @property
    def metadata(self) -> dict[str, str]:
        return json.loads(self.user_metadata) if self.user_metadata else {}

    @property
    def optimizer_settings(self) -> dict | None:
        return json.loads(self.optimizer) if self.optimizer else None


@dataclass
class SamplingRun:
    id: str
    api_key_id: str
    session_id: str
    run_index: int
    base_model: str
    source_checkpoint_uri: str
    checkpoint_id: str  # "" for the base model
    status: str
    created_at: float
    updated_at: float
    training_run_id: str = ""  # the training run it is attributed to ("" for none): its usage counts there
    inflight_run_id: str = ""  # an inflight sampler: the training run whose inflight saves it follows
    inflight_version: int = 0  # ... from this target version on (its checkpoint's)


@dataclass
class EventRecord:
    """One actor event. `response` is the msgpack envelope a client gets once the event is terminal."""

    id: str
    run_id: str
    api_key_id: str
    idx: int
    type: str
    step: int
    status: str  # accepted, running, succeeded, failed
    created_at: float
    updated_at: float
    cycle: int | None = None
    response: bytes | None = None
    fingerprint: str | None = None  # of the request body: a retry must match it

    @property
    def event_id(self) -> str:
        """The client's event id. `id` is scoped (`<event_id>~<run_id>`) when another run used the
        same event id first, so one run's ids never reveal or collide with another's."""
        return self.id.split("~", 1)[0]


@dataclass
class Timing:
    """When one sampling request or training event passed each point of its way through an engine
    replica, in wall-clock unix seconds (0: not reached): what a session trace draws. One row per
    request or event, stored when it settles, beside its usage row (same `run_id` and `request_id`:
    a sample's client request id, an event's stored id).

    Sampling: queued [accepted, started), prefill [started, prefilled), decode [prefilled, ended).
    Training: queued [accepted, started), in clock cycle `cycle` [started, ended), its own step of
    that cycle [op_started, op_ended) (a batched forward is one step for every event in it)."""

    api_key_id: str
    session_id: str
    run_id: str
    request_id: str
    operation: str  # sample, compute_logprobs, or the event's type (forward_backward, optimize_step, ...)
    base_model: str
    replica: int
    status: str  # succeeded, failed, cancelled
    accepted: float
    started: float = 0.0
    prefilled: float = 0.0
    op_started: float = 0.0
    op_ended: float = 0.0
    ended: float = 0.0
    cycle: int = 0


@dataclass
class Checkpoint:
    id: str
    api_key_id: str
    training_run_id: str
    name: str
    kind: str  # TRAINING (save_state), SAMPLER (save_weights) or EXTERNAL (merged Hugging Face weights)
    uri: str
    path: str  # directory on disk, "" while it lives only in memory (TEMPORARY)
    size_bytes: int
    visibility: str  # WORKSPACE or TEMPORARY
    base_model: str
    lora_rank: int
    train_mlp: bool
    train_attn: bool
    train_unembed: bool
    seed: int | None
    step: int
    created_at: float
    expires_at: float | None = None
    public: bool = False  # readable (sampled, restored, downloaded) by every API key, not only its owner
    inflight_version: int = 0  # an inflight save: the target version it published (0: a snapshot)
    trainable_token_indices: str = ""  # its run's (a JSON list), as TrainingRun's
    source: str = ""  # an imported adapter: where it came from (what the upload named, its digest)


@dataclass
class MetricPoint:
    """One value a user logged for a training run (`log_metrics`): one row per (run, step, name);
    logging the same name at the same step again replaces it."""

    run_id: str
    api_key_id: str
    step: int
    name: str
    value: float
    time: float
