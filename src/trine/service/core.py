"""The `Service` facade: the one object front ends use. It wires the service's parts together and
forwards each public call to the part that owns the concept:

| part | module | owns |
|---|---|---|
| `Ownership` | ownership.py | API keys; every lookup returns only the caller's objects |
| `Runs` | runs.py | sessions, training runs, sampling runs |
| `Events` | events.py | training events: ordering, idempotency, cycles, settling |
| `Sampling` | sampling.py | sample requests: routing, dedup, metering, stored outcomes |
| `AdapterCache` | adapters.py | sampler adapters per replica, spill to disk |
| `Checkpoints` | checkpoints.py | checkpoint records, deletion, downloads |
| `GarbageCollector` | gc.py | restart recovery, expiry, idle runs |
| `Faults` | faults.py | lost engine replicas |
| `Router` | routing.py | prefix-aware routing of samples across replicas |
| `ServedModel`, `Replica` | models.py | base models, engine replicas, run placement |

Runs on the asyncio loop; the engines (one per replica) are reached only through
`engine.interface.Engine`. Results are protocol-neutral (`SampleOutcome`, `EventResult`); the
front ends in `server/` shape them.
"""
from __future__ import annotations

import asyncio
import time
from pathlib import Path
from typing import AsyncIterator, Callable

from ..engine.interface import Engine, EngineStats
from ..engine.ops import Op
from ..metering.events import UsageEvent
from ..metering.rates import RateCard
from ..store import ApiKey, Checkpoint, EventRecord, Store
from .adapters import AdapterCache
from .checkpoints import Checkpoints
from .events import EventResult, Events
from .faults import Faults
from .gc import GarbageCollector
from .models import Replica, ServedModel, resolve_model
from .ownership import Ownership
from .routing import Router
from .runs import Activity, Runs
from .sampling import SampleOutcome, SampleSpec, Sampling
from .scheduler import ClockScheduler

EngineFactory = Callable[[str, Path], list[Engine]]  # (model name, dir) -> its replicas' engines


