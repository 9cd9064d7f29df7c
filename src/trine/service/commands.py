"""What a front end may ask the service to do: neutral, frozen commands.

Front ends (`server/`) parse their wire bodies into these and nothing else; they never build
engine requests or ops. The service checks a command against the caller, the run and the model,
then translates it into engine requests and ops in one place (`translate.py`). No part of the
service changes a command: facts it resolves (a checkpoint's path, a save's URI, the parsed loss,
the gradient denominator) go into the engine op it builds.

| command | asked through | becomes |
|---|---|---|
| `TrainingRunSpec`, `SamplingRunSpec`, `RunLabels` | `Runs.create_session` / `create_training_run` / `create_sampling_run` | a session or run record |
| `InitRun`, `Forward`, `OptimStep`, `Save`, `EndRun`, `Refused` | `Events.submit` | an engine op in a clock cycle |
| `SampleSpec` | `Sampling.sample` / `sample_stream` | an engine `SampleRequest` |

Field names are the service's own; a front end maps its protocol's names onto them (and names its
wire fields in the errors it raises itself).
"""
from __future__ import annotations

from dataclasses import dataclass, field

from ..limits import END_RUN, FORWARD, FORWARD_BACKWARD, INIT_RUN, OPTIMIZE_STEP, REFUSED, SAVE_STATE, SAVE_WEIGHTS


# ---------------------------------------------------------------------------- runs
@dataclass(frozen=True)
class LoraSpec:
    """The LoRA adapter of a training run."""

    rank: int = 32
    seed: int | None = None
    train_mlp: bool = True
    train_attn: bool = True
    train_unembed: bool = True


@dataclass(frozen=True)
class RunLabels:
    """What a user calls a session or a training run: a name, tags and free metadata (strings).
    Protocols that carry only `user_metadata` put the name and tags there (`name`, and `tags`
    comma-separated); `service/labels.py` checks and merges them."""

    name: str = ""
    tags: tuple[str, ...] = ()
    user_metadata: dict = field(default_factory=dict)


@dataclass(frozen=True)
class TrainingRunSpec:
    """A new training run: on `base_model` with `lora`, or restored from a saved checkpoint (whose
    base model and LoRA shape it then takes; `lora.seed` still applies when given)."""

    base_model: str = ""
    lora: LoraSpec = field(default_factory=LoraSpec)
    source_checkpoint_uri: str = ""
    restore_optimizer: bool = False
    labels: RunLabels = field(default_factory=RunLabels)


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
class InitRun:
    """A run's weights: fresh from `lora`, or loaded from `checkpoint_uri` (a saved state or named
    weights; with `load_optimizer`, its AdamW state too)."""

    lora: LoraSpec
    base_model: str = ""  # as the client names it (a model name or model_id); "" = the run's model
    checkpoint_uri: str = ""
    load_optimizer: bool = False


@dataclass(frozen=True)
class TrainingDatum:
    """One training sequence. Targets are pre-shifted (position i predicts target_tokens[i]);
    -100 ignores a position. weights (cross_entropy), logprobs + advantages (policy losses) and
    sequence_ratio_mask (gspo) have one value per token."""

    tokens: list[int]
    target_tokens: list[int]
    weights: list[float] | None = None
    logprobs: list[float] | None = None
    advantages: list[float] | None = None
    sequence_ratio_mask: list[float] | None = None


@dataclass(frozen=True)
class GradientTotals:
    """The whole logical batch's counts, as a client that sends a batch in chunks declares them
    (PyTRIO's `gradient_accumulation`). `field` is where they came from: errors name it."""

    samples: int
    active_tokens: int
    advantage_tokens: int
    field: str = "gradient_accumulation"


@dataclass(frozen=True)
class Forward:
    """forward (backward=False) or forward_backward over `data` with a loss by name and config.

    normalise=False: the gradient is the plain sum of per-token losses (Tinker's contract).
    normalise=True: it is divided by the logical batch's token count (PyTRIO's): `totals` when the
    client sent them, else this chunk's own count (engine/normalisation.py has the rules)."""

    data: list[TrainingDatum]
    loss_fn: str = "cross_entropy"
    loss_config: dict = field(default_factory=dict)
    backward: bool = True
    auto_shift: bool = False  # the client's targets were labels: results shift back by one
    normalise: bool = False
    totals: GradientTotals | None = None


@dataclass(frozen=True)
class OptimStep:
    """AdamW (torch.optim.AdamW semantics); grad_clip_norm 0 = no clipping."""

    learning_rate: float = 1e-4
    beta1: float = 0.9
    beta2: float = 0.95
    eps: float = 1e-12
    weight_decay: float = 0.0
    grad_clip_norm: float = 0.0


@dataclass(frozen=True)
class Save:
    """kind "state" (weights + optimizer, to resume training) or "weights" (a sampler).
    visibility TEMPORARY keeps weights in memory only, for `ttl_seconds` (default 6 h).
    inflight (weights only): also publish them as the run's inflight target, which every sampler
    made from an inflight save of the run follows (service/inflight.py)."""

    kind: str
    name: str
    visibility: str = "WORKSPACE"
    ttl_seconds: int | None = None
    overwrite: bool = False
    inflight: bool = False


@dataclass(frozen=True)
class EndRun:
    reason: str = ""


@dataclass(frozen=True)
class Refused:
    """Takes an event index whose request its front end refused: the event fails with this error,
    so the client's later events (numbered after it) do not wait for it."""

    code: str
    message: str


TrainingCommand = InitRun | Forward | OptimStep | Save | EndRun | Refused


def event_type(command: TrainingCommand) -> str:
    """The event type a command is stored and ordered as (`limits.EVENT_TYPES` or REFUSED)."""
    if isinstance(command, Forward):
        return FORWARD_BACKWARD if command.backward else FORWARD
    if isinstance(command, Save):
        return SAVE_STATE if command.kind == "state" else SAVE_WEIGHTS
    return {InitRun: INIT_RUN, OptimStep: OPTIMIZE_STEP, EndRun: END_RUN, Refused: REFUSED}[type(command)]


# ---------------------------------------------------------------------------- sampling
@dataclass(frozen=True)
class SampleSpec:
    """A sampling request. `generate=False` is compute_logprobs: prompt logprobs only, no decoding.
    Prompt-logprob requests read the prefix cache only before `prompt_logprobs_last_n` (and before
    the first row of `target_prompt_ids` naming an id). `fingerprint` identifies the request
    body: a retry with the same `request_id` must match it ("" = unchecked)."""

    request_id: str
    prompt: list[int]
    max_tokens: int
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1  # -1: off
    seed: int | None = None
    stop_strings: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    stop_at_eos: bool = True
    top_logprobs: int = 0  # also return the k most likely tokens at each sampled position
    num_samples: int = 1
    prompt_logprobs: bool = False
    topk_prompt_logprobs: int = 0
    generate: bool = True
    fingerprint: str = ""
    prompt_logprobs_last_n: int | None = None  # score only the last n prompt entries
    prompt_alt_tokens_k: int = 0  # k draws at every prompt entry after the first
    target_prompt_ids: list[list[int]] | None = None  # row i: token ids to score at prompt entry i + 1
    grammar: str = ""  # constrained decoding: a grammar from service/grammars.py; "" = none
