"""The service core: sessions, training runs, sampling runs, events and checkpoints (no HTTP).

Runs on the asyncio loop. Per base model there is one engine worker thread and one clock-cycle
scheduler; everything else here is bookkeeping plus short database writes.

Invariants
- Every object belongs to one API key; asking for another key's object is a NotFound.
- Events of a run execute in index order, exactly once: a retried event id returns the event's
  current state and never enqueues it again.
- An accepted event is in the database before the client hears "accepted"; its terminal response
  (msgpack bytes) is stored before any waiter is woken, so a retry or long-poll always finds it.
- A restart fails every event that was accepted but not finished (`server_restarted`) and marks the
  training runs that were live INTERRUPTED (their in-memory weights are gone).
"""
from __future__ import annotations

import asyncio
import json
import logging
import math
import re
import shutil
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from pathlib import Path

import msgpack

from ..engine.losses import Loss, prepare_datum
from ..engine.model import Adapter, LoRAConfig
from ..engine.requests import SampleRequest, SampleResult, SamplingOptions, WeightsIdentity
from ..engine.worker import EngineWorker
from ..metering.diagnostics import PrefixDiagnostics
from ..metering.events import UsageEvent
from ..metering.rates import RateCard
from ..store import ApiKey, Checkpoint, EventRecord, SamplingRun, Session, Store, TrainingRun
from ..store.keys import new_id
from .cycle import CycleRunner, Outcome, load_adapter, spill_adapter
from .errors import Conflict, InvalidRequest, NotFound, Unauthorized
from .ops import FORWARD, FORWARD_BACKWARD, OPTIMIZE_STEP, Forward, InitRun, Op, Save
from .ordering import CyclePlan, Pending
from .scheduler import ClockScheduler

log = logging.getLogger("trine.service")

CHECKPOINT_NAME = re.compile(r"^[A-Za-z0-9](?:[A-Za-z0-9._-]*[A-Za-z0-9_-])?$")
DEFAULT_TEMPORARY_TTL = 6 * 3600


@dataclass
class ServedModel:
    name: str
    dir: Path
    worker: EngineWorker
    scheduler: ClockScheduler | None = None
    # checkpoint id -> sampler weights in memory, least recently used first
    adapters: OrderedDict[str, Adapter] = field(default_factory=OrderedDict)
    loading: dict[str, asyncio.Future] = field(default_factory=dict)

    @property
    def model_id(self) -> str:
        """What PyTRIO clients get as `model_id`: a local directory they can load the tokenizer from."""
        return str(self.dir)

    @property
    def vocab_size(self) -> int:
        return self.worker.vocab_size

    @property
    def max_seq_len(self) -> int:
        return self.worker.max_seq_len


@dataclass
class LiveEvent:
    record: EventRecord
    pending: Pending
    done: asyncio.Event = field(default_factory=asyncio.Event)


@dataclass
class SampleSpec:
    """A sampling request, validated for shape by the front end."""

    request_id: str
    prompt: list[int]
    options: SamplingOptions
    num_samples: int = 1
    prompt_logprobs: bool = False
    topk_prompt_logprobs: int = 0
    generate: bool = True  # False: compute_logprobs
    return_text: bool = True
    return_token_logprobs: bool = True


