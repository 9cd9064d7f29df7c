"""The protocol-free service core, one module per concept (see core.py for the map): what front
ends may ask beyond the engine's vocabulary (commands), what they get back (results, views), and
the `Service` that does it. Payloads, ops and sample requests are `trine.engine.api`'s."""

from .commands import (
    InitByUri,
    RunLabels,
    SamplingRunSpec,
    SaveByName,
    SessionSearch,
    TrainingCommand,
    TrainingRunSpec,
)
from .core import Service
from .errors import Conflict, InvalidRequest, NotFound, ServiceError, TooLarge, TooManyRequests, Unauthorized
from .models import Replica, ServedModel
from .results import EventResult, SampleOutcome
from .tokenizers import ModelTokenizer
from .views import (
    ApiKey,
    Checkpoint,
    CycleView,
    EventRecord,
    ModelView,
    ReplicaStats,
    SamplingRun,
    Session,
    SessionView,
    TrainingRun,
)

__all__ = [
    "Service",
    "ServedModel",
    "Replica",
    # commands
    "SessionSearch",
    "TrainingRunSpec",
    "SamplingRunSpec",
    "RunLabels",
    "InitByUri",
    "SaveByName",
    "TrainingCommand",
    # results and views
    "EventResult",
    "SampleOutcome",
    "ModelTokenizer",
    "ModelView",
    "SessionView",
    "CycleView",
    "ReplicaStats",
    "ApiKey",
    "Checkpoint",
    "EventRecord",
    "SamplingRun",
    "Session",
    "TrainingRun",
    # errors
    "ServiceError",
    "InvalidRequest",
    "NotFound",
    "Conflict",
    "Unauthorized",
    "TooLarge",
    "TooManyRequests",
]
