"""What a front end may ask the service to do, where it differs from the engine's own vocabulary.

Front ends build payloads and ops of `engine.api` (a `TrainDatum`, a `Forward`, an `OptimStep`, a
`SampleRequest`, ...) and hand them to the service, which resolves what only it knows (weights,
checkpoint paths, a save's target, the gradient denominator) with `dataclasses.replace`. A command
is defined here only where its meaning differs from the engine's:

| command | asked through | becomes |
|---|---|---|
| `TrainingRunSpec`, `SamplingRunSpec`, `RunLabels` | `Runs.create_session` / `create_training_run` / `create_sampling_run` | a session or run record |
| `InitByUri` (a checkpoint named by its URI) | `Events.submit` | `engine.api.InitRun` (a directory) |
| `SaveByName` (a name and a visibility) | `Events.submit` | `engine.api.Save` (a target) |
| `Forward`, `OptimStep`, `EndRun`, `Refused` (engine.api) | `Events.submit` | themselves, prepared once |
| `SampleRequest` (engine.api) | `Sampling.sample` / `sample_stream` | itself, with its weights and tenant |

Field names are the engine's; a front end maps its protocol's names onto them (and names its wire
fields in the errors it raises itself).
"""  # noqa: E501  (a table)

from __future__ import annotations

from dataclasses import dataclass, field

from ..engine.api import EndRun, Forward, LoRAConfig, OptimStep, Refused


# ---------------------------------------------------------------------------- runs
@dataclass(frozen=True)
class RunLabels:
    """What a user calls a session or a training run: a name, tags and free metadata (strings).
    Protocols that carry only `user_metadata` put the name and tags there (`name`, and `tags`
    comma-separated); `service/labels.py` checks and merges them."""

    name: str = ""
    tags: tuple[str, ...] = ()
    user_metadata: dict = field(default_factory=dict)


@dataclass(frozen=True)
class SessionSearch:
    """Which of a key's sessions `Queries.search_sessions` finds: every condition given holds, except
    that `session_id` and `name` match either one when both are given.

    - `name`: each whitespace-separated word, case-insensitively, somewhere in the session's name.
    - `tags`: each among the session's tags. `metadata`: each pair exactly in its metadata (which
      holds `name` and comma-joined `tags` too, as `labels.as_metadata` shows them).
    - `statuses`: (status, finish reason) pairs, any of which matches; a reason None matches any
      reason (a session's `finish_reason` is what its client reported when it closed it, or "")."""

    session_id: str | None = None
    name: str | None = None
    tags: tuple[str, ...] = ()
    metadata: dict = field(default_factory=dict)
    statuses: tuple[tuple[str, str | None], ...] | None = None


@dataclass(frozen=True)
class TrainingRunSpec:
    """A new training run: on `base_model` with `lora`, or restored from a saved checkpoint (whose
    base model and LoRA shape it then takes; `lora.seed` still applies when given).

    `optimizer` (engine.api.OPTIMIZERS) is fixed for the run's life; "" = AdamW, or the checkpoint's
    optimizer when its state is restored (`restore_optimizer`), which no other value may override."""

    base_model: str = ""
    lora: LoRAConfig = field(default_factory=LoRAConfig)
    source_checkpoint_uri: str = ""
    restore_optimizer: bool = False
    labels: RunLabels = field(default_factory=RunLabels)
    optimizer: str = ""


@dataclass(frozen=True)
class SamplingRunSpec:
    """A new sampling run: the base model, or a sampler checkpoint on it. It is attributed to
    `training_run_id` when given (one of the key's training runs), else to the training run that
    saved its checkpoint: its usage counts there."""

    base_model: str = ""
    source_checkpoint_uri: str = ""
    training_run_id: str = ""


# ---------------------------------------------------------------------------- training events
@dataclass(frozen=True)
class InitByUri:
    """A run's weights: fresh from `lora`, or loaded from `checkpoint_uri` (a saved state or named
    weights; with `load_optimizer`, its optimizer state too, of the run's optimizer family)."""

    lora: LoRAConfig
    base_model: str = ""  # as the client names it (a model name or model_id); "" = the run's model
    checkpoint_uri: str = ""
    load_optimizer: bool = False


@dataclass(frozen=True)
class SaveByName:
    """kind "state" (weights + optimizer, to resume training), "weights" (a sampler) or "external"
    (the merged model as a Hugging Face directory, for download: Tinker's save_weights_external).
    visibility TEMPORARY keeps weights in memory only, for `ttl_seconds` (default 6 h).
    inflight (weights only): also publish them as the run's inflight target, which every sampler
    made from an inflight save of the run follows (service/inflight.py)."""

    kind: str
    name: str
    visibility: str = "WORKSPACE"
    ttl_seconds: int | None = None
    overwrite: bool = False
    inflight: bool = False


TrainingCommand = InitByUri | Forward | OptimStep | SaveByName | EndRun | Refused
