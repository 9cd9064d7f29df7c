"""What the service stores and answers, protocol-neutral: the results of training events and sample
requests (a sample stream yields the engine's own `SampleDelta`s). Each front end shapes them on read, so a
retry or
long-poll gets the same answer as the first call.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field

import msgpack

from ..engine.api import SampledSequence
from ..store import EventRecord


@dataclass
class EventResult:
    """A terminal event's result. `checkpoint` (saves): uri, checkpoint_id, kind, size_bytes,
    base_model."""

    status: str  # "succeeded" or "failed"
    error: dict | None = None  # {"code", "message"}
    logprobs: list[list[float]] | None = None
    losses: list[list[float]] | None = None
    metrics: dict = field(default_factory=dict)
    checkpoint: dict | None = None
    train_tokens: int = 0  # computed
    loss_tokens: int = 0
    train_sequence_tokens: int = 0  # as sent (0 in results stored before it: train_tokens)
    cost: float = 0.0
    cycle: int | None = None
    notes: dict = field(default_factory=dict)  # the front end's, kept for shaping its answer

    def pack(self) -> bytes:
        return msgpack.packb(asdict(self), use_bin_type=True)

    @classmethod
    def unpack(cls, data: bytes) -> "EventResult":
        return cls(**msgpack.unpackb(data, raw=False))

    @classmethod
    def of(cls, rec: EventRecord) -> "EventResult | None":
        """The terminal result of `rec`, or None while it is accepted or running."""
        return cls.unpack(rec.response) if rec.response is not None else None

    @classmethod
    def failure(cls, code: str, message: str, cycle: int | None = None) -> "EventResult":
        return cls("failed", {"code": code, "message": message}, cycle=cycle)


@dataclass
class SampleOutcome:
    """A finished sample request. usage: prompt_tokens, prefill_tokens, cached_tokens,
    sample_tokens (prompt_tokens == prefill_tokens + cached_tokens)."""

    request_id: str
    sampling_run: str
    model: str
    sequences: list[SampledSequence]
    prompt_logprobs: list[float | None] | None
    topk_prompt_logprobs: list[list[tuple[int, float]] | None] | None
    usage: dict[str, int]
    cost: float
    replica: int = 0
    prompt_alt_tokens: list[list[int]] | None = None  # [len(prompt) - 1][k], when asked for
    prompt_alt_logprobs: list[list[float]] | None = None
    target_prompt_logprobs: list[list[float]] | None = None  # one per asked target id

    def to_json(self) -> bytes:
        return json.dumps(asdict(self)).encode()

    @classmethod
    def from_json(cls, data: bytes) -> "SampleOutcome":
        d = json.loads(data)
        d["sequences"] = [SampledSequence(**s) for s in d["sequences"]]
        return cls(**d)
