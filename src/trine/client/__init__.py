"""The trine SDK: ServiceClient, TrainingClient, SamplingClient, RestClient and their futures."""

from ..errors import (
    ActorAPIError,
    AuthError,
    ControlAPIError,
    EventFailedError,
    RunBrokenError,
    TrineError,
    ValidationError,
)
from .futures import APIFuture
from .http import Settings
from .rest import RestClient
from .sampling import SamplingClient
from .service import ServiceClient, configure
from .traced_loss import TracedLoss, custom_loss
from .training import TrainingClient

__all__ = [
    "APIFuture",
    "ActorAPIError",
    "AuthError",
    "ControlAPIError",
    "EventFailedError",
    "RestClient",
    "RunBrokenError",
    "SamplingClient",
    "ServiceClient",
    "Settings",
    "TracedLoss",
    "TrainingClient",
    "TrineError",
    "ValidationError",
    "configure",
    "custom_loss",
]
