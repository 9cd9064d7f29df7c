"""When each training run last showed life (an event or a heartbeat), for idle collection (gc.py)."""

from __future__ import annotations

import time


class Activity:
    def __init__(self):
        self._last: dict[str, float] = {}

    def touch(self, run_id: str) -> None:
        self._last[run_id] = time.monotonic()

    def last(self, run_id: str) -> float:
        return self._last.get(run_id, 0.0)

    def forget(self, run_id: str) -> None:
        self._last.pop(run_id, None)
