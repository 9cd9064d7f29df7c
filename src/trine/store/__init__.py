"""Persistent state: the SQLite database (WAL) and checkpoint files under `$TRINE_HOME`."""

from .db import Store
from .keys import generate_key, hash_key
from .owner import DataDirInUse
from .records import ApiKey, Checkpoint, EventRecord, MetricPoint, SamplingRun, Session, Timing, TrainingRun

__all__ = [
    "Store",
    "DataDirInUse",
    "generate_key",
    "hash_key",
    "ApiKey",
    "Checkpoint",
    "EventRecord",
    "MetricPoint",
    "SamplingRun",
    "Session",
    "Timing",
    "TrainingRun",
]
