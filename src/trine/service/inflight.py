"""Inflight targets: the moving weights a training run's inflight samplers follow.

An inflight weights save (`Save(inflight=True)`) publishes the snapshot as the run's *target* on
the replica that trained it, at the next version (1, 2, ...: one per inflight save, so a save with
no optimizer step in between still gets a new version), and records the checkpoint with that
version. A sampling run made from such a checkpoint is inflight: it names the target (the training
run id) and the least version it may use, the checkpoint's. Its requests run on a replica holding
the target at that version or newer; other replicas get each new version from disk (the in-memory
snapshot is spilled first), pushed to every replica that holds the target as soon as the save
settles, or pulled by the first request routed there.

Invariants
- A request of an inflight sampling run runs on weights at least as new as the save that made the
  sampling run (Tinker's inflight contract); each token's outcome names the version that produced it.
- A replica's target version only grows (`Replica.targets`); publications run in version order per
  replica (one lock per replica and run).
- When the training run ends its target is dropped on every replica; its inflight samplers then
  answer `run_ended`.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass

from ..engine.api import EngineLost
from ..store import SamplingRun, Store
from .adapters import AdapterCache
from .callbacks import Spawn
from .errors import Conflict
from .models import Replica, ServedModel

log = logging.getLogger("trine.service")


@dataclass
class Target:
    version: int  # of the run's latest inflight save
    checkpoint_id: str  # that save's checkpoint
    replica: Replica  # the replica that trained it (holds it in memory)


class Inflight:
    def __init__(self, *, store: Store, adapters: AdapterCache, spawn: Spawn):
        self.store = store
        self.adapters = adapters
        self._spawn = spawn  # runs a coroutine in the background
        self.targets: dict[str, Target] = {}  # training run id -> its latest inflight save
        self._locks: dict[tuple[int, str], asyncio.Lock] = {}  # (replica, run) -> publication order

    def published(self, m: ServedModel, run_id: str, rep: Replica, version: int, checkpoint_id: str) -> None:
        """An inflight save of `run_id` settled on `rep` (whose engine already moved the target):
        remember it, and push it to the other replicas that hold the target."""
        self.targets[run_id] = Target(version, checkpoint_id, rep)
        rep.targets[run_id] = max(rep.targets.get(run_id, 0), version)
        for other in m.live_replicas():
            if other is not rep and run_id in other.targets:
                self._spawn(self._push(other, run_id, version))

    async def _push(self, rep: Replica, run_id: str, version: int) -> None:
        try:
            await self._ensure(rep, run_id, version)
        except Exception as e:  # the replica or the run is gone; a later request pulls it again
            log.debug("could not publish %s v%d on replica %d: %s", run_id, version, rep.index, e)

    async def ensure(self, rep: Replica, r: SamplingRun) -> None:
        """Make `rep` hold the inflight target of sampling run `r` at its version or newer."""
        try:
            await self._ensure(rep, r.inflight_run_id, r.inflight_version)
        except EngineLost:
            raise
        except ValueError as e:  # the engine no longer holds what the target named
            raise Conflict(
                f"the inflight weights of training run {r.inflight_run_id} could not be "
                f"loaded ({e}); sample again",
                code="checkpoint_unavailable",
            ) from None

    async def _ensure(self, rep: Replica, run_id: str, version: int) -> None:
        if rep.targets.get(run_id, 0) >= version:
            return
        lock = self._locks.setdefault((rep.index, run_id), asyncio.Lock())
        async with lock:
            t = self.targets.get(run_id)
            if t is None:
                raise Conflict(
                    f"training run {run_id} has ended: its inflight weights are gone; create "
                    "a sampling client from a saved checkpoint",
                    code="run_ended",
                )
            if rep.targets.get(run_id, 0) >= version:
                return
            if rep is not t.replica:
                await self.adapters.ensure_on_disk(t.replica, t.checkpoint_id)
            await self.adapters.ensure(rep, t.checkpoint_id)
            await rep.engine.publish_target(run_id, t.version, t.checkpoint_id)
            rep.targets[run_id] = max(rep.targets.get(run_id, 0), t.version)

    async def forget(self, m: ServedModel, run_id: str) -> None:
        """The training run ended: drop its target everywhere (its own replica drops it with the run)."""
        t = self.targets.pop(run_id, None)
        for rep in m.replicas:
            held = rep.targets.pop(run_id, None)
            self._locks.pop((rep.index, run_id), None)
            if held is not None and rep.alive and (t is None or rep is not t.replica):
                try:
                    await rep.engine.drop_run(run_id)
                except Exception:  # the replica is stopping or lost
                    log.debug("could not drop target %s on replica %d", run_id, rep.index)
