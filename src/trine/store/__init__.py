"""Persistent state: the SQLite database (WAL) and checkpoint files under `$TRINE_HOME`."""

from .db import Store
from .keys import generate_key, hash_key
from .records import ApiKey, Checkpoint, EventRecord, MetricPoint, SamplingRun, Session, Timing, TrainingRun

__all__ = [
    "Store",
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
