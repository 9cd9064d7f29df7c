"""The engine's API: every type that crosses the service <-> engine seam, and nothing else.

One vocabulary for every layer. Front ends build these payloads (a `TrainDatum`, `SamplingOptions`,
an `AdamConfig` or a `DimuonConfig`, a `SampleRequest`), the service resolves what only it knows
(weights, checkpoint paths, a save's target, the gradient denominator) with `dataclasses.replace`,
and the engine runs them. Results (`SampleResult`, `SampleDelta`, `EventOutcome`) come back in the
same vocabulary and the service stores them as they are. The service keeps a command of its own
only where the meaning differs (service/commands.py: a save by name, an init from a checkpoint URI).

Invariants
- Plain dataclasses of ints, floats, strings, lists and each other, built with keywords: no torch,
  no live objects, no closures. They pickle to a Ray replica unchanged. This module imports nothing
  from torch (tests/test_layering.py checks it).
- Usage is exact: `prompt_tokens == prefill_tokens + cached_tokens` for every SampleUsage.
- Images travel as `ImageInput`s (engine/images.py, re-exported here; its docstring is the contract
  the sampler and trainer follow): a prompt's or datum's tokens hold their placeholders.
- A `Forward` reaches the trainer prepared (`engine/prepare.py`): every datum validated against the
  model, counted once (`counts`), the denominator resolved. The trainer trusts it.
"""

from __future__ import annotations

import json
import math
from dataclasses import KW_ONLY, dataclass, field

from ..limits import (
    END_RUN,
    FORWARD,
    FORWARD_BACKWARD,
    FULL_RANK,
    GREEDY_BELOW_TEMPERATURE,
    INIT_RUN,
    OPTIMIZE_STEP,
    REFUSED,
    SAVE_STATE,
    SAVE_WEIGHTS,
)
from ..tokens import TokenCounts
from .images import (  # noqa: F401  (image inputs: part of the vocabulary; the contract is ImageInput's)
    ImageInput,
    ImagesNotServed,
    PromptImage,
    VisionSpec,
    mask_image_targets,
    placeholders_to_pieces,
    read_model_input,
)
from .loss_graph import (  # noqa: F401  (custom losses: part of the vocabulary)
    MAX_INPUT_ELEMENTS,
    CustomLoss,
    LossTensor,
    parse_custom_loss,
)

# ---------------------------------------------------------------------------- weights


@dataclass(frozen=True)
class WeightsIdentity:
    """Which weights produced a KV entry: the root of every prefix-cache chain. Two requests may
    share cached KV only if all three fields are equal."""

    base_model: str
    adapter: str | None = None  # a training run's live adapter, a snapshot's checkpoint id, or a target
    version: int = 0  # bumped by every optim_step of a live adapter and every save of an inflight target


LORA_ATTN = ("q_proj", "k_proj", "v_proj", "o_proj")
LORA_MLP = ("gate_proj", "up_proj", "down_proj")
LORA_UNEMBED = ("lm_head",)
# A linear-attention layer's projections (Qwen3.5's Gated DeltaNet), PEFT's names: targets with train_attn.
LORA_LINEAR_ATTN = ("in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a", "out_proj")


