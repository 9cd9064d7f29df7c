"""Metrics a user logs for a training run (`log_metrics({"reward": r}, step=n)`): checked, stored
per run, read back as series and last values.

Invariants
- Only the key that owns a run logs to it or reads it (another key's run is a NotFound). A run
  that ended still takes metrics: a script often logs its last values after its last step.
- A name matches METRIC_NAME; a value is a finite number (not a bool); a step is an integer in
  0..INT64_MAX; one call carries at most MAX_METRICS_PER_CALL values, and a run holds at most
  MAX_POINTS_PER_RUN points. Anything else is an InvalidRequest naming the field and the fix.
- The same (run, step, name) logged again replaces the earlier value.
"""

from __future__ import annotations

import math
import re
import time

from ..limits import INT64_MAX
from ..store import ApiKey, MetricPoint, Store
from .errors import InvalidRequest, TooManyRequests
from .ownership import Ownership

METRIC_NAME = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_./:-]{0,127}$")
MAX_METRICS_PER_CALL = 256
MAX_POINTS_PER_RUN = 1_000_000


class Metrics:
    def __init__(self, *, store: Store, ownership: Ownership):
        self.store = store
        self.ownership = ownership

    def log(self, key: ApiKey, run_id: str, step, values) -> list[MetricPoint]:
        """Store `values` (name -> number) at `step` of the key's training run `run_id`."""
        r = self.ownership.training_run(key, run_id)
        if isinstance(step, bool) or not isinstance(step, int) or not 0 <= step <= INT64_MAX:
            raise InvalidRequest(
                f"step: {step!r} is not an integer in 0..{INT64_MAX}; pass step=n, the "
                "training step the values belong to"
            )
        if not isinstance(values, dict) or not values:
            raise InvalidRequest(
                'values: send a non-empty object of metric name -> number, e.g. {"reward": 0.5}'
            )
        if len(values) > MAX_METRICS_PER_CALL:
            raise InvalidRequest(
                f"values: {len(values)} metrics in one call; at most {MAX_METRICS_PER_CALL} are allowed"
            )
        now = time.time()
        points = []
        for name, value in values.items():
            if not isinstance(name, str) or not METRIC_NAME.match(name):
                raise InvalidRequest(
                    f"values: metric name {str(name)[:80]!r} is invalid: use letters, digits "
                    "and _ . / : - (at most 128 characters, not starting with a symbol)"
                )
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
                raise InvalidRequest(
                    f"values.{name}: {value!r} is not a finite number; log a float "
                    "(convert tensors with float(x))"
                )
            points.append(MetricPoint(r.id, key.id, step, name, float(value), now))
        if self.store.count_metrics(r.id) + len(points) > MAX_POINTS_PER_RUN:
            raise TooManyRequests(
                f"training run {r.id} holds {MAX_POINTS_PER_RUN:,} metric points, the most "
                "one run keeps; log less often or start a new run",
                code="metrics_limit",
            )
        self.store.add_metrics(points)
        return points

    def series(self, key: ApiKey, run_id: str) -> dict[str, list[tuple[int, float]]]:
        """Every metric the run logged: name -> [(step, value)] by step (names sorted)."""
        r = self.ownership.training_run(key, run_id)
        out: dict[str, list[tuple[int, float]]] = {}
        for p in self.store.metrics(r.id):
            out.setdefault(p.name, []).append((p.step, p.value))
        return dict(sorted(out.items()))

    def last(self, key: ApiKey, run_id: str) -> dict[str, float]:
        """Each metric's value at the highest step it was logged at."""
        return self.store.last_metrics(self.ownership.training_run(key, run_id).id)
