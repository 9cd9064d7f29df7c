"""The protocol-free service core, one module per concept (see core.py for the map): what front
ends may ask (commands), what they get back (results, views), and the `Service` that does it."""
from .commands import (EndRun, Forward, GradientTotals, InitRun, LoraSpec, OptimStep, Refused, RunLabels, SampleSpec,
                       SamplingRunSpec, Save, TrainingCommand, TrainingDatum, TrainingRunSpec, event_type)
from .core import Service
from .errors import Conflict, InvalidRequest, NotFound, ServiceError, TooLarge, TooManyRequests, Unauthorized
from .models import Replica, ServedModel
from .results import EventResult, SampleChunk, SampleOutcome, SequenceOutcome
from .tokenizers import ModelTokenizer
from .views import (ApiKey, Checkpoint, CycleView, EventRecord, ModelView, ReplicaStats, SamplingRun, Session,
                    SessionView, TrainingRun)

__all__ = ["Service", "ServedModel", "Replica",
           # commands
           "SampleSpec", "TrainingRunSpec", "SamplingRunSpec", "RunLabels", "LoraSpec", "InitRun", "TrainingDatum",
           "GradientTotals", "Forward", "OptimStep", "Save", "EndRun", "Refused", "TrainingCommand", "event_type",
           # results and views
           "EventResult", "SampleOutcome", "SequenceOutcome", "SampleChunk", "ModelTokenizer", "ModelView",
           "SessionView", "CycleView", "ReplicaStats", "ApiKey", "Checkpoint", "EventRecord", "SamplingRun",
           "Session", "TrainingRun",
           # errors
           "ServiceError", "InvalidRequest", "NotFound", "Conflict", "Unauthorized", "TooLarge", "TooManyRequests"]