@dataclass(frozen=True)
class LoRAConfig:
    """A training run's shape: a LoRA adapter (target names are PEFT's), or with `rank` 0
    (`FULL_RANK`) full-parameter fine-tuning, which trains the model's own weights
    (engine/trainer/full.py): the attention layers with `train_attn`, the MLPs with `train_mlp`,
    the embedding and the head with `train_unembed`, the norms always; `trainable_token_indices`
    (full runs only) restricts the embedding and head to those rows, for added tokens. `seed` None:
    the engine's default (0); a run restored from a checkpoint takes the checkpoint's shape, and
    `seed` still applies when given."""

    rank: int = 32
    alpha: float = 32.0
    train_attn: bool = True
    train_mlp: bool = True
    train_unembed: bool = True
    seed: int | None = None
    trainable_token_indices: tuple[int, ...] = ()

    def __post_init__(self):  # a list (JSON, a wire body) is the same shape as its tuple
        object.__setattr__(self, "trainable_token_indices", tuple(self.trainable_token_indices))

    @classmethod
    def named_by(cls, source) -> LoRAConfig:
        """The shape a wire body, a run or a checkpoint record names: its `lora_rank` (or `rank`),
        its `seed` (None if it has none), its three `train_*` flags and its
        `trainable_token_indices` (a list, or a record's JSON text). The one conversion from the
        planes' and the store's names to this type."""
        rank = getattr(source, "lora_rank", None)
        return cls(
            rank=source.rank if rank is None else rank,
            seed=getattr(source, "seed", None),
            train_mlp=source.train_mlp,
            train_attn=source.train_attn,
            train_unembed=source.train_unembed,
            trainable_token_indices=token_indices(getattr(source, "trainable_token_indices", None)),
        )

    @property
    def full(self) -> bool:
        """Full-parameter fine-tuning: no adapter, the model's own weights train."""
        return self.rank == FULL_RANK

    @property
    def scale(self) -> float:
        if self.full:
            raise ValueError("a full fine-tuning run (rank 0) has no LoRA scale")
        return self.alpha / self.rank

    def target_names(self) -> tuple[str, ...]:
        """The module names an adapter of this shape targets; a model has some of them (a dense
        model no linear-attention layer, whose projections `train_attn` targets too)."""
        return (
            (LORA_ATTN + LORA_LINEAR_ATTN if self.train_attn else ())
            + (LORA_MLP if self.train_mlp else ())
            + (LORA_UNEMBED if self.train_unembed else ())
        )


def token_indices(value) -> tuple[int, ...]:
    """`trainable_token_indices` as a tuple, from a list, a tuple, a record's JSON text or None."""
    if value is None or value == "":
        return ()
    if isinstance(value, str):
        value = json.loads(value)
    return tuple(value)


@dataclass(frozen=True)
class FullTuningShape:
    """What full-parameter fine-tuning of one model costs, counted before a run starts (torch-free,
    so the service admits a run against a replica's budget without asking the engine).

    Parameters are counted by group (engine/trainer/full.py `param_group`): `attn` (the attention
    layers), `mlp`, `norms` (every other body weight: the layer norms), `embed`, `head` (0 when
    tied to the embedding). `dtype_bytes` is the model's element size; optimizer state and masters
    are in the wide dtype (fp32, fp64 on an fp64 model). `budget_bytes`: what full runs together may
    hold on the replica (`EngineConfig.full_ft_memory_bytes`, or measured at its start)."""

    attn: int
    mlp: int
    norms: int
    embed: int
    head: int
    hidden_size: int
    dtype_bytes: int
    budget_bytes: int = 0
    snapshot_kv_bytes: int = (
        0  # the KV pool of a snapshot's sampler (SamplerConfig.full_weights_kv_cache_bytes)
    )

    @property
    def params(self) -> int:
        return self.attn + self.mlp + self.norms + self.embed + self.head

    def trainable(self, shape: LoRAConfig) -> tuple[int, int]:
        """Elements that train (whole tensors, token rows): the rows of a `trainable_token_indices`
        run are its embedding's and its untied head's rows at those ids."""
        whole = self.norms + (self.attn if shape.train_attn else 0) + (self.mlp if shape.train_mlp else 0)
        if shape.trainable_token_indices:
            tables = 1 + (self.head > 0)
            return whole, len(shape.trainable_token_indices) * self.hidden_size * tables
        return whole + ((self.embed + self.head) if shape.train_unembed else 0), 0

    def run_bytes(self, shape: LoRAConfig) -> int:
        """Bytes a full run holds from its start to its end: its own weights (model dtype), one
        sampler snapshot of them with its KV pool, and for what trains its gradients, AdamW's two
        moments and, where the model's dtype is narrower than the wide one or only rows train, an
        fp32 master copy."""
        wide = max(self.dtype_bytes, 4)
        whole, rows = self.trainable(shape)
        masters = rows + (whole if self.dtype_bytes < wide else 0)
        weights = 2 * self.params * self.dtype_bytes + self.snapshot_kv_bytes
        return weights + (3 * (whole + rows) + masters) * wide