class Service:
    def __init__(self, store: Store, models: dict[str, str | Path], *, cycle_seconds: float = 0.0,
                 gather_seconds: float = 0.02, device: str | None = None,
                 num_threads: int | None = None, sampler_options: dict | None = None,
                 trainer_options: dict | None = None, max_adapters: int = 32,
                 run_idle_seconds: float = 3600.0, gc_interval: float = 60.0,
                 rate_card: RateCard | None = None):
        if not models:
            raise ValueError("models: serve at least one base model")
        self.store = store
        self.cycle_seconds = cycle_seconds
        self.gather_seconds = gather_seconds
        self.max_adapters = max_adapters
        self.run_idle_seconds = run_idle_seconds
        self.gc_interval = gc_interval
        self.models: dict[str, ServedModel] = {}
        for name, path in models.items():
            path = Path(path).resolve()
            worker = EngineWorker(name, path, device=device, num_threads=num_threads,
                                  sampler_options=sampler_options, trainer_options=trainer_options)
            self.models[name] = ServedModel(name, path, worker)
        self.diagnostics = PrefixDiagnostics()
        self.rate_card = rate_card or RateCard.load(home=store.home)  # prices every usage event
        self._live: dict[str, LiveEvent] = {}
        self._samples: dict[tuple[str, str], asyncio.Future] = {}
        self._submitting: dict[str, asyncio.Future] = {}  # event id -> its submission in progress
        self._activity: dict[str, float] = {}  # training run id -> last heartbeat or event
        self._gc_task: asyncio.Task | None = None
        self._background: set[asyncio.Task] = set()  # fire-and-forget tasks, referenced until done
        self.loop: asyncio.AbstractEventLoop | None = None  # set by start()
        self.started_at = time.time()

    # ================================================================== lifecycle
    async def start(self) -> None:
        loop = self.loop = asyncio.get_running_loop()
        self._recover()
        first_cycle = self.store.max_cycle()
        for m in self.models.values():
            await loop.run_in_executor(None, m.worker.start, loop)
            runner = CycleRunner(m.worker)
            m.scheduler = ClockScheduler(self._cycle_executor(m, runner),
                                         cycle_seconds=self.cycle_seconds,
                                         gather_seconds=self.gather_seconds, first_cycle=first_cycle)
            m.scheduler.start()
        self._gc_task = loop.create_task(self._gc_loop())

    def _spawn(self, coro) -> None:
        task = asyncio.get_running_loop().create_task(coro)
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    async def stop(self) -> None:
        if self._gc_task is not None:
            self._gc_task.cancel()
        for m in self.models.values():
            if m.scheduler is not None:
                await m.scheduler.stop()
            await asyncio.get_running_loop().run_in_executor(None, m.worker.stop)

    def _recover(self) -> None:
        """After a restart: fail what was in flight, mark live runs interrupted, forget lost weights."""
        for rec in self.store.unfinished_events():
            rec.status = "failed"
            self.store.update_event(rec.id, status="failed", response=self._envelope(
                rec, Outcome(error=("server_restarted", "the server restarted while this event was "
                                    "queued or running, and the run's in-memory weights were lost; "
                                    "restore the run from a saved state and send it again"))))
        runs, _ = self.store.training_runs(status="ACTIVE")
        for r in runs:
            self.store.update_training_run(r.id, status="INTERRUPTED")
        cks, _ = self.store.checkpoints(visibility="TEMPORARY")
        for ck in cks:
            if not ck.path:
                self.store.delete_checkpoint(ck.id)

    # ================================================================== models
    def model(self, name_or_id: str) -> ServedModel:
        """Resolve a model name, its model_id (directory) or that directory's name."""
        s = (name_or_id or "").strip()
        for m in self.models.values():
            if s in (m.name, m.model_id, m.dir.name) or s.rstrip("/").split("/")[-1] == m.name:
                return m
        raise NotFound(f"base_model {name_or_id!r} is not served here; served models: "
                       f"{', '.join(self.models)}", code="model_not_found")

    # ================================================================== auth and ownership
    def authenticate(self, secret: str | None) -> ApiKey:
        if not secret:
            raise Unauthorized("send the API key as `X-API-Key: <key>` or `Authorization: Bearer <key>`")
        key = self.store.key_by_secret(secret.strip())
        if key is None:
            raise Unauthorized("the API key is not valid (create one with `trine keys create --name NAME`)",
                               code="unauthorized")
        return key

    def key(self, key_id: str) -> ApiKey:
        key = self.store.key(key_id)
        if key is None or key.revoked_at is not None:
            raise Unauthorized("the API key behind this token was revoked")
        return key

    def session(self, key: ApiKey, session_id: str) -> Session:
        return _owned(self.store.session(session_id), key, f"service session {session_id}",
                      "service_session_not_found")

    def training_run(self, key: ApiKey, run_id: str) -> TrainingRun:
        return _owned(self.store.training_run(run_id), key, f"training run {run_id}", "training_run_not_found")

    def sampling_run(self, key: ApiKey, run_id: str) -> SamplingRun:
        return _owned(self.store.sampling_run(run_id), key, f"sampling run {run_id}", "sampling_run_not_found")

    def checkpoint(self, key: ApiKey, checkpoint_id: str) -> Checkpoint:
        return _owned(self.store.checkpoint(checkpoint_id), key, f"checkpoint {checkpoint_id}",
                      "checkpoint_not_found")

    def checkpoint_by_uri(self, key: ApiKey, uri: str) -> Checkpoint:
        return _owned(self.store.checkpoint_by_uri((uri or "").strip()), key,
                      f"checkpoint {uri!r}", "checkpoint_not_found",
                      ": use the path a save returned (trio://<run>/state/<name> or trio://<run>/weights/<name>)")

    # ================================================================== sessions
    def create_session(self, key: ApiKey, sdk_version: str = "") -> Session:
        now = time.time()
        s = Session(new_id("ss"), key.id, "ACTIVE", sdk_version or "", now, now)
        self.store.add_session(s)
        return s

    async def close_session(self, key: ApiKey, session_id: str, status: str = "ENDED") -> Session:
        s = self.session(key, session_id)
        if s.status != "ACTIVE":
            return s
        self.store.update_session(s.id, status=status)
        runs, _ = self.store.training_runs(key.id, session_id=s.id)
        for r in runs:
            if r.status == "ACTIVE":
                await self._end_training_run(r, status)
        for sr in self.store.sampling_runs(key.id, session_id=s.id, status="ACTIVE"):
            self.store.update_sampling_run(sr.id, status=status)
        return self.store.session(s.id)

    # ================================================================== training runs
    def create_training_run(self, key: ApiKey, session_id: str, *, base_model: str, lora_rank: int,
                            train_mlp: bool = True, train_attn: bool = True,
                            train_unembed: bool = True, seed: int | None = None,
                            source_checkpoint_uri: str = "",
                            restore_optimizer: bool = False) -> TrainingRun:
        s = self._active_session(key, session_id)
        source = None
        if source_checkpoint_uri:
            source = self._restorable(key, source_checkpoint_uri, restore_optimizer)
            m = self.model(source.base_model)
            if base_model and self.model(base_model) is not m:
                raise InvalidRequest(f"base_model {base_model!r} differs from the checkpoint's base model "
                                     f"{source.base_model!r}; leave base_model empty to use it")
            lora_rank, train_mlp, train_attn, train_unembed = (
                source.lora_rank, source.train_mlp, source.train_attn, source.train_unembed)
            seed = source.seed if seed is None else seed
        else:
            if not base_model:
                raise InvalidRequest("base_model is empty: name a served model or give "
                                     "source_checkpoint_uri")
            m = self.model(base_model)
        _check_rank(lora_rank)
        now = time.time()
        r = TrainingRun(new_id("tr"), key.id, s.id, self.store.count_runs(s.id) + 1, m.name,
                        lora_rank, train_mlp, train_attn, train_unembed, seed,
                        source.uri if source else "", bool(restore_optimizer), "ACTIVE", now, now)
        self.store.add_training_run(r)
        self._activity[r.id] = time.monotonic()
        return r

    def update_training_run(self, key: ApiKey, session_id: str, run_id: str, *,
                            source_checkpoint_uri: str, restore_optimizer: bool) -> TrainingRun:
        """Bind a checkpoint to a run before its first event (PyTRIO `load_state`)."""
        self.session(key, session_id)
        r = self._active_run(key, run_id)
        if r.session_id != session_id:
            raise NotFound(f"training run {run_id} is not in session {session_id}",
                           code="training_run_not_found")
        if r.started:
            raise Conflict(f"training run {run_id} has already started; load a checkpoint into a new "
                           "training client instead", code="training_run_started")
        ck = self._restorable(key, source_checkpoint_uri, restore_optimizer)
        if self.model(ck.base_model).name != r.base_model:
            raise InvalidRequest(f"checkpoint {ck.uri} was trained on {ck.base_model}, this run uses "
                                 f"{r.base_model}")
        self.store.update_training_run(r.id, source_checkpoint_uri=ck.uri,
                                       restore_optimizer=bool(restore_optimizer),
                                       lora_rank=ck.lora_rank, train_mlp=ck.train_mlp,
                                       train_attn=ck.train_attn, train_unembed=ck.train_unembed)
        return self.store.training_run(r.id)

    def list_training_runs(self, key: ApiKey, limit: int, offset: int):
        return self.store.training_runs(key.id, limit=limit, offset=offset)

    def heartbeat(self, key: ApiKey, run_id: str) -> None:
        self.training_run(key, run_id)
        self._activity[run_id] = time.monotonic()

    def _active_session(self, key: ApiKey, session_id: str) -> Session:
        s = self.session(key, session_id)
        if s.status != "ACTIVE":
            raise Conflict(f"service session {session_id} is {s.status}; create a new ServiceClient",
                           code="service_session_closed")
        return s

    def _active_run(self, key: ApiKey, run_id: str) -> TrainingRun:
        r = self.training_run(key, run_id)
        if r.status == "INTERRUPTED":
            raise Conflict(f"training run {run_id} was interrupted by a server restart and its weights "
                           "are gone; restore it from a saved state with "
                           "create_training_client_from_state", code="run_interrupted")
        if r.status != "ACTIVE":
            raise Conflict(f"training run {run_id} has ended ({r.status}); create a new training client",
                           code="run_ended")
        return r

    def _restorable(self, key: ApiKey, uri: str, restore_optimizer: bool) -> Checkpoint:
        ck = self.checkpoint_by_uri(key, uri)
        if not ck.path:
            raise InvalidRequest(f"checkpoint {uri} is a temporary sampler snapshot held in memory; "
                                 "training can restore saved states (save_state) or named weights",
                                 code="checkpoint_invalid_type")
        if restore_optimizer and ck.kind != "TRAINING":
            raise InvalidRequest(f"checkpoint {uri} holds sampler weights without optimizer state; "
                                 "restore it without the optimizer or use a save_state checkpoint",
                                 code="checkpoint_invalid_type")
        return ck

    async def _end_training_run(self, r: TrainingRun, status: str) -> None:
        self.store.update_training_run(r.id, status=status)
        self._activity.pop(r.id, None)
        m = self.models.get(r.base_model)
        if m is None:
            return
        q = m.scheduler.drop(r.id) if m.scheduler else None
        for pend in (q.waiting.values() if q else ()):
            live = self._live.get(pend.event_id)
            if live is not None:
                self._settle(m, live, Outcome(error=("run_ended", f"training run {r.id} ended "
                                                     f"({status}) before this event ran")), None)

        def drop(w):
            if w.trainer.has_run(r.id):
                w.trainer.delete_run(r.id)
        try:
            await m.worker.submit(drop)
        except Exception:  # the worker is stopping
            log.debug("could not free run %s", r.id)
        cks, _ = self.store.checkpoints(r.api_key_id, training_run_id=r.id, visibility="TEMPORARY")
        for ck in cks:
            self._forget_checkpoint(ck)

    # ================================================================== events
    async def submit_event(self, key: ApiKey, run_id: str, *, event_id: str, type: str, index: int,
                           step: int, op: Op) -> EventRecord:
        """Accept an event (or return the state of the one already accepted with this id).

        Checking a large batch runs in a thread; a retry that arrives meanwhile joins this call."""
        known = self._event_record(event_id)
        if known is not None:
            if known.run_id != run_id or known.api_key_id != key.id:
                raise Conflict(f"event_id {event_id} belongs to another run; generate a new id",
                               code="event_id_conflict")
            return known
        if event_id in self._submitting:
            return await asyncio.shield(self._submitting[event_id])
        fut = self._submitting[event_id] = asyncio.get_running_loop().create_future()
        try:
            rec = await self._accept(key, run_id, event_id, type, index, step, op)
        except BaseException as e:
            fut.set_exception(e)
            fut.exception()  # retrieved: joiners re-raise it
            raise
        finally:
            self._submitting.pop(event_id, None)
        fut.set_result(rec)
        return rec

    async def _accept(self, key: ApiKey, run_id: str, event_id: str, type: str, index: int, step: int,
                      op: Op) -> EventRecord:
        r = self._active_run(key, run_id)
        m = self.models[r.base_model]
        if isinstance(op, Forward):
            await asyncio.get_running_loop().run_in_executor(None, self._check_forward, m, op)
            r = self._active_run(key, run_id)  # it may have ended meanwhile
        op = self._resolve(key, r, m, op)
        pend = Pending(event_id, run_id, index, type, op)
        m.scheduler.queue(run_id).add(pend)
        now = time.time()
        rec = EventRecord(event_id, run_id, key.id, index, type, step, "accepted", now, now)
        self.store.add_event(rec)
        if not r.started:
            self.store.update_training_run(r.id, started=True)
        self._live[event_id] = LiveEvent(rec, pend)
        self._activity[run_id] = time.monotonic()
        m.scheduler.notify()
        return rec

    async def event(self, key: ApiKey, run_id: str, event_id: str, wait: float = 0.0) -> EventRecord:
        """The event's state, after waiting up to `wait` seconds for it to finish."""
        live = self._live.get(event_id)
        if live is not None and wait > 0 and not live.done.is_set():
            self._owned_event(key, run_id, live.record)
            try:
                await asyncio.wait_for(live.done.wait(), wait)
            except asyncio.TimeoutError:
                pass
        rec = self._event_record(event_id)
        if rec is None:
            raise NotFound(f"event {event_id} not found", code="event_not_found")
        return self._owned_event(key, run_id, rec)

    def _owned_event(self, key: ApiKey, run_id: str | None, rec: EventRecord) -> EventRecord:
        if rec.api_key_id != key.id or (run_id is not None and rec.run_id != run_id):
            raise NotFound(f"event {rec.id} not found", code="event_not_found")
        return rec

    def _event_record(self, event_id: str) -> EventRecord | None:
        live = self._live.get(event_id)
        return live.record if live is not None else self.store.event(event_id)

    def envelope(self, rec: EventRecord) -> bytes:
        """The msgpack event response a client gets for `rec` now."""
        if rec.response is not None:
            return rec.response
        return msgpack.packb({"version": 1, "event_id": rec.id, "type": rec.type,
                              "status": rec.status}, use_bin_type=True)

    def _resolve(self, key: ApiKey, r: TrainingRun, m: ServedModel, op: Op) -> Op:
        """Check an op against the run and the model; fill in what the engine needs."""
        if isinstance(op, InitRun):
            return self._resolve_init(key, r, m, op)
        if isinstance(op, Save):
            return self._resolve_save(key, r, m, op)
        return op

    @staticmethod
    def _check_forward(m: ServedModel, op: Forward) -> None:
        """Everything the trainer would reject, checked before the event is accepted (thread-safe)."""
        try:
            loss = Loss.parse(op.loss_fn, op.loss_config)
            for i, d in enumerate(op.data):
                prepare_datum(d, loss, m.vocab_size, f"data[{i}]")
        except ValueError as e:
            raise InvalidRequest(str(e)) from None
        n = max(len(d.tokens) for d in op.data)
        if n > m.max_seq_len:
            raise InvalidRequest(f"data: a sequence has {n} tokens; {m.name} handles at most "
                                 f"{m.max_seq_len}")
        op.loss_fn = loss.name

    def _resolve_init(self, key: ApiKey, r: TrainingRun, m: ServedModel, op: InitRun) -> InitRun:
        if op.base_model and self.model(op.base_model) is not m:
            raise InvalidRequest(f"init_run base_model differs from the run's model {m.name}")
        uri = op.checkpoint_uri or ""
        if uri:
            ck = self._restorable(key, uri, op.load_optimizer)
            if self.model(ck.base_model) is not m:
                raise InvalidRequest(f"checkpoint {uri} was trained on {ck.base_model}, the run uses "
                                     f"{m.name}")
            op.checkpoint_path = ck.path
        else:
            _check_rank(op.lora.rank)
        return op

    def _resolve_save(self, key: ApiKey, r: TrainingRun, m: ServedModel, op: Save) -> Save:
        if not isinstance(op.name, str) or len(op.name) > 200 or not CHECKPOINT_NAME.match(op.name):
            raise InvalidRequest(f"name {op.name!r}: use 1-200 letters, digits, '.', '_' or '-', "
                                 "starting with a letter or digit")
        if op.visibility not in ("WORKSPACE", "TEMPORARY"):
            raise InvalidRequest(f"visibility {op.visibility!r}: use WORKSPACE or TEMPORARY")
        if op.ttl_seconds is not None and op.ttl_seconds <= 0:
            raise InvalidRequest("ttl_seconds must be > 0 (or omitted)")
        part = "state" if op.kind == "state" else "weights"
        uri = f"trio://{r.id}/{part}/{op.name}"
        existing = self.store.checkpoint_by_uri(uri)
        if (existing is not None or uri in self._reserved_uris()) and not op.overwrite:
            raise Conflict(f"checkpoint {uri} already exists; pick another name or save with "
                           "overwrite=True", code="checkpoint_exists")
        op.uri = uri
        op.checkpoint_id = new_id("ck")
        if op.kind == "state" or op.visibility == "WORKSPACE":
            op.path = str(self.store.checkpoint_dir / key.id / r.id / part / op.name)
        return op

    def _reserved_uris(self) -> set[str]:
        return {live.pending.op.uri for live in self._live.values()
                if isinstance(live.pending.op, Save) and not live.done.is_set()}

    # ------------------------------------------------------------------ cycle execution
    def _cycle_executor(self, m: ServedModel, runner: CycleRunner):
        async def execute(plan: CyclePlan) -> None:
            for evs in plan.runs.values():
                for ev in evs:
                    live = self._live.get(ev.event_id)
                    if live is not None:
                        live.record.status = "running"
            try:
                outcomes = await m.worker.submit(lambda w: runner.run(plan))
            except Exception as e:  # the worker died or stopped
                outcomes = {ev.event_id: Outcome(error=("internal_error", f"engine failure: {e}"))
                            for evs in plan.runs.values() for ev in evs}
            for run_id, evs in plan.runs.items():
                for ev in evs:
                    live = self._live.get(ev.event_id)
                    if live is not None:
                        self._settle(m, live, outcomes[ev.event_id], plan.number)
                if self.store.training_run(run_id) is not None:
                    self.store.update_training_run(run_id, last_cycle=plan.number)
        return execute

    def _settle(self, m: ServedModel, live: LiveEvent, out: Outcome, cycle: int | None) -> None:
        rec, op = live.record, live.pending.op
        run = self.store.training_run(rec.run_id)
        if out.error is None and isinstance(op, Save):
            out.result = self._saved(m, run, op, out)
        cost = 0.0
        if out.error is None and rec.type in (FORWARD, FORWARD_BACKWARD, OPTIMIZE_STEP):
            event = UsageEvent(
                time=time.time(), api_key_id=rec.api_key_id, session_id=run.session_id, run_id=run.id,
                base_model=m.name, operation={FORWARD: "forward", FORWARD_BACKWARD: "forward_backward",
                                              OPTIMIZE_STEP: "optim_step"}[rec.type],
                request_id=rec.id, train=out.train_tokens, train_loss=out.loss_tokens)
            self.store.add_usage(event)
            cost = self.rate_card.cost(event)["total"]
        rec.status = "failed" if out.error else "succeeded"
        rec.cycle = cycle
        rec.response = self._envelope(rec, out, cost)
        self.store.update_event(rec.id, status=rec.status, cycle=cycle, response=rec.response)
        live.done.set()
        self._live.pop(rec.id, None)

    @staticmethod
    def _envelope(rec: EventRecord, out: Outcome, cost: float = 0.0) -> bytes:
        env = {"version": 1, "event_id": rec.id, "type": rec.type,
               "status": "failed" if out.error else "succeeded",
               "usage": {"input_tokens": out.train_tokens, "output_tokens": 0,
                         "train_tokens": out.train_tokens, "loss_tokens": out.loss_tokens, "cost": cost},
               "cycle": rec.cycle}
        if out.error:
            env["error"] = {"code": out.error[0], "message": out.error[1]}
        else:
            env["result"] = out.result
        return msgpack.packb(env, use_bin_type=True)

    def _saved(self, m: ServedModel, run: TrainingRun, op: Save, out: Outcome) -> dict:
        old = self.store.checkpoint_by_uri(op.uri)
        if old is not None:  # overwrite: the new record replaces it (the files already did)
            self.store.delete_checkpoint(old.id)
            m.adapters.pop(old.id, None)
        now = time.time()
        ttl = op.ttl_seconds or (DEFAULT_TEMPORARY_TTL if op.visibility == "TEMPORARY" else None)
        ck = Checkpoint(op.checkpoint_id, run.api_key_id, run.id, op.name,
                        "TRAINING" if op.kind == "state" else "SAMPLER", op.uri, op.path,
                        out.size_bytes, op.visibility, m.name, run.lora_rank, run.train_mlp,
                        run.train_attn, run.train_unembed, run.seed, run.last_cycle, now,
                        now + ttl if ttl else None)
        self.store.add_checkpoint(ck)
        if out.snapshot is not None:
            self._remember_adapter(m, ck.id, out.snapshot)
        return {"checkpoint": {"uri": ck.uri, "model_id": m.model_id, "size_bytes": ck.size_bytes,
                               "checkpoint_cuid": ck.id, "cuid": ck.id, "type": ck.kind}}

    # ================================================================== sampler weights
    def _remember_adapter(self, m: ServedModel, checkpoint_id: str, adapter: Adapter) -> None:
        m.adapters[checkpoint_id] = adapter
        m.adapters.move_to_end(checkpoint_id)
        while len(m.adapters) > self.max_adapters:
            old_id, old = next(iter(m.adapters.items()))
            ck = self.store.checkpoint(old_id)
            if ck is not None and not ck.path:  # only in memory: write it out before letting go
                self._spawn(self._spill(m, ck, old))
            m.adapters.pop(old_id)

    async def _spill(self, m: ServedModel, ck: Checkpoint, adapter: Adapter) -> None:
        path = str(self.store.checkpoint_dir / ck.api_key_id / ck.training_run_id / "weights" / ck.name)
        lora = LoRAConfig(rank=ck.lora_rank, train_attn=ck.train_attn, train_mlp=ck.train_mlp,
                          train_unembed=ck.train_unembed, seed=ck.seed or 0)
        m.loading[ck.id] = fut = asyncio.get_running_loop().create_future()
        try:
            size = await m.worker.submit(lambda w: spill_adapter(w, adapter, lora, path, m.name))
            if self.store.checkpoint(ck.id) is not None:
                self.store.update_checkpoint(ck.id, path=path, size_bytes=size)
            fut.set_result(adapter)
        except Exception as e:
            log.error("could not write temporary checkpoint %s to disk: %s", ck.uri, e)
            fut.set_result(None)
        finally:
            m.loading.pop(ck.id, None)

    async def _adapter(self, m: ServedModel, checkpoint_id: str) -> Adapter:
        if checkpoint_id in m.adapters:
            m.adapters.move_to_end(checkpoint_id)
            return m.adapters[checkpoint_id]
        if checkpoint_id in m.loading:
            adapter = await asyncio.shield(m.loading[checkpoint_id])
            if adapter is not None:
                return adapter
        ck = self.store.checkpoint(checkpoint_id)
        if ck is None or not ck.path:
            raise Conflict("the checkpoint behind this sampler is gone (expired, deleted, or a temporary "
                           "snapshot lost in a server restart); create a sampler from a saved checkpoint",
                           code="checkpoint_unavailable")
        fut = m.loading[checkpoint_id] = asyncio.get_running_loop().create_future()
        try:
            adapter = await m.worker.submit(lambda w: load_adapter(w, ck.path))
        except Exception as e:
            fut.set_result(None)
            raise Conflict(f"checkpoint {ck.uri} could not be loaded: {e}",
                           code="checkpoint_invalid") from None
        finally:
            m.loading.pop(checkpoint_id, None)
        fut.set_result(adapter)
        self._remember_adapter(m, checkpoint_id, adapter)
        return adapter

    def _forget_checkpoint(self, ck: Checkpoint) -> None:
        self.store.delete_checkpoint(ck.id)
        m = self.models.get(ck.base_model)
        if m is not None:
            m.adapters.pop(ck.id, None)
        if ck.path:
            shutil.rmtree(ck.path, ignore_errors=True)
            Path(ck.path + ".tar").unlink(missing_ok=True)

    # ================================================================== sampling runs
    def create_sampling_run(self, key: ApiKey, session_id: str, *, base_model: str,
                            source_checkpoint_uri: str = "") -> SamplingRun:
        s = self._active_session(key, session_id)
        ck = None
        if source_checkpoint_uri:
            ck = self.checkpoint_by_uri(key, source_checkpoint_uri)
            m = self.model(ck.base_model)
            if base_model and self.model(base_model) is not m:
                raise InvalidRequest(f"base_model {base_model!r} differs from the checkpoint's base "
                                     f"model {ck.base_model!r}")
        else:
            m = self.model(base_model)
        now = time.time()
        r = SamplingRun(new_id("sr"), key.id, s.id, self.store.count_runs(s.id) + 1, m.name,
                        ck.uri if ck else "", ck.id if ck else "", "ACTIVE", now, now)
        self.store.add_sampling_run(r)
        return r

    async def sample(self, key: ApiKey, sampling_run_id: str, spec: SampleSpec) -> bytes:
        """Run one sampling request; returns the JSON response body. Retries (same request_id)
        get the stored response, or join the request still running."""
        r = self.sampling_run(key, sampling_run_id)
        dedup = (r.id, spec.request_id)
        if dedup in self._samples:
            return await asyncio.shield(self._samples[dedup])
        stored = self.store.sample_result(*dedup)
        if stored is not None:
            return stored
        if r.status != "ACTIVE":
            raise Conflict(f"sampling run {r.id} has ended ({r.status}); create a new sampling client",
                           code="run_ended")
        fut = self._samples[dedup] = asyncio.get_running_loop().create_future()
        try:
            body = await self._sample(key, r, spec)
        except BaseException as e:
            fut.set_exception(e)
            fut.exception()  # retrieved: joiners re-raise it, nobody else needs to
            raise
        finally:
            self._samples.pop(dedup, None)
        fut.set_result(body)
        return body

    async def _sample(self, key: ApiKey, r: SamplingRun, spec: SampleSpec) -> bytes:
        m, req = await self._engine_request(r, spec)
        try:
            res: SampleResult = await m.worker.sample(req)
        except ValueError as e:
            raise InvalidRequest(str(e)) from None
        cost = self._metered(key, r, m, spec, res)
        body = json.dumps(self._sample_response(r, spec, res, m, cost)).encode()
        self.store.add_sample_result(r.id, spec.request_id, body)
        return body

    async def sample_stream(self, key: ApiKey, sampling_run_id: str, spec: SampleSpec, *,
                            deltas: bool = True):
        """Sample for a front end that answers as tokens arrive (the OpenAI API): yields the
        engine's SampleDeltas (if `deltas`), then `(SampleResult, cost)`. Metered like `sample`;
        not stored for retries. Closing the iterator early (the client went away) cancels the
        request in the engine, which frees its KV blocks at once; what it computed until then is
        metered."""
        r = self.sampling_run(key, sampling_run_id)
        if r.status != "ACTIVE":
            raise Conflict(f"sampling run {r.id} has ended ({r.status}); create a new sampling client",
                           code="run_ended")
        m, req = await self._engine_request(r, spec)
        res = None
        stream = m.worker.sample_stream(req) if deltas else None
        try:
            if stream is None:
                res = await m.worker.sample(req)
            else:
                async for item in stream:
                    if isinstance(item, SampleResult):
                        res = item
                    else:
                        yield item
        except ValueError as e:
            raise InvalidRequest(str(e)) from None
        finally:
            if res is None:  # cancelled or failed: stop the engine's work, meter what it did
                self._spawn(self._meter_cancelled(key, r, m, spec, m.worker.cancel(req.request_id)))
                if stream is not None:
                    await stream.aclose()
        yield res, self._metered(key, r, m, spec, res)

    async def _meter_cancelled(self, key: ApiKey, r: SamplingRun, m: ServedModel, spec: SampleSpec,
                               partial: asyncio.Future) -> None:
        try:
            res = await partial
        except Exception:  # the engine stopped
            return
        if res is not None and res.usage.prompt_tokens:
            self._metered(key, r, m, spec, res)

    async def _engine_request(self, r: SamplingRun, spec: SampleSpec) -> tuple[ServedModel, SampleRequest]:
        m = self.models[r.base_model]
        _check_prompt(spec, m)
        adapter, weights = None, WeightsIdentity(m.name)
        if r.checkpoint_id:
            adapter = await self._adapter(m, r.checkpoint_id)
            weights = WeightsIdentity(m.name, r.checkpoint_id, 0)
        return m, SampleRequest(f"{r.id}/{spec.request_id}", list(spec.prompt), spec.options, weights,
                                adapter, spec.num_samples, spec.prompt_logprobs,
                                spec.topk_prompt_logprobs, spec.generate)

    def _metered(self, key: ApiKey, r: SamplingRun, m: ServedModel, spec: SampleSpec,
                 res: SampleResult) -> float:
        """Record the request's usage event (and look for cache diagnostics); returns its cost."""
        u = res.usage
        event = UsageEvent.from_counts(
            prompt_tokens=u.prompt_tokens, prefill=u.prefill_tokens, prefill_cached=u.cached_tokens,
            time=time.time(), api_key_id=key.id, session_id=r.session_id, run_id=r.id,
            base_model=m.name, operation="sample" if spec.generate else "compute_logprobs",
            request_id=spec.request_id, sample=u.sample_tokens)
        self.store.add_usage(event)
        if spec.generate:
            self._spawn(self._diagnose(key, r, m, spec, res))
        return self.rate_card.cost(event)["total"]

    def _sample_response(self, r: SamplingRun, spec: SampleSpec, res: SampleResult,
                         m: ServedModel, cost: float) -> dict:
        seqs = []
        for s in res.sequences:
            lps = [float(x) for x in s.logprobs] if spec.return_token_logprobs else []
            seqs.append({"tokens": list(s.tokens), "text": s.text if spec.return_text else None,
                         "logprobs": [x if math.isfinite(x) else -1e30 for x in lps],
                         "stop_reason": s.stop_reason})
        u = res.usage
        out = {"request_id": spec.request_id, "sampling_run": r.id, "sequences": seqs,
               "prompt_logprobs": _json_floats(res.prompt_logprobs) if spec.prompt_logprobs else None,
               "topk_prompt_logprobs": (
                   [None if pos is None else [[int(t), _json_float(lp)] for t, lp in pos]
                    for pos in res.topk_prompt_logprobs]
                   if spec.topk_prompt_logprobs and res.topk_prompt_logprobs is not None else None),
               "usage": {"input_tokens": u.prompt_tokens, "output_tokens": u.sample_tokens,
                         "prompt_tokens": u.prompt_tokens, "prefill_tokens": u.prefill_tokens,
                         "cached_tokens": u.cached_tokens, "sample_tokens": u.sample_tokens,
                         "cost": cost},
               "model": m.name}
        return out

    async def _diagnose(self, key: ApiKey, r: SamplingRun, m: ServedModel, spec: SampleSpec,
                        res: SampleResult) -> None:
        try:
            found = await asyncio.get_running_loop().run_in_executor(
                None, lambda: self.diagnostics.observe(
                    key.id, r.session_id, r.id, m.name, spec.request_id, spec.prompt,
                    res.usage.cached_tokens, [s.tokens for s in res.sequences],
                    m.worker.tokenizer.decode))
            for d in found:
                self.store.add_diagnostic(d)
        except Exception:  # diagnostics are advisory; never fail a request over them
            log.exception("prefix diagnostics failed")

    # ================================================================== checkpoints
    def list_checkpoints(self, key: ApiKey, *, training_run_id: str | None = None,
                         limit: int | None = None, offset: int = 0):
        if training_run_id is not None:
            self.training_run(key, training_run_id)
        return self.store.checkpoints(key.id, training_run_id=training_run_id, limit=limit,
                                      offset=offset)

    def delete_checkpoint(self, key: ApiKey, checkpoint_id: str) -> None:
        self._forget_checkpoint(self.checkpoint(key, checkpoint_id))

    async def checkpoint_archive(self, ck: Checkpoint) -> Path:
        """A tar file of the checkpoint directory (built once, atomically), for downloads."""
        if not ck.path or not Path(ck.path).is_dir():
            raise Conflict(f"checkpoint {ck.uri} has no files to download (a temporary snapshot held in "
                           "memory)", code="checkpoint_not_downloadable")
        tar = Path(ck.path + ".tar")
        if not tar.is_file():
            await asyncio.get_running_loop().run_in_executor(None, _write_tar, Path(ck.path), tar)
        return tar

    # ================================================================== usage
    def usage_events(self, key: ApiKey, *, session_id: str | None = None, run_id: str | None = None,
                     since: float | None = None) -> list[UsageEvent]:
        return self.store.usage_events(key.id, session_id=session_id, run_id=run_id, since=since)

    # ================================================================== garbage collection
    async def _gc_loop(self) -> None:
        while True:
            await asyncio.sleep(self.gc_interval)
            try:
                await self.collect_garbage()
            except Exception:
                log.exception("garbage collection failed")

    async def collect_garbage(self) -> None:
        """Expire TEMPORARY checkpoints past their TTL; end training runs silent for too long."""
        now = time.time()
        cks, _ = self.store.checkpoints(visibility="TEMPORARY")
        for ck in cks:
            if ck.expires_at is not None and ck.expires_at < now:
                self._forget_checkpoint(ck)
        idle = time.monotonic() - self.run_idle_seconds
        runs, _ = self.store.training_runs(status="ACTIVE")
        for r in runs:
            m = self.models.get(r.base_model)
            q = m.scheduler.queues.get(r.id) if m and m.scheduler else None
            busy = (q is not None and q.waiting) or any(
                live.record.run_id == r.id for live in self._live.values())
            if not busy and self._activity.get(r.id, 0.0) < idle:
                await self._end_training_run(r, "ENDED")


