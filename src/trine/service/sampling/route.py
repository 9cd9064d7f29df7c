"""The route stage: which replica of its model serves a `SampleCall`.

Invariants
- A sampler made from a TEMPORARY snapshot that only one replica holds in memory (a checkpoint
  with no path) is served by a replica holding it.
- An inflight sampling run's requests go to replicas other than the one training its run, when
  the pool has more, so sampling overlaps training there (PipelineRL's and AReaL's split of
  inference and training workers).
- Anything else goes where `Router` (routing.py) sends it: prefix-aware, by the run's weights.
- The checkpoint record is read off the event loop (the store's one connection takes calls from any
  thread, under its lock); the replica is chosen after that read, on the loop, so the choice and
  the replica's load count (run.py) change in the same turn of the loop.
"""

from __future__ import annotations

import asyncio

from ...store import Store
from ..adapters import AdapterCache
from ..errors import Conflict
from ..models import Replica, ServedModel
from ..routing import Router
from .call import SampleCall, weights_name


class Routing:
    def __init__(self, *, store: Store, adapters: AdapterCache, router: Router):
        self.store = store
        self.adapters = adapters
        self.router = router

    async def replica(self, call: SampleCall) -> Replica:
        """The replica to serve `call` now (a 503 `worker_lost` if none of its model's is alive)."""
        r = call.run
        _live(call.model)
        in_memory = False
        if r.checkpoint_id and not r.inflight_run_id:
            ck = await asyncio.to_thread(self.store.checkpoint, r.checkpoint_id)
            in_memory = ck is not None and not ck.path  # held by the replica that trained it
        return self._choose(call, in_memory)

    def _choose(self, call: SampleCall, in_memory: bool) -> Replica:
        m, r = call.model, call.run
        live = _live(m)
        if in_memory:
            holders = self.adapters.holders(live, r.checkpoint_id)
            if holders:
                return holders[0]
        identity = f"{m.name}\0{weights_name(r) or ''}"
        replicas = m.replicas
        if r.inflight_run_id:  # sample beside the training, not on its replica (when the pool has more)
            trainer = m.placement.get(r.inflight_run_id)
            replicas = [rep for rep in live if rep is not trainer] or live
        return self.router.route(replicas, identity, call.req.prompt, m.info.block_size, call.req.images)


def _live(m: ServedModel) -> list[Replica]:
    live = m.live_replicas()
    if not live:
        raise Conflict(
            f"no engine replica of {m.name} is running; try again later", code="worker_lost", status=503
        )
    return live