# ---------------------------------------------------------------------------- sampling


@dataclass(frozen=True)
class SamplingOptions:
    """How each sample is drawn and when it stops. Checked once, by the front end that parsed it."""

    max_tokens: int
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1  # -1: off
    seed: int | None = None
    stop_strings: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    stop_at_eos: bool = True
    top_logprobs: int = 0  # also return the k most likely tokens at each sampled position
    grammar: str = ""  # constrained decoding: an llguidance grammar (engine/sampler/grammar.py); "" = none
    # penalties and biases (vLLM's semantics; engine/sampler/sampling.py), each off by default
    _: KW_ONLY
    presence_penalty: float = 0.0  # subtracted from the logit of each token the sample has generated
    frequency_penalty: float = 0.0  # subtracted once per time the sample has generated the token
    repetition_penalty: float = 1.0  # tokens of the prompt or the sample: logit / p if > 0, else * p
    min_p: float = 0.0  # drop tokens less likely than min_p x the most likely one (after temperature)
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, added to its logit)

    @property
    def adjusts_logits(self) -> bool:
        """Whether penalties or biases change the logits (and so the logprobs) of its samples."""
        return bool(
            self.presence_penalty or self.frequency_penalty or self.repetition_penalty != 1 or self.logit_bias
        )

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_BELOW_TEMPERATURE


@dataclass(frozen=True)
class SampleRequest:
    """One sampling request: `num_samples` sequences from `prompt`, or (generate=False,
    compute_logprobs) the prompt's logprobs only.

    A front end builds it with the client's `request_id` and no weights; the service gives it an
    engine-wide id, the sampling run's `weights` and the caller's `tenant` before the engine sees it.
    With `inflight`, `weights.adapter` names an inflight target whose current version the engine
    uses, switching between steps when it moves. Prompt-logprob requests read the prefix cache only
    before `prompt_logprobs_last_n` (and before the first row of `target_prompt_ids` naming an id),
    unless `reuse_prompt_scores` lets cached blocks serve their scores too."""

    request_id: str
    prompt: list[int]
    options: SamplingOptions
    weights: WeightsIdentity | None = None
    num_samples: int = 1
    prompt_logprobs: bool = False
    topk_prompt_logprobs: int = 0
    generate: bool = True
    stream: bool = False  # report each decode step's new tokens as a SampleDelta
    prompt_logprobs_last_n: int | None = None  # score only the last n prompt entries
    prompt_alt_tokens_k: int = 0  # k draws at every prompt entry after the first (prompt_scores.py)
    target_prompt_ids: list[list[int]] | None = None  # row i: token ids to score at prompt entry i + 1
    # the prefix cache may serve prompt logprobs (and top-k) with the KV of blocks that carry them,
    # metered as cached (the OpenAI plane's scoring; PyTRIO and Tinker compute them every time)
    reuse_prompt_scores: bool = False
    inflight: bool = False
    tenant: str = ""  # the caller's API key id: admission and prefill are fair across tenants
    images: tuple[ImageInput, ...] = ()  # the prompt's images, their placeholders in `prompt`


@dataclass
class SampleUsage:
    prompt_tokens: int = 0
    prefill_tokens: int = 0  # computed
    cached_tokens: int = 0  # served from the prefix cache
    sample_tokens: int = 0  # generated, all samples together
    image_tokens: int = 0  # of prefill_tokens, the prompt images' vision tokens
    cached_image_tokens: int = 0  # of cached_tokens, the prompt images' vision tokens
    # wall-clock unix seconds (0: not reached) when the engine began computing the prompt and when it
    # had all of it (decoding follows): a session trace's prefill span. Timing, not usage: not compared.
    started_at: float = field(default=0.0, compare=False)
    prefilled_at: float = field(default=0.0, compare=False)


