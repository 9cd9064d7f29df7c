"""Training events: acceptance (idempotent, ordered), execution in clock cycles, settling.

Invariants
- Events of a run execute in index order, exactly once: a retried event id returns the event's
  current state and never enqueues it again (`ordering.RunQueue` keeps the order).
- An accepted event is in the database before the client hears "accepted"; its terminal result
  (a protocol-neutral `EventResult`, msgpack) is stored before any waiter is woken, so a retry or
  long-poll always finds it. Front ends shape it on read.
- Usage is metered once per succeeded forward / forward_backward / optim_step, when it settles.
- An event whose engine replica is lost fails at once with `worker_lost`.
"""
from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import asdict, dataclass, field

import msgpack

from ..engine.interface import EngineLost
from ..engine.losses import Loss, prepare_datum
from ..engine.ops import CycleEvent, EventOutcome, Forward, InitRun, Op, RunShare, Save, TrainingCycle
from ..limits import (CHECKPOINT_VISIBILITIES, FORWARD, FORWARD_BACKWARD, OPTIMIZE_STEP,
                      check_checkpoint_name, check_lora_rank)
from ..metering.events import UsageEvent
from ..metering.rates import RateCard
from ..store import ApiKey, EventRecord, Store, TrainingRun
from ..store.keys import new_id
from .checkpoints import Checkpoints
from .errors import Conflict, InvalidRequest, NotFound
from .models import Replica, ServedModel, resolve_model
from .ordering import CyclePlan, Pending, split_phases
from .ownership import Ownership
from .runs import Activity

log = logging.getLogger("trine.service")
OPERATION = {FORWARD: "forward", FORWARD_BACKWARD: "forward_backward", OPTIMIZE_STEP: "optim_step"}


@dataclass
class EventResult:
    """A terminal event's result, protocol-neutral. `checkpoint` (saves): uri, checkpoint_id, kind,
    size_bytes, base_model."""

    status: str  # "succeeded" or "failed"
    error: dict | None = None  # {"code", "message"}
    logprobs: list[list[float]] | None = None
    losses: list[list[float]] | None = None
    metrics: dict = field(default_factory=dict)
    checkpoint: dict | None = None
    train_tokens: int = 0
    loss_tokens: int = 0
    cost: float = 0.0
    cycle: int | None = None

    def pack(self) -> bytes:
        return msgpack.packb(asdict(self), use_bin_type=True)

    @classmethod
    def unpack(cls, data: bytes) -> "EventResult":
        return cls(**msgpack.unpackb(data, raw=False))

    @classmethod
    def failure(cls, code: str, message: str, cycle: int | None = None) -> "EventResult":
        return cls("failed", {"code": code, "message": message}, cycle=cycle)


@dataclass
class LiveEvent:
    record: EventRecord
    pending: Pending
    replica: Replica
    done: asyncio.Event = field(default_factory=asyncio.Event)