class Service:
    def __init__(self, store: Store, models: dict[str, str | Path], *, cycle_seconds: float = 0.0,
                 gather_seconds: float = 0.02, device: str | None = None,
                 num_threads: int | None = None, sampler_options: dict | None = None,
                 trainer_options: dict | None = None, max_adapters: int = 32,
                 run_idle_seconds: float = 3600.0, gc_interval: float = 60.0,
                 rate_card: RateCard | None = None, engines: EngineFactory | None = None,
                 router: Router | None = None):
        if not models:
            raise ValueError("models: serve at least one base model")
        self.store = store
        self.cycle_seconds = cycle_seconds
        self.gather_seconds = gather_seconds
        self.gc_interval = gc_interval
        if engines is None:
            from ..engine.local import LocalEngine

            def engines(name: str, path: Path) -> list[Engine]:
                return [LocalEngine(name, path, device=device, num_threads=num_threads,
                                    sampler_options=sampler_options, trainer_options=trainer_options)]
        self.models: dict[str, ServedModel] = {}
        for name, path in models.items():
            path = Path(path).resolve()
            reps = [Replica(i, e) for i, e in enumerate(engines(name, path))]
            self.models[name] = ServedModel(name, path, reps)
        self.rate_card = rate_card or RateCard.load(home=store.home)  # prices every usage event
        self._background: set[asyncio.Task] = set()  # fire-and-forget tasks, referenced until done
        self._gc_task: asyncio.Task | None = None
        self.loop: asyncio.AbstractEventLoop | None = None  # set by start()
        self.started_at = time.time()

        self.ownership = Ownership(store)
        self.activity = Activity()
        self.adapters = AdapterCache(store, max_adapters, self._spawn, self._on_loop)
        self.checkpoints = Checkpoints(store, self.ownership, self.models, self.adapters)
        self.events = Events(store, self.ownership, self.models, self.checkpoints, self.activity,
                             self.rate_card, self._replica_lost)
        self.faults = Faults(store, self.events)
        self.runs = Runs(store, self.ownership, self.models, self.checkpoints, self.activity,
                         self.events)
        self.sampling = Sampling(store, self.ownership, self.models, self.adapters, self.rate_card,
                                 self._spawn, self._replica_lost, router or Router())
        self.gc = GarbageCollector(store, self.models, self.checkpoints, self.runs, self.events,
                                   self.activity, run_idle_seconds)
        self.diagnostics = self.sampling.diagnostics

    # ================================================================== lifecycle
    async def start(self) -> None:
        self.loop = asyncio.get_running_loop()
        self.gc.recover()
        first_cycle = self.store.max_cycle()
        for m in self.models.values():
            infos = await asyncio.gather(*(rep.engine.start() for rep in m.replicas))
            m.info = infos[0]
            from ..engine.tokenizer import Tokenizer
            m.tokenizer = await self.loop.run_in_executor(None, Tokenizer, m.dir)
            for rep in m.replicas:
                rep.scheduler = ClockScheduler(self.events.executor(m, rep), cycle_seconds=self.cycle_seconds,
                                               gather_seconds=self.gather_seconds, first_cycle=first_cycle)
                rep.scheduler.start()
                self._spawn(self.faults.watch(m, rep))
        self._gc_task = self.loop.create_task(self.gc.loop(self.gc_interval))

    async def stop(self) -> None:
        self.faults.stopping = True
        if self._gc_task is not None:
            self._gc_task.cancel()
        for m in self.models.values():
            for rep in m.replicas:
                if rep.scheduler is not None:
                    await rep.scheduler.stop()
            await asyncio.gather(*(rep.engine.stop() for rep in m.replicas), return_exceptions=True)

    def _replica_lost(self, m: ServedModel, rep: Replica, reason: str) -> None:
        self.faults.lost(m, rep, reason)

    def _spawn(self, coro) -> None:
        task = asyncio.get_running_loop().create_task(coro)
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    def _on_loop(self, fn: Callable[[], None]) -> None:
        """Run `fn` on the event loop: now if called from it, soon if from another thread."""
        try:
            running = asyncio.get_running_loop()
        except RuntimeError:
            running = None
        if running is not None and running is self.loop:
            fn()
        elif self.loop is not None and not self.loop.is_closed():
            self.loop.call_soon_threadsafe(fn)

    # ================================================================== models
    def model(self, name_or_id: str) -> ServedModel:
        """Resolve a model name, its model_id (directory) or that directory's name."""
        return resolve_model(self.models, name_or_id)

    async def engine_stats(self) -> dict[str, list[EngineStats]]:
        """Per model, each live replica's stats (KV pool, cache counters, queues, recent cycles)."""
        out = {}
        for m in self.models.values():
            out[m.name] = list(await asyncio.gather(*(r.engine.stats() for r in m.live_replicas())))
        return out

    # ================================================================== ownership
    def authenticate(self, secret: str | None) -> ApiKey:
        return self.ownership.authenticate(secret)

    def key(self, key_id: str) -> ApiKey:
        return self.ownership.key(key_id)

    def session(self, key: ApiKey, session_id: str):
        return self.ownership.session(key, session_id)

    def training_run(self, key: ApiKey, run_id: str):
        return self.ownership.training_run(key, run_id)

    def sampling_run(self, key: ApiKey, run_id: str):
        return self.ownership.sampling_run(key, run_id)

    def checkpoint(self, key: ApiKey, checkpoint_id: str) -> Checkpoint:
        return self.ownership.checkpoint(key, checkpoint_id)

    def checkpoint_by_uri(self, key: ApiKey, uri: str) -> Checkpoint:
        return self.ownership.checkpoint_by_uri(key, uri)

    # ================================================================== sessions and runs
    def create_session(self, key: ApiKey, sdk_version: str = ""):
        return self.runs.create_session(key, sdk_version)

    async def close_session(self, key: ApiKey, session_id: str, status: str = "ENDED"):
        return await self.runs.close_session(key, session_id, status)

    def create_training_run(self, key: ApiKey, session_id: str, *, base_model: str, lora_rank: int,
                            train_mlp: bool = True, train_attn: bool = True, train_unembed: bool = True,
                            seed: int | None = None, source_checkpoint_uri: str = "",
                            restore_optimizer: bool = False):
        return self.runs.create_training_run(
            key, session_id, base_model=base_model, lora_rank=lora_rank, train_mlp=train_mlp,
            train_attn=train_attn, train_unembed=train_unembed, seed=seed,
            source_checkpoint_uri=source_checkpoint_uri, restore_optimizer=restore_optimizer)

    def update_training_run(self, key: ApiKey, session_id: str, run_id: str, *,
                            source_checkpoint_uri: str, restore_optimizer: bool):
        return self.runs.update_training_run(key, session_id, run_id,
                                             source_checkpoint_uri=source_checkpoint_uri,
                                             restore_optimizer=restore_optimizer)

    def list_training_runs(self, key: ApiKey, limit: int, offset: int):
        return self.runs.list_training_runs(key, limit, offset)

    def heartbeat(self, key: ApiKey, run_id: str) -> None:
        self.runs.heartbeat(key, run_id)

    def create_sampling_run(self, key: ApiKey, session_id: str, *, base_model: str,
                            source_checkpoint_uri: str = ""):
        return self.runs.create_sampling_run(key, session_id, base_model=base_model,
                                             source_checkpoint_uri=source_checkpoint_uri)

    # ================================================================== events
    async def submit_event(self, key: ApiKey, run_id: str, *, event_id: str, type: str, index: int,
                           step: int, op: Op) -> EventRecord:
        """Accept a training event (idempotent by event_id); see events.py."""
        return await self.events.submit(key, run_id, event_id=event_id, type=type, index=index,
                                        step=step, op=op)

    async def event(self, key: ApiKey, run_id: str, event_id: str, wait: float = 0.0) -> EventRecord:
        return await self.events.event(key, run_id, event_id, wait)

    @staticmethod
    def event_result(rec: EventRecord) -> EventResult | None:
        """The protocol-neutral result of a terminal event (None while accepted or running)."""
        return Events.result(rec)

    # ================================================================== sampling
    async def sample(self, key: ApiKey, sampling_run_id: str, spec: SampleSpec) -> SampleOutcome:
        return await self.sampling.sample(key, sampling_run_id, spec)

    def sample_stream(self, key: ApiKey, sampling_run_id: str, spec: SampleSpec) -> AsyncIterator:
        return self.sampling.sample_stream(key, sampling_run_id, spec)

    async def cancel_sample(self, key: ApiKey, sampling_run_id: str, request_id: str) -> bool:
        return await self.sampling.cancel(key, sampling_run_id, request_id)

    # ================================================================== checkpoints
    def list_checkpoints(self, key: ApiKey, *, training_run_id: str | None = None,
                         limit: int | None = None, offset: int = 0):
        return self.checkpoints.list(key, training_run_id=training_run_id, limit=limit, offset=offset)

    def delete_checkpoint(self, key: ApiKey, checkpoint_id: str) -> None:
        self.checkpoints.delete(key, checkpoint_id)

    async def checkpoint_archive(self, ck: Checkpoint) -> Path:
        return await self.checkpoints.archive(ck)

    # ================================================================== usage, gc
    def usage_events(self, key: ApiKey, *, session_id: str | None = None, run_id: str | None = None,
                     since: float | None = None) -> list[UsageEvent]:
        return self.store.usage_events(key.id, session_id=session_id, run_id=run_id, since=since)

    async def collect_garbage(self) -> None:
        await self.gc.collect()