@dataclass
class SampledSequence:
    tokens: list[int]
    logprobs: list[float]
    text: str | None
    stop_reason: str  # "stop", "length", or "cancelled" (the request was cancelled while running)
    top_logprobs: list[list[tuple[int, float]]] | None = None  # per token, when options.top_logprobs
    # per token, the inflight target version whose weights computed its logits (inflight requests
    # only; None for fixed weights, whose every token is `weights.version`'s)
    weights_versions: list[int] | None = None


@dataclass
class SampleDelta:
    """What sample `sequence` of a streaming request gained in one engine step.

    Concatenating a sequence's deltas in order gives exactly its SampledSequence tokens, logprobs,
    top_logprobs and weights_versions. Its last delta has `stop_reason` and `text`: the sequence's
    whole final text (cut before a stop string, without a stop token), as in SampledSequence.text."""

    request_id: str
    sequence: int  # sample index within the request
    tokens: list[int]
    logprobs: list[float]
    top_logprobs: list[list[tuple[int, float]]] | None = None
    stop_reason: str | None = None
    text: str | None = None
    weights_versions: list[int] | None = None


@dataclass
class SampleResult:
    request_id: str
    sequences: list[SampledSequence]
    prompt_logprobs: list[float | None] | None
    usage: SampleUsage
    topk_prompt_logprobs: list[list[tuple[int, float]] | None] | None = None
    prompt_alt_tokens: list[list[int]] | None = None  # [len(prompt) - 1][k], when prompt_alt_tokens_k
    prompt_alt_logprobs: list[list[float]] | None = None  # their logprobs, same shape
    target_prompt_logprobs: list[list[float]] | None = None  # one per target_prompt_ids entry


class SampleCancelled(Exception):
    """The request was cancelled (its client went away) before it finished."""


# ---------------------------------------------------------------------------- training payloads


@dataclass
class TrainDatum:
    """One training sequence. Targets are pre-shifted: position i predicts target_tokens[i], and
    -100 ignores a position. weights (cross_entropy), logprobs + advantages (policy losses) and
    sequence_ratio_mask (gspo: the positions whose log-ratios make the sequence ratio) have one
    value per token."""

    tokens: list[int]
    target_tokens: list[int]
    weights: list[float] | None = None
    logprobs: list[float] | None = None
    advantages: list[float] | None = None
    sequence_ratio_mask: list[float] | None = None
    custom_inputs: dict[str, LossTensor] | None = None  # a custom loss's inputs by name
    images: tuple[ImageInput, ...] | None = None  # the datum's images, their placeholders in `tokens`


@dataclass(frozen=True)
class AdamConfig:
    """torch.optim.AdamW semantics; grad_clip_norm 0 = no clipping."""

    learning_rate: float = 1e-4
    beta1: float = 0.9
    beta2: float = 0.95
    eps: float = 1e-12
    weight_decay: float = 0.0
    grad_clip_norm: float = 0.0


ADAMW, DIMUON = "adamw", "dimuon"
OPTIMIZERS = (ADAMW, DIMUON)  # a training run's optimizer family, fixed when the run is made


@dataclass(frozen=True)
class DimuonConfig:
    """One step of Dimuon, Tinker's second optimizer (engine/trainer/dimuon.py has the update).

    Each LoRA matrix steps along a direction of Frobenius norm sqrt(rank): its momentum (an EMA of the
    gradients, `beta1`), balanced by damped row and column second moments, then orthogonalised. The
    step is `learning_rate` x (rank / 32) ** `rank_lr_correction_exponent` (0 turns the correction
    off). grad_clip_norm <= 0 = no clipping; there is no weight decay."""

    learning_rate: float
    beta1: float = 0.9
    grad_clip_norm: float = 0.0
    damping: float = 1e-4
    rank_lr_correction_exponent: float = 0.175

    def check(self) -> DimuonConfig:
        """Raise ValueError naming the DimuonParams field of a value out of its range."""
        for name, ok, rule in (
            ("learning_rate", lambda v: 0 <= v <= 10, "in [0, 10]"),
            ("beta1", lambda v: 0 <= v < 1, "in [0, 1)"),
            ("grad_clip_norm", lambda v: True, "finite"),
            ("damping", lambda v: 0 < v <= 1, "in (0, 1]"),
            ("rank_lr_correction_exponent", lambda v: -2 <= v <= 2, "in [-2, 2]"),
        ):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or not ok(v):
                raise ValueError(f"DimuonParams.{name} must be a finite number {rule}, got {v!r}")
        return self