class Events:
    def __init__(self, store: Store, ownership: Ownership, models: dict[str, ServedModel],
                 checkpoints: Checkpoints, activity: Activity, rate_card: RateCard, on_lost):
        self.store = store
        self.ownership = ownership
        self.models = models
        self.checkpoints = checkpoints
        self.activity = activity
        self.rate_card = rate_card
        self.on_lost = on_lost  # (model, replica, reason): a replica died (faults.py)
        self.live: dict[str, LiveEvent] = {}
        self._submitting: dict[str, asyncio.Future] = {}  # event id -> its submission in progress

    # ------------------------------------------------------------------ accepting
    async def submit(self, key: ApiKey, run_id: str, *, event_id: str, type: str, index: int,
                     step: int, op: Op) -> EventRecord:
        """Accept an event (or return the state of the one already accepted with this id).

        Checking a large batch runs in a thread; a retry that arrives meanwhile joins this call."""
        known = self.record(event_id)
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
        r = self.ownership.active_run(key, run_id)
        m = self.models[r.base_model]
        if isinstance(op, Forward):
            await asyncio.get_running_loop().run_in_executor(None, _check_forward, m, op)
            r = self.ownership.active_run(key, run_id)  # it may have ended meanwhile
        op = self._resolve(key, r, m, op)
        rep = m.place(run_id)
        pend = Pending(event_id, run_id, index, type, op)
        rep.scheduler.queue(run_id).add(pend)
        now = time.time()
        rec = EventRecord(event_id, run_id, key.id, index, type, step, "accepted", now, now)
        self.store.add_event(rec)
        if not r.started:
            self.store.update_training_run(r.id, started=True)
        self.live[event_id] = LiveEvent(rec, pend, rep)
        self.activity.touch(run_id)
        rep.scheduler.notify()
        return rec

    def _resolve(self, key: ApiKey, r: TrainingRun, m: ServedModel, op: Op) -> Op:
        """Check an op against the run and the model; fill in what the engine needs."""
        if isinstance(op, InitRun):
            return self._resolve_init(key, m, op)
        if isinstance(op, Save):
            return self._resolve_save(key, r, op)
        return op

    def _resolve_init(self, key: ApiKey, m: ServedModel, op: InitRun) -> InitRun:
        if op.base_model and resolve_model(self.models, op.base_model) is not m:
            raise InvalidRequest(f"init_run base_model differs from the run's model {m.name}")
        uri = op.checkpoint_uri or ""
        if uri:
            ck = self.ownership.restorable(key, uri, op.load_optimizer)
            if resolve_model(self.models, ck.base_model) is not m:
                raise InvalidRequest(f"checkpoint {uri} was trained on {ck.base_model}, the run uses "
                                     f"{m.name}")
            op.checkpoint_path = ck.path
        else:
            _invalid_unless(check_lora_rank, op.lora.rank)
        return op

    def _resolve_save(self, key: ApiKey, r: TrainingRun, op: Save) -> Save:
        _invalid_unless(check_checkpoint_name, op.name)
        if op.visibility not in CHECKPOINT_VISIBILITIES:
            raise InvalidRequest(f"visibility {op.visibility!r}: use {' or '.join(CHECKPOINT_VISIBILITIES)}")
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
        return {live.pending.op.uri for live in self.live.values()
                if isinstance(live.pending.op, Save) and not live.done.is_set()}

    # ------------------------------------------------------------------ reading
    async def event(self, key: ApiKey, run_id: str, event_id: str, wait: float = 0.0) -> EventRecord:
        """The event's state, after waiting up to `wait` seconds for it to finish."""
        live = self.live.get(event_id)
        if live is not None and wait > 0 and not live.done.is_set():
            self.ownership.event(key, run_id, live.record)
            try:
                await asyncio.wait_for(live.done.wait(), wait)
            except asyncio.TimeoutError:
                pass
        rec = self.record(event_id)
        if rec is None:
            raise NotFound(f"event {event_id} not found", code="event_not_found")
        return self.ownership.event(key, run_id, rec)

    def record(self, event_id: str) -> EventRecord | None:
        live = self.live.get(event_id)
        return live.record if live is not None else self.store.event(event_id)

    @staticmethod
    def result(rec: EventRecord) -> EventResult | None:
        """The terminal result of `rec`, or None while it is accepted or running."""
        return EventResult.unpack(rec.response) if rec.response is not None else None

    def busy(self, run_id: str) -> bool:
        return any(live.record.run_id == run_id for live in self.live.values())

    # ------------------------------------------------------------------ executing
    def executor(self, m: ServedModel, rep: Replica):
        """The scheduler's `execute` for one replica: run the plan there, settle every event."""
        async def execute(plan: CyclePlan) -> None:
            cycle = TrainingCycle(plan.number, {})
            for run_id, evs in plan.runs.items():
                cycle.runs[run_id] = _share(split_phases(evs))
                for ev in evs:
                    live = self.live.get(ev.event_id)
                    if live is not None:
                        live.record.status = "running"
            try:
                outcomes = (await rep.engine.run_cycle(cycle)).outcomes
            except EngineLost as e:
                self.on_lost(m, rep, str(e))  # fails this plan's events and the rest of the replica's
                outcomes = _all_failed(plan, "worker_lost", f"the engine replica running this event was "
                                       f"lost ({e}); restore the run from a saved state and send it again")
            except Exception as e:  # the worker died or stopped
                outcomes = _all_failed(plan, "internal_error", f"engine failure: {e}")
            for run_id, evs in plan.runs.items():
                for ev in evs:
                    live = self.live.get(ev.event_id)
                    if live is not None:
                        self.settle(m, live, outcomes[ev.event_id], plan.number)
                if self.store.training_run(run_id) is not None:
                    self.store.update_training_run(run_id, last_cycle=plan.number)
        return execute

    def settle(self, m: ServedModel, live: LiveEvent, out: EventOutcome, cycle: int | None) -> None:
        rec, op = live.record, live.pending.op
        run = self.store.training_run(rec.run_id)
        res = EventResult("failed" if out.error else "succeeded", cycle=cycle,
                          train_tokens=out.train_tokens, loss_tokens=out.loss_tokens)
        if out.error:
            res.error = {"code": out.error[0], "message": out.error[1]}
        else:
            res.logprobs, res.losses, res.metrics = out.logprobs, out.losses, out.metrics
            if isinstance(op, Save):
                ck = self.checkpoints.record_saved(m, run, op, out.size_bytes)
                if op.kind == "weights":  # the cycle published the snapshot on this replica
                    self.checkpoints.adapters.remember(live.replica, ck.id)
                res.checkpoint = {"uri": ck.uri, "checkpoint_id": ck.id, "kind": ck.kind,
                                  "size_bytes": ck.size_bytes, "base_model": m.name}
            if rec.type in OPERATION:
                event = UsageEvent(time=time.time(), api_key_id=rec.api_key_id,
                                   session_id=run.session_id, run_id=run.id, base_model=m.name,
                                   operation=OPERATION[rec.type], request_id=rec.id,
                                   train=out.train_tokens, train_loss=out.loss_tokens)
                self.store.add_usage(event)
                res.cost = self.rate_card.cost(event)["total"]
        self._finish(live, res)

    def fail(self, live: LiveEvent, code: str, message: str) -> None:
        """Fail an event that has not run (its run ended, or its replica was lost)."""
        self._finish(live, EventResult.failure(code, message))

    def _finish(self, live: LiveEvent, res: EventResult) -> None:
        rec = live.record
        rec.status, rec.cycle, rec.response = res.status, res.cycle, res.pack()
        self.store.update_event(rec.id, status=rec.status, cycle=rec.cycle, response=rec.response)
        live.done.set()
        self.live.pop(rec.id, None)

    def fail_waiting(self, rep: Replica, run_id: str, code: str, message: str) -> None:
        """Drop a run's queue on `rep` and fail the events that were waiting in it."""
        q = rep.scheduler.drop(run_id) if rep.scheduler else None
        for pend in (q.waiting.values() if q else ()):
            live = self.live.get(pend.event_id)
            if live is not None:
                self.fail(live, code, message)

    def fail_unfinished_after_restart(self) -> None:
        for rec in self.store.unfinished_events():
            res = EventResult.failure("server_restarted", "the server restarted while this event was "
                                      "queued or running, and the run's in-memory weights were lost; "
                                      "restore the run from a saved state and send it again")
            self.store.update_event(rec.id, status="failed", response=res.pack())


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


def _share(ph) -> RunShare:
    def events(pending: list[Pending]) -> list[CycleEvent]:
        return [CycleEvent(p.event_id, p.type, p.op) for p in pending]
    return RunShare(events(ph.pre), events(ph.forward), events(ph.optim), events(ph.post))


def _all_failed(plan: CyclePlan, code: str, message: str) -> dict[str, EventOutcome]:
    return {ev.event_id: EventOutcome(error=(code, message)) for evs in plan.runs.values() for ev in evs}


def _invalid_unless(check, value) -> None:
    try:
        check(value)
    except ValueError as e:
        raise InvalidRequest(str(e)) from None


