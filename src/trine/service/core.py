"""The `Service`: the one object front ends use. It wires the service's parts together; a front end
calls the parts' public methods directly:

- `ownership` (ownership.py): `authenticate(secret)`, `key(key_id)`, and one owned object by id:
  `session`, `training_run`, `sampling_run`, `checkpoint`, `checkpoint_by_uri`; a checkpoint the
  key may read (its own or a published one): `readable`, `readable_by_uri`;
- `runs` (runs.py): `create_session`, `close_session`, `create_training_run(key, session,
  TrainingRunSpec)`, `update_training_run`, `heartbeat`, `create_sampling_run(key, session,
  SamplingRunSpec)`;
- `events` (events/: accept, settle, reads): `submit(key, run, event_id=, index=, step=, command=)`
  (ordered, idempotent) and `event(key, run, event_id, wait)` (a long-poll);
- `sampling` (sampling/): `sample(key, run, SampleRequest)`, `sample_stream` (SampleDeltas, then the
  SampleOutcome), `cancel`;
- `checkpoints` (checkpoints.py): `delete(key, checkpoint_id)`, `set_ttl`, `set_public`, `stored(key)`
  (what is on disk), `archive(checkpoint, flat=)` (a tar file);
- `imports` (imports.py): `adapter(key, base_model=, name=, directory=, origin=)`: a PEFT adapter
  trained elsewhere, checked against the model, as a sampler checkpoint;
- `metrics` (metrics.py): `log(key, run, step, values)`, `series(key, run)`, `last(key, run)`: the
  metrics users log for their training runs;
- `traces` (traces.py): `timeline(key, session)` and `chrome_trace(key, session)`: where a
  session's time went (queue, prefill, decode, clock cycles, training steps per replica);
- `queries` (queries.py): the read side: sessions, runs, events, checkpoints and usage of a key;
  served models, their tokenizers, engine replica stats.

What they take is in commands.py, what they answer in results.py and views.py. Behind them:
adapters.py (sampler adapters per replica, spill to disk), inflight.py (the moving weights
inflight samplers follow), gc.py (restart recovery, expiry, idle
runs), faults.py (lost engine replicas), routing.py (prefix-aware routing across replicas),
models.py (base models, engine replicas, run placement), scheduler.py and ordering.py (clock
cycles), quotas.py (per-key limits), idempotency.py (one request id, one piece of work),
gate.py (no new work while draining for shutdown or short of disk space), meter.py (the usage,
cost and timing rows of every sample and event), callbacks.py (the named callbacks the parts are
handed: `Spawn`, `OnLoop`, `ReplicaLost`).

Shutdown (`drain(seconds)`, then `stop()`): new work is refused at once (503
`server_shutting_down`, Retry-After); accepted events and running samples get until the deadline
to finish; then the samples still running are cancelled (first, all at once), the events still
queued or running fail with `server_shutting_down`, and what the cancelled samples computed is
metered. Each step is bounded, so the drain ends within its seconds even while an engine is inside
a training step.

Runs on the asyncio loop; the engines (one per replica) are reached only through
`engine.interface.Engine`, and only from the service.
"""

from __future__ import annotations

import asyncio
import logging
import time
from pathlib import Path
from typing import Any, Callable, Coroutine

from ..diskspace import DEFAULT_RESERVE_BYTES
from ..engine.config import EngineConfig
from ..engine.interface import Engine
from ..limits import KeyLimits
from ..metering.rates import RateCard
from ..store import Store
from .activity import Activity
from .adapters import AdapterCache
from .checkpoints import Checkpoints
from .events import MISSING_INDEX_SECONDS, Events
from .faults import Faults
from .gate import WorkGate
from .gc import GarbageCollector
from .imports import Imports
from .inflight import Inflight
from .meter import Meter
from .metrics import Metrics
from .models import Replica, ServedModel
from .ownership import Ownership
from .queries import Queries
from .quotas import KeyQuotas
from .routing import Router
from .runs import Runs
from .sampling import Sampling
from .scheduler import ClockScheduler
from .tokenizers import ModelTokenizer
from .traces import Traces

log = logging.getLogger("trine.service")