def optimizer_of(params: AdamConfig | DimuonConfig) -> str:
    """The optimizer family a step's settings belong to."""
    return DIMUON if isinstance(params, DimuonConfig) else ADAMW


IGNORE_INDEX = -100
POLICY_LOSSES = ("importance_sampling", "ppo", "cispo", "dro", "gspo", "stable_reinforce")
LOSS_NAMES = ("cross_entropy",) + POLICY_LOSSES
LOSS_CONFIG_KEYS = {
    "cross_entropy": (),
    "importance_sampling": (),
    "ppo": ("clip_low_threshold", "clip_high_threshold"),
    "cispo": ("clip_low_threshold", "clip_high_threshold"),
    "dro": ("beta",),
    "gspo": ("clip_low_threshold", "clip_high_threshold"),
    "stable_reinforce": ("clip_high_threshold", "kl_coeff"),
}
_DEFAULT_CLIP_HIGH = {"stable_reinforce": 2.0}
ADVANTAGE_NORMALISED = ("dro",)  # divided by advantage tokens; every other loss by active tokens


@dataclass(frozen=True)
class Loss:
    """A loss by name with its resolved config (engine/trainer/losses.py computes it). Build it with
    `Loss.parse`, which names the field of any bad value. clip_low/clip_high are bounds on the
    ratio p/q, as in Tinker (0.8 and 1.2 clip at 1 -/+ 0.2), not epsilons."""

    name: str
    clip_low: float = 0.8
    clip_high: float = 1.2
    beta: float = 0.05
    kl_coeff: float = 0.0
    custom: CustomLoss | None = None  # name "custom": a client's graph (engine/loss_graph.py)

    @classmethod
    def of_custom(cls, custom: CustomLoss) -> Loss:
        """A custom loss: its gradient is the graph's, run by engine/trainer/custom_graph.py."""
        return cls("custom", custom=custom)

    @classmethod
    def parse(cls, name: str, config: dict | None = None) -> Loss:
        if not isinstance(name, str) or name.lower() not in LOSS_NAMES:
            raise ValueError(f"loss_fn {name!r} is not supported; use one of {', '.join(LOSS_NAMES)}")
        name = name.lower()
        config = dict(config or {})
        unknown = sorted(set(config) - set(LOSS_CONFIG_KEYS[name]))
        if unknown:
            allowed = ", ".join(LOSS_CONFIG_KEYS[name]) or "none"
            raise ValueError(f"loss_fn_config key(s) {unknown} are not used by {name} (allowed: {allowed})")
        values = {}
        for key, value in config.items():
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
                raise ValueError(f"loss_fn_config.{key} must be a finite number, got {value!r}")
            values[key] = float(value)
        loss = cls(
            name,
            clip_low=values.get("clip_low_threshold", 0.8),
            clip_high=values.get("clip_high_threshold", _DEFAULT_CLIP_HIGH.get(name, 1.2)),
            beta=values.get("beta", 0.05),
            kl_coeff=values.get("kl_coeff", 0.0),
        )
        if not 0.0 <= loss.clip_low <= 1.0:
            raise ValueError(
                "loss_fn_config.clip_low_threshold is a lower bound on the ratio p/q and must be "
                f"in [0, 1] (0.8 clips at 1 - 0.2), got {loss.clip_low}"
            )
        if loss.clip_high < 1.0:
            raise ValueError(
                "loss_fn_config.clip_high_threshold is an upper bound on the ratio p/q and must be "
                f">= 1 (1.2 clips at 1 + 0.2), got {loss.clip_high}"
            )
        if loss.beta < 0:
            raise ValueError(f"loss_fn_config.beta must be >= 0, got {loss.beta}")
        if loss.kl_coeff < 0:
            raise ValueError(f"loss_fn_config.kl_coeff must be >= 0, got {loss.kl_coeff}")
        return loss

    @property
    def is_policy(self) -> bool:
        return self.name in POLICY_LOSSES

    @property
    def sequence_level(self) -> bool:
        """True when a token's loss depends on the other tokens of its datum (gspo, custom)."""
        return self.name in ("gspo", "custom")


