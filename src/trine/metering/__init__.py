"""Metering: usage events by phase, the rate card, reports, estimates and prefix-cache diagnostics.

Knows nothing of torch. The HTTP router (`metering.http`) and the server client (`metering.remote`) are
imported on their own, so importing this package pulls in neither FastAPI nor httpx.
"""

from .diagnostics import PrefixDiagnostics
from .estimate import Estimate, JobShape, estimate
from .events import OPERATIONS, PATTERNS, PHASES, CacheDiagnostic, UsageEvent
from .rates import ModelPrices, RateCard
from .report import PhaseTokens, Report, ReportRow, build_report

__all__ = [
    "PrefixDiagnostics",
    "Estimate",
    "JobShape",
    "estimate",
    "OPERATIONS",
    "PATTERNS",
    "PHASES",
    "CacheDiagnostic",
    "UsageEvent",
    "ModelPrices",
    "RateCard",
    "PhaseTokens",
    "Report",
    "ReportRow",
    "build_report",
]