EngineFactory = Callable[[str, Path], list[Engine]]  # (model name, dir) -> its replicas' engines
DRAIN_CANCEL_SECONDS = 2.0  # a shutdown's deadline: the longest wait for engines to answer cancels
DRAIN_SETTLE_SECONDS = 1.0  # then the longest wait for the cancelled requests' answers to go out
STOP_CANCEL_SECONDS = 10.0  # stop(): the longest wait for engines to answer the drain's cancels


class Service:
    def __init__(
        self,
        store: Store,
        models: dict[str, str | Path],
        *,
        cycle_seconds: float = 0.0,
        gather_seconds: float = 0.02,
        engine: EngineConfig | None = None,
        max_adapters: int = 32,
        max_full_weights: int = 2,
        run_idle_seconds: float = 3600.0,
        gc_interval: float = 60.0,
        rate_card: RateCard | None = None,
        engines: EngineFactory | None = None,
        router: Router | None = None,
        key_limits: KeyLimits | None = None,
        disk_reserve_bytes: int = DEFAULT_RESERVE_BYTES,
        missing_index_seconds: float = MISSING_INDEX_SECONDS,
    ):
        if not models:
            raise ValueError("models: serve at least one base model")
        self.store = store
        self.cycle_seconds = cycle_seconds
        self.gather_seconds = gather_seconds
        self.gc_interval = gc_interval
        if engines is None:
            from ..engine.runtime.local import LocalEngine

            config = engine or EngineConfig()

            def engines(name: str, path: Path) -> list[Engine]:
                return [LocalEngine(name, path, config)]

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

        self.meter = Meter(rate_card=self.rate_card)  # usage, cost and timing of every sample and event
        self.ownership = Ownership(store=store)
        self.gate = WorkGate(
            data_dir=store.home, checkpoint_dir=store.checkpoint_dir, reserve_bytes=disk_reserve_bytes
        )
        self.activity = Activity()
        self.adapters = AdapterCache(
            store=store,
            max_adapters=max_adapters,
            max_full_weights=max_full_weights,
            spawn=self._spawn,
            on_loop=self._on_loop,
        )
        self.checkpoints = Checkpoints(
            store=store, ownership=self.ownership, models=self.models, adapters=self.adapters
        )
        self.quotas = KeyQuotas(store=store, models=self.models, limits=key_limits)
        self.inflight = Inflight(store=store, adapters=self.adapters, spawn=self._spawn)
        self.events = Events(
            store=store,
            ownership=self.ownership,
            models=self.models,
            checkpoints=self.checkpoints,
            activity=self.activity,
            meter=self.meter,
            on_lost=self._replica_lost,
            quotas=self.quotas,
            inflight=self.inflight,
            gate=self.gate,
            missing_index_seconds=missing_index_seconds,
        )
        self.faults = Faults(store=store, events=self.events)
        self.runs = Runs(
            store=store,
            ownership=self.ownership,
            models=self.models,
            checkpoints=self.checkpoints,
            activity=self.activity,
            events=self.events,
            quotas=self.quotas,
            inflight=self.inflight,
            gate=self.gate,
        )
        self.sampling = Sampling(
            store=store,
            ownership=self.ownership,
            models=self.models,
            adapters=self.adapters,
            meter=self.meter,
            spawn=self._spawn,
            on_lost=self._replica_lost,
            router=router,
            inflight=self.inflight,
            gate=self.gate,
        )
        self.queries = Queries(store=store, ownership=self.ownership, models=self.models)
        self.imports = Imports(store=store, models=self.models, gate=self.gate)
        self.metrics = Metrics(store=store, ownership=self.ownership)
        self.traces = Traces(store=store, ownership=self.ownership, rate_card=self.rate_card)
        self.gc = GarbageCollector(
            store=store,
            models=self.models,
            checkpoints=self.checkpoints,
            runs=self.runs,
            events=self.events,
            activity=self.activity,
            run_idle_seconds=run_idle_seconds,
        )
        # the calls embedders and tests reach for first
        self.authenticate = self.ownership.authenticate
        self.usage_events = self.queries.usage_events
        self.collect_garbage = self.gc.collect

    @classmethod
    def open(cls, home: str | Path, models: dict[str, str | Path], **options) -> "Service":
        """A service over the data dir `home` (its store is opened here; `close()` closes it)."""
        return cls(Store(home), models, **options)

    def close(self) -> None:
        self.store.close()

    # ================================================================== lifecycle
    async def start(self) -> None:
        self.loop = asyncio.get_running_loop()
        self.gc.recover()
        first_cycle = self.store.max_cycle()
        for m in self.models.values():
            infos = await asyncio.gather(*(rep.engine.start() for rep in m.replicas))
            m.info = infos[0]
            m.tokenizer = await self.loop.run_in_executor(None, ModelTokenizer, m.name, m.dir)
            for rep in m.replicas:
                rep.scheduler = ClockScheduler(
                    self.events.executor(m, rep),
                    cycle_seconds=self.cycle_seconds,
                    gather_seconds=self.gather_seconds,
                    first_cycle=first_cycle,
                )
                rep.scheduler.start()
                self._spawn(self.faults.watch(m, rep))
        self._gc_task = self.loop.create_task(self.gc.loop(self.gc_interval))

    async def drain(self, seconds: float) -> None:
        """Refuse new work now; give accepted events and running samples until the deadline (about
        `seconds`) to finish; then cancel the samples left, fail the events left
        (`server_shutting_down`), and meter each cancelled sample's partial work as its engine answers.

        Every step is bounded, and together they end within `seconds`: the wait for work ends
        `DRAIN_CANCEL_SECONDS + DRAIN_SETTLE_SECONDS` before the deadline. Samples are cancelled
        first and all at once, and nothing waits on an engine longer than its step's bound: an
        engine still inside a training step answers its cancels when the step ends, and what those
        samples computed is metered then (sampling/run.py, `cancel_all`)."""
        self.gate.drain(seconds)
        begun = time.monotonic()
        cancel_for = min(DRAIN_CANCEL_SECONDS, 0.2 * seconds)
        settle_for = min(DRAIN_SETTLE_SECONDS, 0.1 * seconds)
        wait_until = begun + seconds - cancel_for - settle_for
        while (self.events.progressing() or self.sampling.running()) and time.monotonic() < wait_until:
            await asyncio.sleep(0.05)
        cancelled = await self.sampling.cancel_all(wait=cancel_for)
        failed = self.events.fail_all(
            "server_shutting_down",
            "the server shut down before this event ran to the end; the run's in-memory weights "
            "are lost: restore it from a saved state once the server has restarted, and send it again",
        )
        settle_by = time.monotonic() + settle_for  # let the cancelled requests' answers go out
        while self.sampling.running() and time.monotonic() < settle_by:
            await asyncio.sleep(0.02)
        if failed or cancelled:
            busy = self.sampling.running()
            log.warning(
                "shutdown deadline: cancelled %d sample(s), failed %d queued or running event(s)%s",
                cancelled,
                failed,
                f"; {busy} sample(s) wait for an engine inside a training step" if busy else "",
            )

    def serving_at(self, host: str, port: int) -> None:
        """Name the address this service answers at in its data dir's lock file (store/owner.py)."""
        if self.store.claim is not None:
            self.store.claim.announce(host=host, port=port)

    def named_paths(self) -> list[tuple[Path, str]]:
        """The server's own directories, each with the name an answer gives it instead (no answer
        carries a server path): the checkpoint dir, the data dir, each served model's directory."""
        named = [
            (Path(self.store.checkpoint_dir), "the server's checkpoint dir"),
            (Path(self.store.home), "the server's data dir"),
        ]
        return named + [(Path(m.dir), f"model {m.name}") for m in self.models.values()]

    def free_space(self) -> dict[str, int]:
        """Free bytes in the data dir and the checkpoint dir (gate.py); -1: unknown."""
        return self.gate.free_space()

    async def stop(self) -> None:
        """Stop the engines, once the cancels a drain sent are answered (or `STOP_CANCEL_SECONDS`
        have passed): an engine that finishes a training step after the drain still reports what
        the samples it stopped computed, and they are metered."""
        unanswered = await self.sampling.await_cancels(STOP_CANCEL_SECONDS)
        if unanswered:
            log.warning("stopping: %d cancelled sample(s) unmetered, their engine never answered", unanswered)
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

    def _spawn(self, coro: Coroutine[Any, Any, Any]) -> None:
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
