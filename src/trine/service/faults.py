"""Lost engine replicas: what the service does when one dies (docs/ray.md).

Each replica is watched (`Engine.lost()` returns only when it is gone); a call that raises
`EngineLost` reports the loss too, whichever comes first.

Invariants
- At once: every event queued or running on the replica fails with `worker_lost`; its training
  runs become INTERRUPTED (restorable from their saved states on another replica); TEMPORARY
  snapshots that only it held are forgotten; nothing is routed or placed there again.
- Usage stays exact: failed events are never metered; a sample request in flight there is retried
  on another replica and metered once, when it succeeds.
"""

from __future__ import annotations

import logging

from ..store import Store
from .events import Events
from .models import Replica, ServedModel

log = logging.getLogger("trine.service")


class Faults:
    def __init__(self, *, store: Store, events: Events):
        self.store = store
        self.events = events
        self.stopping = False  # set by Service.stop: replicas going away then are not faults

    async def watch(self, m: ServedModel, rep: Replica) -> None:
        try:
            reason = await rep.engine.lost()
        except Exception as e:  # the watch itself failed: the engine cannot be reached
            reason = f"{type(e).__name__}: {e}"
        if not self.stopping:
            self.lost(m, rep, reason)

    def lost(self, m: ServedModel, rep: Replica, reason: str) -> None:
        if not rep.alive or self.stopping:
            return
        rep.alive = False
        log.error("engine replica %d of %s lost: %s", rep.index, m.name, reason)
        message = (
            f"engine replica {rep.index} of {m.name} was lost ({reason}) while this event was "
            "queued or running; restore the run from a saved state "
            "(create_training_client_from_state) and send it again"
        )
        for live in list(self.events.live.values()):
            if live.replica is rep:
                self.events.fail(live, "worker_lost", message)
        for run_id in list(rep.runs):
            if rep.scheduler is not None:
                rep.scheduler.drop(run_id)
            run = self.store.training_run(run_id)
            if run is not None and run.status == "ACTIVE":
                self.store.update_training_run(run_id, status="INTERRUPTED")
        held_elsewhere = {ck for r in m.replicas if r.alive for ck in r.adapters}
        for ck_id in list(rep.adapters):
            ck = self.store.checkpoint(ck_id)
            if ck is not None and not ck.path and ck_id not in held_elsewhere:
                self.store.delete_checkpoint(ck_id)  # its only copy was in that replica's memory
        rep.adapters.clear()
