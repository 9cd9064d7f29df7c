"""Training operations and one clock cycle of them, as they cross the engine interface.

Plain dataclasses (ints, floats, strings, lists, LoRA/Adam configs, a parsed `Loss`): no wire
format, no live objects, so a cycle pickles to another process (a Ray replica) unchanged. The
service builds them from its commands once every fact is resolved (checkpoint paths, URIs, the
parsed loss, the gradient denominator); nothing changes an op after it is built.

A `TrainingCycle` holds, per training run, its events of this cycle split by phase (`RunShare`);
the engine answers with one `EventOutcome` per event id (`CycleResult`).
"""
from __future__ import annotations

from dataclasses import dataclass, field

from ..limits import (END_RUN, EVENT_TYPES, FORWARD, FORWARD_BACKWARD, INIT_RUN, OPTIMIZE_STEP,  # noqa: F401
                      SAVE_STATE, SAVE_WEIGHTS)
from .losses import Loss
from .lora import LoRAConfig
from .requests import AdamConfig, TrainDatum


@dataclass(frozen=True)
class InitRun:
    """A fresh LoRA adapter (`checkpoint_path` empty) or a run's saved state loaded from a directory
    (`checkpoint_uri` names it in error messages)."""

    lora: LoRAConfig
    checkpoint_path: str = ""
    load_optimizer: bool = False
    checkpoint_uri: str = ""


@dataclass(frozen=True)
class Forward:
    """forward (backward=False) or forward_backward. `data` targets are pre-shifted; with
    `auto_shift` the client's targets were labels and results are shifted back by one position."""

    data: list[TrainDatum]
    loss: Loss
    backward: bool = True
    auto_shift: bool = False
    denominator: float | None = None  # divides the gradient (engine/normalisation.py); None = plain sum

    @property
    def tokens(self) -> int:
        return sum(len(d.tokens) for d in self.data)


@dataclass(frozen=True)
class OptimStep:
    adam: AdamConfig


@dataclass(frozen=True)
class Save:
    """save_state (kind "state": weights + optimizer) or save_weights (kind "weights": a sampler).

    A weights save also publishes the snapshot to the engine's adapter table under `checkpoint_id`,
    so samplers can use it at once (one kept in memory only, `path` "", never touches the disk).
    An inflight one (`inflight`) also publishes it as the run's inflight target (target id = the
    run id) at the next version, which the outcome reports (`weights_version`)."""

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
    """Holds the index of a request its front end refused (see limits.REFUSED): fails with this."""

    code: str
    message: str


Op = InitRun | Forward | OptimStep | Save | EndRun | Refused


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

    def events(self) -> list[CycleEvent]:
        return self.pre + self.forward + self.optim + self.post


@dataclass
class TrainingCycle:
    number: int
    runs: dict[str, RunShare]  # training run id -> its share of this cycle


@dataclass
class EventOutcome:
    """What one event produced, protocol-neutral. Failed: `error` is (code, message)."""

    error: tuple[str, str] | None = None
    logprobs: list[list[float]] | None = None  # forward: per datum, per position (target logprob)
    losses: list[list[float]] | None = None  # forward: per datum, per position (elementwise loss)
    metrics: dict[str, float] = field(default_factory=dict)
    train_tokens: int = 0  # positions computed
    train_sequence_tokens: int = 0  # positions of the sequences as sent (>= train_tokens: shared prefixes)
    loss_tokens: int = 0
    size_bytes: int = 0  # saves: bytes written (or held in memory for a TEMPORARY snapshot)
    weights_version: int = 0  # inflight saves: the target version they published


@dataclass
class CycleResult:
    number: int
    outcomes: dict[str, EventOutcome]  # event id -> outcome; every event of the cycle has one
    seconds: float = 0.0
