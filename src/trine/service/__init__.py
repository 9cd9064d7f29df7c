"""The protocol-free service core, one module per concept (see core.py for the map)."""
from .core import Service
from .errors import Conflict, InvalidRequest, NotFound, ServiceError, TooLarge, TooManyRequests, Unauthorized
from .events import EventResult
from .models import Replica, ServedModel
from .sampling import SampleOutcome, SampleSpec, SequenceOutcome

__all__ = ["Service", "ServedModel", "Replica", "SampleSpec", "SampleOutcome", "SequenceOutcome",
           "EventResult", "ServiceError", "InvalidRequest", "NotFound", "Conflict", "Unauthorized",
           "TooLarge", "TooManyRequests"]
