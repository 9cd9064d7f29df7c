"""The training operations an event asks for, already validated and free of any wire format."""
from __future__ import annotations

from dataclasses import dataclass, field

from ..engine.model import LoRAConfig
from ..engine.requests import AdamConfig, TrainDatum

INIT_RUN = "trainer.init_run"
FORWARD = "trainer.forward"
FORWARD_BACKWARD = "trainer.forward_backward"
OPTIMIZE_STEP = "trainer.optimize_step"
SAVE_STATE = "trainer.save_state"
SAVE_WEIGHTS = "trainer.save_weights"
END_RUN = "trainer.end_run"
EVENT_TYPES = (INIT_RUN, FORWARD, FORWARD_BACKWARD, OPTIMIZE_STEP, SAVE_STATE, SAVE_WEIGHTS, END_RUN)
# Not a wire type: a front end whose client has already numbered a request it then refused (Tinker's
# seq_ids) queues this in its place, so later indexes still run; it fails with the refusal.
REFUSED = "trine.refused"


@dataclass
class InitRun:
    lora: LoRAConfig
    base_model: str = ""  # as the client names it (a model name or model_id); "" = the run's model
    checkpoint_uri: str = ""
    load_optimizer: bool = False
    checkpoint_path: str = ""  # resolved by the service from checkpoint_uri


@dataclass
class Forward:
    """forward (backward=False) or forward_backward. `data` targets are pre-shifted; with
    `auto_shift` the wire targets were labels and results are shifted back by one position."""

    data: list[TrainDatum]
    loss_fn: str
    loss_config: dict = field(default_factory=dict)
    backward: bool = True
    auto_shift: bool = False

    @property
    def tokens(self) -> int:
        return sum(len(d.tokens) for d in self.data)


@dataclass
class OptimStep:
    adam: AdamConfig


@dataclass
class Save:
    """save_state (kind "state": weights + optimizer) or save_weights (kind "weights": a sampler)."""

    kind: str
    name: str
    visibility: str = "WORKSPACE"  # or TEMPORARY: kept in memory, no file written
    ttl_seconds: int | None = None
    overwrite: bool = False
    # assigned by the service when it accepts the event:
    uri: str = ""
    checkpoint_id: str = ""
    path: str = ""  # target directory ("" for TEMPORARY weights: kept in memory)


@dataclass
class EndRun:
    reason: str = ""


@dataclass
class Refused:
    code: str
    message: str


Op = InitRun | Forward | OptimStep | Save | EndRun | Refused