# ---------------------------------------------------------------------------- training ops


@dataclass(frozen=True)
class InitRun:
    """A fresh LoRA adapter (`checkpoint_path` empty) or a run's saved state loaded from a directory
    (`checkpoint_uri` names it in error messages), trained by the `optimizer` family."""

    lora: LoRAConfig
    checkpoint_path: str = ""
    load_optimizer: bool = False
    checkpoint_uri: str = ""
    optimizer: str = ADAMW  # one of OPTIMIZERS; a loaded optimizer state must be of this family


@dataclass(frozen=True)
class Forward:
    """forward (backward=False) or forward_backward over `data`, targets pre-shifted.

    normalise=False: the gradient is the plain sum of per-token losses (Tinker's contract).
    normalise=True: it is divided by the logical batch's count (PyTRIO's): `totals` when the client
    sent them (`totals_field` names where, for errors), else this chunk's own (engine/prepare.py).
    `counts` (one per datum) and `denominator` are filled in once, when the event is accepted."""

    data: list[TrainDatum]
    loss: Loss
    backward: bool = True
    normalise: bool = False
    totals: TokenCounts | None = None
    totals_field: str = "gradient_accumulation"
    counts: tuple[TokenCounts, ...] | None = None  # set by prepare_forward
    denominator: float | None = None  # set by prepare_forward when normalise; None = plain sum

    @property
    def tokens(self) -> int:
        return sum(len(d.tokens) for d in self.data)


@dataclass(frozen=True)
class OptimStep:
    """One optimizer step; `params` must be of the run's optimizer family (`optimizer_of`)."""

    params: AdamConfig | DimuonConfig


@dataclass(frozen=True)
class Save:
    """save_state (kind "state": weights + optimizer), save_weights (kind "weights": a sampler) or
    external weights (kind "external": the merged model as a Hugging Face directory, written by the
    code `trine export --merged` runs), to a resolved target.

    A weights save also publishes the snapshot to the engine's adapter table under `checkpoint_id`,
    so samplers can use it at once (one kept in memory only, `path` "", never touches the disk).
    An inflight one also publishes it as the run's inflight target (target id = the run id) at the
    next version, which the outcome reports (`weights_version`)."""

    kind: str
    checkpoint_id: str = ""
    path: str = ""  # target directory ("" for in-memory weights)
    uri: str = ""  # the checkpoint's name for people (logs, errors)
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
    shown_as: str = REFUSED  # the type its request came as: it is stored and answered as that type


Op = InitRun | Forward | OptimStep | Save | EndRun | Refused


def event_type(op) -> str:
    """The event type an op (or a service command, which names `kind` the same way) is stored as:
    one of `limits.EVENT_TYPES`, or REFUSED (a refused request's own type where it had one; the
    ordering takes any refused event alone, service/ordering.py)."""
    if isinstance(op, Forward):
        return FORWARD_BACKWARD if op.backward else FORWARD
    kind = getattr(op, "kind", None)
    if kind is not None:  # Save or a service save by name
        return SAVE_STATE if kind == "state" else SAVE_WEIGHTS
    if isinstance(op, OptimStep):
        return OPTIMIZE_STEP
    if isinstance(op, EndRun):
        return END_RUN
    if isinstance(op, Refused):
        return op.shown_as
    return INIT_RUN


@dataclass
class CycleEvent:
    event_id: str
    type: str  # one of EVENT_TYPES
    op: Op


