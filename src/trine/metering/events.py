"""What metering records: one usage event per engine call, one diagnostic per cache-unfriendly prompt.

Invariants: for every event, prompt tokens = prefill + prefill_cached; `train_loss <= train`.
A report's totals are sums over these events, nothing else.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass

PHASES = ("prefill", "prefill_cached", "sample", "train", "train_loss")
OPERATIONS = ("sample", "compute_logprobs", "forward", "forward_backward", "optim_step")


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
    train: int = 0  # every computed training position (forward or forward_backward)
    train_loss: int = 0  # positions with non-zero weight or advantage

    @property
    def prompt_tokens(self) -> int:
        return self.prefill + self.prefill_cached

    def to_dict(self) -> dict:
        return asdict(self)


@dataclass
class CacheDiagnostic:
    """A sampling prompt that missed the prefix cache for a reason the user can fix.

    pattern: "retokenized_history" (the prompt's text continues an earlier prompt + completion, but its
    tokens diverge from the sampler's real tokens) or "varying_head" (prompts repeatedly share a head,
    then diverge right after it: varying content placed before fixed content).
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

    def to_dict(self) -> dict:
        return asdict(self)
