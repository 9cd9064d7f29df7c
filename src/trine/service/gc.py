"""Garbage collection: what a restart left behind, expired checkpoints (any whose TTL has passed), idle
training runs.

Invariants
- After a restart, every event that was accepted but not finished is failed (`server_restarted`),
  runs that were live are INTERRUPTED (their in-memory weights are gone), and TEMPORARY snapshots
  that were only in memory are forgotten.
- A run is ended for idleness only when nothing of it is queued or running.
"""

from __future__ import annotations

import asyncio
import logging
import time

from ..store import Store
from .activity import Activity
from .checkpoints import Checkpoints
from .events import Events
from .models import ServedModel
from .runs import Runs

log = logging.getLogger("trine.service")


class GarbageCollector:
    def __init__(
        self,
        *,
        store: Store,
        models: dict[str, ServedModel],
        checkpoints: Checkpoints,
        runs: Runs,
        events: Events,
        activity: Activity,
        run_idle_seconds: float,
    ):
        self.store = store
        self.models = models
        self.checkpoints = checkpoints
        self.runs = runs
        self.events = events
        self.activity = activity
        self.run_idle_seconds = run_idle_seconds

    def recover(self) -> None:
        """After a restart: fail what was in flight, mark live runs interrupted, forget lost weights."""
        self.events.fail_unfinished_after_restart()
        runs, _ = self.store.training_runs(status="ACTIVE")
        for r in runs:
            self.store.update_training_run(r.id, status="INTERRUPTED")
        cks, _ = self.store.checkpoints(visibility="TEMPORARY")
        for ck in cks:
            if not ck.path:
                self.store.delete_checkpoint(ck.id)

    async def loop(self, interval: float) -> None:
        while True:
            await asyncio.sleep(interval)
            try:
                await self.collect()
            except Exception:
                log.exception("garbage collection failed")

    async def collect(self) -> None:
        """Delete checkpoints past their time to live (temporary snapshots have one by default, saves
        one set at save time or later); end training runs silent for too long."""
        for ck in self.checkpoints.expired(time.time()):
            self.checkpoints.forget(ck)
        idle = time.monotonic() - self.run_idle_seconds
        runs, _ = self.store.training_runs(status="ACTIVE")
        for r in runs:
            m = self.models.get(r.base_model)
            rep = m.placement.get(r.id) if m else None
            q = rep.scheduler.queues.get(r.id) if rep and rep.scheduler else None
            busy = (q is not None and q.waiting) or self.events.busy(r.id)
            if not busy and self.activity.last(r.id) < idle:
                await self.runs.end_training_run(r, "ENDED")