@dataclass
class RunShare:
    """One run's events of a cycle by phase: pre (init/save before training), forward (forward and
    forward_backward), optim, post (saves after the step)."""

    pre: list[CycleEvent] = field(default_factory=list)
    forward: list[CycleEvent] = field(default_factory=list)
    optim: list[CycleEvent] = field(default_factory=list)
    post: list[CycleEvent] = field(default_factory=list)


@dataclass
class TrainingCycle:
    number: int
    runs: dict[str, RunShare]  # training run id -> its share of this cycle


@dataclass
class EventOutcome:
    """What one event produced. Failed: `error` is (code, message)."""

    error: tuple[str, str] | None = None
    logprobs: list[list[float]] | None = None  # forward: per datum, per position (target logprob)
    losses: list[list[float]] | None = None  # forward: per datum, per position (elementwise loss)
    metrics: dict[str, float] = field(default_factory=dict)
    train_tokens: int = 0  # positions computed (a prefix shared by several datums counts once)
    loss_tokens: int = 0
    train_sequence_tokens: int = 0  # positions of the datums as sent
    size_bytes: int = 0  # saves: bytes written (or held in memory for a TEMPORARY snapshot)
    weights_version: int = 0  # inflight saves: the target version they published
    # wall-clock unix seconds of the step that computed it within its cycle (a batched forward is one
    # step for all its events): a session trace's span
    started_at: float = 0.0
    ended_at: float = 0.0


@dataclass
class CycleResult:
    number: int
    outcomes: dict[str, EventOutcome]  # event id -> outcome; every event of the cycle has one
    seconds: float = 0.0
    started_at: float = 0.0  # wall-clock unix seconds when the engine began it


# ---------------------------------------------------------------------------- the engine itself


class EngineLost(RuntimeError):
    """The engine (a replica) died: its in-flight calls fail with this, and so does every new call."""

    code = "worker_lost"


@dataclass
class EngineInfo:
    name: str  # the base model's name
    model_dir: str
    vocab_size: int
    max_seq_len: int
    architecture: str = ""  # the config's model_type (llama, qwen3, ...)
    block_size: int = 16  # KV block size of its prefix cache (routing hashes whole blocks)
    device: str = "cpu"
    replica: str = "local"  # where it runs: "local" or the Ray actor's node / id
    lora_features: dict[str, int] = field(default_factory=dict)  # in + out features per LoRA target
    vision: VisionSpec | None = None  # how it reads images; None: a text-only model
    # (out, in) of every LoRA-targetable linear, by module name: what an imported adapter is checked against
    linear_shapes: dict[str, tuple[int, int]] = field(default_factory=dict)
    full_tuning: FullTuningShape | None = None  # what a full fine-tuning run costs on this replica


@dataclass
class CycleStats:
    number: int
    runs: list[str]  # the training runs it batched
    events: int
    seconds: float


@dataclass
class EngineStats:
    """A snapshot of one engine. `sampler` holds the KV pool and cache counters (blocks_total,
    blocks_used, blocks_cached, cache_hit_blocks, cache_queried_blocks, prompt/prefill/cached/sample
    token totals, waiting, running) and, for a hybrid model, its state slots and snapshots
    (state_slots_total/free, state_snapshots, state_snapshots_total, state_snapshot_hits,
    state_snapshot_evictions, state_bytes_per_sequence); for a model that takes images, its image
    token totals (image_tokens, cached_image_tokens) and its encoder's (image_encodes,
    image_encoder_hits, image_encoder_seconds, image_cache_bytes)."""

    name: str
    replica: str
    sampler: dict = field(default_factory=dict)
    queued_jobs: int = 0  # training cycles and adapter loads waiting for the thread
    pending_samples: int = 0  # sample requests admitted and not finished
    runs: int = 0  # training runs held (adapters + optimizer state)
    adapters: int = 0  # sampler adapters held
    recent_cycles: list[CycleStats] = field(default_factory=list)
    kernels: dict[str, str] = field(default_factory=dict)  # op -> its path (fused_ops, paged_attention, gemm)