def _check_rank(rank) -> None:
    if isinstance(rank, bool) or not isinstance(rank, int) or not 1 <= rank <= 256:
        raise InvalidRequest(f"lora_rank {rank!r}: use an integer from 1 to 256")


def _check_prompt(spec: SampleSpec, m: ServedModel) -> None:
    if not spec.prompt:
        raise InvalidRequest("prompt: send at least one token")
    bad = [t for t in spec.prompt if not 0 <= t < m.vocab_size]
    if bad:
        raise InvalidRequest(f"prompt: token id {bad[0]} is outside the vocabulary [0, {m.vocab_size})")
    total = len(spec.prompt) + (spec.options.max_tokens if spec.generate else 0)
    if total > m.max_seq_len:
        raise InvalidRequest(f"prompt ({len(spec.prompt)} tokens) + max_tokens "
                             f"({spec.options.max_tokens}) = {total} exceeds {m.name}'s context of "
                             f"{m.max_seq_len} tokens")


def _json_float(x: float) -> float:
    return x if math.isfinite(x) else -1e30


def _json_floats(xs):
    return None if xs is None else [None if x is None else _json_float(float(x)) for x in xs]


def _write_tar(src: Path, dst: Path) -> None:
    import tarfile
    import uuid
    tmp = dst.with_name(f".{dst.name}.tmp-{uuid.uuid4().hex}")
    with tarfile.open(tmp, "w") as tf:
        tf.add(src, arcname=src.name)
    tmp.replace(dst)


def _owned(record, key: ApiKey, what: str, code: str, hint: str = ""):
    """The record if `key` owns it; otherwise 404, whether it is missing or another key's."""
    if record is None or record.api_key_id != key.id:
        raise NotFound(f"{what} not found{hint}", code=code)
    return record
