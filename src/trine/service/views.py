"""Read-side views: what `Queries` returns to front ends, as plain dataclasses.

The stored records (API keys, sessions, runs, checkpoints, events) are the store's own plain
dataclasses, re-exported here so front ends read them without reaching the store; every other
view is built by the service from its live state (models, engine replicas, clock cycles).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from ..engine.api import VisionSpec
from ..store import ApiKey, Checkpoint, EventRecord, SamplingRun, Session, TrainingRun
from .cycle_tally import CycleTally

__all__ = [
    "ApiKey",
    "Checkpoint",
    "EventRecord",
    "SamplingRun",
    "Session",
    "TrainingRun",
    "ModelView",
    "SessionView",
    "CycleView",
    "ReplicaStats",
]


@dataclass(frozen=True)
class ModelView:
    """A served base model and its limits. `model_id` is what PyTRIO and Tinker clients see: a
    local directory they can load the tokenizer from."""

    name: str
    model_id: str
    architecture: str | None  # the config's model_type (llama, qwen3, ...); None until the engines start
    vocab_size: int  # 0 until the engines start (so is max_seq_len)
    max_seq_len: int
    replicas: int
    vision: VisionSpec | None = None  # how it reads images (engine/images.py); None: text only


@dataclass(frozen=True)
class SessionView:
    session: Session
    training_run_ids: list[str]
    sampling_run_ids: list[str]


@dataclass(frozen=True)
class CycleView:
    """One recent clock cycle of a replica. Key isolation: `runs` names only the asking key's own
    training runs; the others are only counted (`other_runs`)."""

    number: int
    seconds: float
    events: int
    runs: list[str]
    other_runs: int


@dataclass(frozen=True)
class ReplicaStats:
    """One engine replica of a served model, as far as the asking key may see it. `sampler` holds
    the engine's KV pool and prefix-cache counters (blocks_total, blocks_used, blocks_cached,
    blocks_free, block_size, cache_hit_blocks, cache_queried_blocks, cache_evictions, requests,
    prompt/prefill/cached/sample token totals, waiting, running). `error` is set, and the engine
    figures are empty, when the replica is lost or did not answer."""

    model: str
    replica: int
    alive: bool
    cycle: int  # the last clock cycle started there
    train_runs_waiting: int
    train_events_waiting: int
    error: str | None = None
    where: str = ""  # "local", or the Ray actor's node / id
    sampler: dict = field(default_factory=dict)
    engine_jobs: int = 0  # training cycles and adapter loads waiting for the engine thread
    training_runs: int = 0  # held: adapters + optimizer state
    sampler_adapters: int = 0
    cycles: list[CycleView] = field(default_factory=list)  # newest first
    inflight_samples: int = 0  # sample requests the service sent there and that have not finished
    cycle_tally: CycleTally | None = None  # every cycle it ran since the server started
    kernels: dict = field(default_factory=dict)  # op -> the path it takes (fused_ops, paged_attention, gemm)
