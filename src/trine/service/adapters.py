"""The sampler-adapter cache: which checkpoints' weights each replica holds, and spilling to disk.

Each replica keeps at most `max_adapters` sampler adapters in memory, and at most
`max_full_weights` of them full fine-tuning snapshots (each a copy of the model, with a sampler and
KV pool of its own), least recently used evicted first. A TEMPORARY weights save lives only in the
memory of the replica that trained it (published by its cycle); before such a snapshot is evicted it
is written to disk (spilled), so a sampler made from it keeps working and any replica can load it
from then on.

Invariants
- A checkpoint id is loaded at most once at a time per replica: concurrent samplers of the same
  checkpoint await the one load.
- An evicted in-memory snapshot is on disk (and its record has a path) before any later request
  for it is served, or its waiters see it gone (`checkpoint_unavailable`).
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging

from ..engine.api import FULL_RANK, EngineLost, LoRAConfig
from ..engine.trainer.checkpoint import by_uri
from ..store import Checkpoint, Store
from .callbacks import OnLoop, Spawn
from .errors import Conflict
from .models import Replica

log = logging.getLogger("trine.service")


class AdapterCache:
    def __init__(
        self, *, store: Store, max_adapters: int, spawn: Spawn, on_loop: OnLoop, max_full_weights: int = 2
    ):
        self.store = store
        self.max_adapters = max_adapters
        self.max_full_weights = max_full_weights
        self._spawn = spawn  # runs a coroutine in the background (the service's task set)
        self._on_loop = on_loop  # runs a function on the event loop (now, if called from it)

    def remember(self, rep: Replica, checkpoint_id: str) -> None:
        """Record that `rep` holds the checkpoint's weights; evict the least recently used."""
        ck = self.store.checkpoint(checkpoint_id)
        rep.adapters[checkpoint_id] = ck is not None and ck.lora_rank == FULL_RANK
        rep.adapters.move_to_end(checkpoint_id)
        while len(rep.adapters) > self.max_adapters:
            self._start_eviction(rep, next(iter(rep.adapters)), spill=True)
        full = [c for c, is_full in rep.adapters.items() if is_full]
        for c in full[: max(len(full) - self.max_full_weights, 0)]:
            self._start_eviction(rep, c, spill=True)

    def _start_eviction(self, rep: Replica, checkpoint_id: str, spill: bool) -> None:
        """Until the eviction is done, requests for the checkpoint wait for it, then load it anew."""
        rep.adapters.pop(checkpoint_id, None)
        fut = rep.loading[checkpoint_id] = asyncio.get_running_loop().create_future()
        self._spawn(self._evict(rep, checkpoint_id, fut, spill))

    def holders(self, replicas: list[Replica], checkpoint_id: str) -> list[Replica]:
        return [
            r for r in replicas if r.alive and (checkpoint_id in r.adapters or checkpoint_id in r.loading)
        ]

    def forget(self, replicas: list[Replica], checkpoint_id: str) -> None:
        """The checkpoint was deleted: free its weights everywhere (no spill). Callable from any
        thread (a sync endpoint); the cache itself changes only on the event loop."""

        def forget():
            for rep in replicas:
                if checkpoint_id in rep.adapters:
                    self._start_eviction(rep, checkpoint_id, spill=False)

        self._on_loop(forget)

    async def ensure(self, rep: Replica, checkpoint_id: str) -> None:
        """Make `rep` hold the checkpoint's sampler weights (loading them from disk if needed)."""
        while checkpoint_id in rep.loading:  # a load or eviction in progress: wait for it
            await asyncio.shield(rep.loading[checkpoint_id])
        if checkpoint_id in rep.adapters:
            rep.adapters.move_to_end(checkpoint_id)
            return
        ck = self.store.checkpoint(checkpoint_id)
        if ck is None or not ck.path:
            raise Conflict(
                "the checkpoint behind this sampler is gone (expired, deleted, or a temporary "
                "snapshot lost in a server restart); create a sampler from a saved checkpoint",
                code="checkpoint_unavailable",
            )
        fut = rep.loading[checkpoint_id] = asyncio.get_running_loop().create_future()
        try:
            await rep.engine.load_adapter(checkpoint_id, ck.path)
        except EngineLost:
            fut.set_result(False)
            raise
        except Exception as e:
            fut.set_result(False)
            raise Conflict(
                f"checkpoint {ck.uri} could not be loaded: {by_uri(str(e), ck.path, ck.uri)}",
                code="checkpoint_invalid",
            ) from None
        finally:
            rep.loading.pop(checkpoint_id, None)
        fut.set_result(True)
        self.remember(rep, checkpoint_id)

    async def ensure_on_disk(self, holder: Replica, checkpoint_id: str) -> None:
        """Give the checkpoint files every replica can load: a snapshot only `holder` has in memory
        is written out (spilled) first."""
        ck = self.store.checkpoint(checkpoint_id)
        if ck is not None and not ck.path:
            await self._spill(holder, ck)

    async def _evict(self, rep: Replica, checkpoint_id: str, fut: asyncio.Future, spill: bool) -> None:
        try:
            ck = self.store.checkpoint(checkpoint_id)
            if spill and ck is not None and not ck.path:  # only in memory: write it out first
                await self._spill(rep, ck)
            await rep.engine.evict_adapter(checkpoint_id)
        except Exception:  # the replica is gone or stopping: its memory went with it
            log.debug("could not evict %s", checkpoint_id)
        finally:
            if rep.loading.get(checkpoint_id) is fut:
                rep.loading.pop(checkpoint_id)
            fut.set_result(False)  # waiters load it from disk (or find it gone)

    async def _spill(self, rep: Replica, ck: Checkpoint) -> None:
        path = str(self.store.checkpoint_dir / ck.api_key_id / ck.training_run_id / "weights" / ck.name)
        # the spilled file's metadata names the seed the adapter was made with: 0 when the run gave none
        lora = dataclasses.replace(LoRAConfig.named_by(ck), seed=ck.seed or 0)
        try:
            size = await rep.engine.spill_adapter(ck.id, lora, path)
        except Exception as e:
            log.error("could not write temporary checkpoint %s to disk: %s", ck.uri, e)
            return
        if self.store.checkpoint(ck.id) is not None:
            self.store.update_checkpoint(ck.id, path=path, size_bytes=size)
