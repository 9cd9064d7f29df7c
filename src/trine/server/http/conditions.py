"""One log line per condition, not per occurrence.

A misbehaving client can trigger the same warning thousands of times a second (idle connections,
a request that hits the same bug). `ConditionLog.report(condition, ...)` logs a condition the first
time it happens and then at most once per `every` seconds, with how many times it happened since.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass


@dataclass
class _Seen:
    logged_at: float
    since: int = 0  # occurrences not logged yet
    total: int = 1


class ConditionLog:
    def __init__(self, logger: logging.Logger, every: float = 600.0):
        self.logger = logger
        self.every = every
        self._seen: dict[str, _Seen] = {}
        self._lock = threading.Lock()

    def report(
        self, condition: str, message: str, *args, level: int = logging.WARNING, exc_info=None
    ) -> bool:
        """Log `message % args` if `condition` is new or was last logged `every` seconds ago.
        Returns whether a line was written."""
        now = time.monotonic()
        with self._lock:
            seen = self._seen.get(condition)
            if seen is None:
                self._seen[condition] = _Seen(now)
                suffix = ""
            elif now - seen.logged_at < self.every:
                seen.since += 1
                seen.total += 1
                return False
            else:
                suffix = f" ({seen.since + 1} times in the last {now - seen.logged_at:.0f} s)"
                seen.logged_at, seen.since = now, 0
                seen.total += 1
        self.logger.log(level, message + suffix, *args, exc_info=exc_info)
        return True

    def count(self, condition: str) -> int:
        """How many times `condition` happened."""
        with self._lock:
            seen = self._seen.get(condition)
            return seen.total if seen else 0
