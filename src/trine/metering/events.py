"""What metering records: one usage event per engine call, one diagnostic per cache-unfriendly prompt.

Invariants: for every event, prompt tokens = prefill + prefill_cached; `train <= train_sequence`
(a prefix shared by several datums is computed once) and `train_loss <= train_sequence`. Image
tokens are prompt tokens: `prefill_image <= prefill` and `prefill_image_cached <= prefill_cached`
count the vision tokens among them, which the rate card may price apart.
A report's totals are sums over these events, nothing else.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

PHASES = (
    "prefill",
    "prefill_cached",
    "sample",
    "train",
    "train_loss",
    "train_sequence",
    "prefill_image",
    "prefill_image_cached",
)
IMAGE_PHASES = {"prefill_image": "prefill", "prefill_image_cached": "prefill_cached"}  # part of -> whole
OPERATIONS = ("sample", "compute_logprobs", "forward", "forward_backward", "optim_step")
PATTERNS = ("retokenized_history", "varying_head", "split_group")  # CacheDiagnostic.pattern values


@dataclass
class UsageEvent:
    time: float  # unix seconds
    api_key_id: str
    session_id: str
    run_id: str  # training run or sampling run id
    base_model: str
    operation: str  # one of OPERATIONS
    request_id: str = ""
    prefill: int = 0  # prompt tokens computed
    prefill_cached: int = 0  # prompt tokens served from the prefix cache
    sample: int = 0  # generated tokens, all samples
    train: int = 0  # training positions computed (forward or forward_backward): what is priced
    train_loss: int = 0  # positions with non-zero weight or advantage
    # positions of the sequences as sent ("the entire sequence"); more than `train` when datums share
    # a prefix that was computed once. 0 (or absent, in events stored before it) means `train`.
    train_sequence: int = 0
    prefill_image: int = 0  # of `prefill`, the images' vision tokens
    prefill_image_cached: int = 0  # of `prefill_cached`, the images' vision tokens
    # a full fine-tuning run's event: its `train` tokens are priced from the rate card's `:full` row
    full_fine_tuning: bool = False

    def __post_init__(self):
        if not self.train_sequence:
            self.train_sequence = self.train
        for part in IMAGE_PHASES:  # events stored before images have none
            if getattr(self, part) is None:
                setattr(self, part, 0)
        if self.operation not in OPERATIONS:
            raise ValueError(f"UsageEvent.operation must be one of {OPERATIONS}, got {self.operation!r}")
        for phase in PHASES:
            n = getattr(self, phase)
            if not isinstance(n, int) or isinstance(n, bool) or n < 0:
                raise ValueError(f"UsageEvent.{phase} must be a non-negative int, got {n!r}")
        for part, whole in IMAGE_PHASES.items():
            if getattr(self, part) > getattr(self, whole):
                raise ValueError(
                    f"UsageEvent.{part} ({getattr(self, part)}) exceeds {whole} ({getattr(self, whole)}): "
                    "image tokens are prompt tokens"
                )
        if self.train > self.train_sequence:
            raise ValueError(
                f"UsageEvent.train ({self.train}) exceeds train_sequence ({self.train_sequence}): "
                "a position is computed at most once"
            )
        if self.train_loss > self.train_sequence:
            raise ValueError(
                f"UsageEvent.train_loss ({self.train_loss}) exceeds train_sequence ({self.train_sequence}): "
                "loss positions are a subset of the positions sent"
            )

    @classmethod
    def from_counts(cls, *, prompt_tokens: int, prefill: int, prefill_cached: int, **fields) -> UsageEvent:
        """An event from an engine's counters, checking prompt = prefill (computed) + prefill_cached."""
        if prompt_tokens != prefill + prefill_cached:
            raise ValueError(
                f"usage does not add up: prompt_tokens={prompt_tokens} but prefill={prefill} + "
                f"prefill_cached={prefill_cached}; the engine must count every prompt token once"
            )
        return cls(prefill=prefill, prefill_cached=prefill_cached, **fields)

    @classmethod
    def from_dict(cls, d: dict) -> UsageEvent:
        return cls(**{k: d[k] for k in cls.__dataclass_fields__ if k in d})

    @property
    def prompt_tokens(self) -> int:
        return self.prefill + self.prefill_cached

    def to_dict(self) -> dict:
        return asdict(self)


@dataclass
class CacheDiagnostic:
    """A sampling prompt that missed the prefix cache for a reason the user can fix.

    pattern: "retokenized_history" (the prompt's text continues an earlier prompt + completion, but its
    tokens diverge from the sampler's real tokens), "varying_head" (prompts repeatedly share a head,
    then diverge right after it: varying content placed before fixed content) or "split_group" (the same
    prompt sent again as another request of one sample instead of one request with num_samples).
    """

    time: float
    api_key_id: str
    session_id: str
    run_id: str
    base_model: str
    pattern: str
    diverge_position: int  # first token index where the prompt differs from the earlier one
    tokens_lost: int  # prompt tokens that had to be prefilled because of it
    request_id: str = ""

    @classmethod
    def from_dict(cls, d: dict) -> CacheDiagnostic:
        return cls(**{k: d[k] for k in cls.__dataclass_fields__ if k in d})

    def to_dict(self) -> dict:
        return asdict(self)
