"""The protocol-free service core: sessions, runs, events, ordering and the clock-cycle scheduler."""
from .core import SampleSpec, ServedModel, Service
from .errors import Conflict, InvalidRequest, NotFound, ServiceError, TooLarge, TooManyRequests, Unauthorized

__all__ = ["Service", "ServedModel", "SampleSpec", "ServiceError", "InvalidRequest", "NotFound",
           "Conflict", "Unauthorized", "TooLarge", "TooManyRequests"]
