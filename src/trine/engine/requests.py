"""Plain dataclasses that cross the service <-> engine boundary.

They are serialisable (ints, floats, strings, lists) except for the live `Adapter` handle, which
stays inside the engine, so they cross a process boundary (a Ray replica) unchanged (see
docs/architecture.md, "The engine interface"). Usage counters always satisfy
`prompt_tokens == prefill_tokens + cached_tokens`.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from ..limits import GREEDY_BELOW_TEMPERATURE, check_stops
from .lora import Adapter


@dataclass(frozen=True)
class WeightsIdentity:
    """Which weights produced a KV entry: the root of every prefix-cache chain.

    Two requests may share cached KV only if all three fields are equal.
    """

    base_model: str
    adapter: str | None = None  # adapter id: a training run's live adapter or a saved snapshot
    version: int = 0  # bumped by every optim_step of a live adapter, every save of an inflight target


@dataclass(frozen=True)
class SamplingOptions:
    max_tokens: int
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1  # -1: disabled
    seed: int | None = None
    stop_strings: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    stop_at_eos: bool = True
    top_logprobs: int = 0  # also return the k most likely tokens at each sampled position
    grammar: str = ""  # constrained decoding: an llguidance grammar (engine/grammar.py); "" = none

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_BELOW_TEMPERATURE

    def check_stops(self) -> None:
        """Stop lists are bounded (every decode step checks them): ValueError naming the limit."""
        check_stops(self.stop_strings, self.stop_token_ids)


@dataclass
class SampleRequest:
    request_id: str
    prompt: list[int]
    options: SamplingOptions
    weights: WeightsIdentity
    adapter: Adapter | None = None  # the weights named by `weights.adapter`; None = base model
    num_samples: int = 1
    prompt_logprobs: bool = False  # reads the prefix cache only before `prompt_logprobs_last_n`
    topk_prompt_logprobs: int = 0
    generate: bool = True  # False: compute_logprobs (prompt logprobs only, no decoding)
    stream: bool = False  # report each decode step's new tokens as a SampleDelta
    prompt_logprobs_last_n: int | None = None  # score only the last n prompt entries (logprobs, top-k)
    prompt_alt_tokens_k: int = 0  # k draws at every prompt entry after the first (prompt_scores.py)
    target_prompt_ids: list[list[int]] | None = None  # row i: token ids to score at prompt entry i + 1
    # weights.adapter names an inflight target (a training run's moving weights): the engine
    # resolves its current version on arrival and every step reads the target's current weights
    inflight: bool = False
    tenant: str = ""  # who asked (the caller's API key id): admission and prefill are fair across tenants


@dataclass
class SampleUsage:
    prompt_tokens: int = 0
    prefill_tokens: int = 0  # computed
    cached_tokens: int = 0  # served from the prefix cache
    sample_tokens: int = 0  # generated, all samples together


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

    Concatenating a sequence's deltas in order gives exactly its SampledSequence tokens, logprobs
    and top_logprobs (and weights_versions). Its last delta has `stop_reason` and `text`: the
    sequence's whole final text (cut before a stop string, without a stop token), as in
    SampledSequence.text."""

    request_id: str
    sequence: int  # sample index within the request
    tokens: list[int]
    logprobs: list[float]
    top_logprobs: list[list[tuple[int, float]]] | None = None
    stop_reason: str | None = None
    text: str | None = None
    weights_versions: list[int] | None = None  # inflight requests: as in SampledSequence


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


@dataclass
class TrainDatum:
    """One training sequence. Targets are pre-shifted: position i predicts target_tokens[i].

    target_tokens entries are -100 (ignored) or a vocabulary id. weights (cross_entropy) or
    logprobs + advantages (policy losses) have the same length as tokens; so does
    sequence_ratio_mask (gspo: the positions whose log-ratios make the sequence ratio).
    """

    tokens: list[int]
    target_tokens: list[int]
    weights: list[float] | None = None
    logprobs: list[float] | None = None
    advantages: list[float] | None = None
    sequence_ratio_mask: list[float] | None = None


@dataclass
class TrainUsage:
    train_tokens: int = 0  # every computed position (a prefix shared by datums of one run: once)
    sequence_tokens: int = 0  # every position of the sequences as sent
    loss_tokens: int = 0  # positions with a non-zero weight or advantage


@dataclass
class ForwardResult:
    """Per-datum target logprobs and elementwise losses, plus the summed metrics."""

    logprobs: list[list[float]]
    losses: list[list[float]]
    loss_sum: float
    token_count: int
    usage: TrainUsage = field(default_factory=TrainUsage)

    @property
    def loss_mean(self) -> float:
        return self.loss_sum / self.token_count if self.token_count else 0.0


@dataclass(frozen=True)
class AdamConfig:
    """torch.optim.AdamW semantics; grad_clip_norm 0 = no clipping."""

    learning_rate: float = 1e-4
    beta1: float = 0.9
    beta2: float = 0.95
    eps: float = 1e-12
    weight_decay: float = 0.0
    grad_clip_norm: float = 0.0
