"""Training events: acceptance (idempotent, ordered), execution in clock cycles, settling.

An event carries a training command: an `engine.api` op, or a service command where the meaning
differs (commands.py). Accepting it checks it against the run and the model and builds its prepared
engine op, with everything resolved that the engine needs (a checkpoint's directory, a save's
target, each datum checked and counted, the gradient denominator); the command itself is kept as
sent, for settling (a save's record takes its name and visibility).

Invariants
- Events of a run execute in index order, exactly once: a retried event id returns the event's
  current state and never enqueues it again (`ordering.RunQueue` keeps the order). A retry must
  carry the same request (its `fingerprint`, from the front end): the same id with another body
  is a 409 naming both. Event ids are per run: an id another run used first is stored scoped
  (`EventRecord.event_id`), so it neither collides nor reveals that the other run exists.
- An accepted event is stored before it is queued (a failed write leaves nothing queued) and is in
  the database before the client hears "accepted"; its terminal result
  (a protocol-neutral `EventResult`, msgpack) is stored before any waiter is woken, so a retry or
  long-poll always finds it. Front ends shape it on read.
- Usage is metered once per succeeded forward / forward_backward / optim_step, when it settles.
  Every event that ran in a cycle stores its timing then (store `Timing`: accepted, its cycle's
  start and end, its own step), for session traces.
- An event whose engine replica is lost fails at once with `worker_lost`.
- An event that arrives before a lower index waits at most `missing_index_seconds` for it; then it
  fails with `event_index_missing`, naming the index that never arrived, and leaves the queue (its
  index may be sent again). A refused event (a 4xx/5xx answer) takes no index.
- New work passes the `WorkGate` (gate.py) first: none while the server drains for shutdown, none
  without the disk space it may need. A full disk while settling keeps the result in memory
  (readable, `unstored`) instead of losing it.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import time
from dataclasses import dataclass, field

from ..diskspace import DiskFull
from ..engine import api
from ..engine.api import CycleEvent, EngineLost, EventOutcome, Forward, Op, RunShare, Save, TrainingCycle
from ..engine.prepare import prepare_forward
from ..limits import (
    CHECKPOINT_VISIBILITIES,
    check_checkpoint_name,
    check_lora_rank,
    check_ttl_seconds,
)
from ..store import ApiKey, EventRecord, Store, Timing, TrainingRun
from ..store.keys import new_id
from . import commands
from .activity import Activity
from .checkpoints import Checkpoints
from .errors import Conflict, InvalidRequest, NotFound
from .gate import WorkGate
from .idempotency import SingleFlight
from .inflight import Inflight
from .meter import Meter
from .models import Replica, ServedModel, resolve_model
from .ordering import CyclePlan, Pending, split_phases
from .ownership import Ownership
from .quotas import KeyQuotas
from .results import EventResult

log = logging.getLogger("trine.service")
MISSING_INDEX_SECONDS = 60.0  # how long an event waits for a lower index that has not arrived


@dataclass
class LiveEvent:
    """An accepted event until it settles: its record, its command as the front end sent it and
    its engine op (in `pending`), and the replica it runs on."""

    record: EventRecord
    command: commands.TrainingCommand
    pending: Pending
    replica: Replica
    notes: dict = field(default_factory=dict)  # the front end's, stored with the result (EventResult.notes)
    done: asyncio.Event = field(default_factory=asyncio.Event)


class Events:
    def __init__(
        self,
        store: Store,
        ownership: Ownership,
        models: dict[str, ServedModel],
        checkpoints: Checkpoints,
        activity: Activity,
        meter: Meter,
        on_lost,
        quotas: "KeyQuotas | None" = None,
        inflight: "Inflight | None" = None,
        gate: WorkGate | None = None,
        missing_index_seconds: float = MISSING_INDEX_SECONDS,
    ):
        self.gate = gate  # refuses new work while draining or short of disk space
        self.missing_index_seconds = missing_index_seconds
        self.unstored: dict[str, EventRecord] = {}  # settled, but the disk was too full to store it
        self.quotas = quotas  # per-key limits on queued work
        self.inflight = inflight  # inflight saves move their run's target (inflight.py)
        self.store = store
        self.ownership = ownership
        self.models = models
        self.checkpoints = checkpoints
        self.activity = activity
        self.meter = meter  # usage, cost and timing of each settled event
        self.on_lost = on_lost  # (model, replica, reason): a replica died (faults.py)
        self.live: dict[str, LiveEvent] = {}
        self._accepting = SingleFlight(
            what=lambda event_id: f"event_id {event_id.split('~', 1)[0]}", code="event_id_reused"
        )  # stored event id -> its acceptance

    # ------------------------------------------------------------------ accepting
    async def submit(
        self,
        key: ApiKey,
        run_id: str,
        *,
        event_id: str,
        index: int,
        step: int,
        command: commands.TrainingCommand,
        fingerprint: str = "",
        notes: dict | None = None,
    ) -> EventRecord:
        """Accept `command` as event `index` of the run (or return the state of the event already
        accepted under `event_id`).

        Checking a large batch runs in a thread; a retry that arrives meanwhile joins this call.
        `fingerprint` identifies the request body ("" = not checked). `notes` is kept with the
        result for the front end that shapes it (the service never reads it)."""
        stored_id = self._stored_id(run_id, event_id)
        known = None if stored_id in self._accepting else self.record(stored_id)
        if known is not None:
            self.ownership.event(key, run_id, known)
            self._accepting.check(stored_id, known.fingerprint, fingerprint)
            return known
        return await self._accepting.run(
            stored_id,
            fingerprint,
            lambda: self._accept(key, run_id, stored_id, index, step, command, fingerprint, notes or {}),
        )

    def _stored_id(self, run_id: str, event_id: str) -> str:
        """`event_id`, or `event_id~run_id` when another run used that id first."""
        rec = self.record(event_id)
        if rec is None or rec.run_id == run_id:
            return event_id
        return f"{event_id}~{run_id}"

    async def _accept(
        self,
        key: ApiKey,
        run_id: str,
        event_id: str,
        index: int,
        step: int,
        command: commands.TrainingCommand,
        fingerprint: str,
        notes: dict,
    ) -> EventRecord:
        r = self.ownership.active_run(key, run_id)
        m = self.models[r.base_model]
        if self.gate is not None:
            saves = isinstance(command, (commands.SaveByName, Save))
            self.gate.admit(f"event {event_id.split('~', 1)[0]} (index {index})", checkpoint=saves)
        if isinstance(command, Forward):
            op = await asyncio.get_running_loop().run_in_executor(None, _prepared, command, m)
            r = self.ownership.active_run(key, run_id)  # it may have ended meanwhile
        else:
            op = self._op(key, r, m, command)
        if self.quotas is not None:
            self.quotas.check_queue(key, op, self.queued_tokens(key.id))
        rep = m.place(run_id)
        type_ = api.event_type(command)
        pend = Pending(event_id, run_id, index, type_, op)
        now = time.time()
        rec = EventRecord(
            event_id, run_id, key.id, index, type_, step, "accepted", now, now, fingerprint=fingerprint
        )
        self.store.add_event(rec)  # stored first: a failed write leaves nothing queued
        q = rep.scheduler.queue(run_id, tenant=key.id)
        try:
            q.add(pend)
        except BaseException:
            self.store.delete_event(rec.id)
            raise
        if index > q.next_index:  # a lower index has not arrived yet: wait for it, boundedly
            asyncio.get_running_loop().call_later(
                self.missing_index_seconds, self._missing_index, rep, run_id, event_id
            )
        if not r.started:
            self.store.update_training_run(r.id, started=True)
        if isinstance(command, api.OptimStep):  # the settings a run listing shows as last used
            settings = {"type": api.optimizer_of(command.params), **dataclasses.asdict(command.params)}
            self.store.update_training_run(r.id, optimizer=json.dumps(settings))
        self.live[event_id] = LiveEvent(rec, command, pend, rep, notes)
        self.activity.touch(run_id)
        rep.scheduler.notify()
        return rec

    def _op(self, key: ApiKey, r: TrainingRun, m: ServedModel, command: commands.TrainingCommand) -> Op:
        """Check a (non-forward) command against the run and the model; its engine op."""
        if isinstance(command, commands.InitByUri):
            return api.InitRun(
                lora=command.lora,
                checkpoint_path=self._init_checkpoint(key, r, m, command),
                load_optimizer=command.load_optimizer,
                checkpoint_uri=command.checkpoint_uri,
                optimizer=r.optimizer_family,
            )
        if isinstance(command, api.OptimStep) and api.optimizer_of(command.params) != r.optimizer_family:
            sent = "DimuonParams" if api.optimizer_of(command.params) == api.DIMUON else "AdamParams"
            wanted = "DimuonParams" if r.optimizer_family == api.DIMUON else "AdamParams"
            raise InvalidRequest(
                f"optim_step sent {sent}, but this model was made with the {r.optimizer_family} "
                f"optimizer: send {wanted} (the optimizer is chosen when the training client is created)"
            )
        if isinstance(command, commands.SaveByName):
            return self._save_target(key, r, command)
        return command

    def _init_checkpoint(self, key: ApiKey, r: TrainingRun, m: ServedModel, c: commands.InitByUri) -> str:
        """The directory of the checkpoint an init loads ("" for a fresh adapter)."""
        if c.base_model and resolve_model(self.models, c.base_model) is not m:
            raise InvalidRequest(f"init_run base_model differs from the run's model {m.name}")
        if not c.checkpoint_uri:
            _invalid_unless(check_lora_rank, c.lora.rank)
            return ""
        ck = self.ownership.restorable(key, c.checkpoint_uri, c.load_optimizer)
        if resolve_model(self.models, ck.base_model) is not m:
            raise InvalidRequest(
                f"checkpoint {c.checkpoint_uri} was trained on {ck.base_model}, the run uses {m.name}"
            )
        saved = self.ownership.checkpoint_optimizer(ck)
        if c.load_optimizer and saved != r.optimizer_family:
            raise InvalidRequest(
                f"checkpoint {c.checkpoint_uri} holds {saved} optimizer state and this model trains with "
                f"{r.optimizer_family}: load it without the optimizer, or make a new training client "
                "from it (create_training_client_from_state_with_optimizer), which takes its optimizer"
            )
        return ck.path

    def _save_target(self, key: ApiKey, r: TrainingRun, c: commands.SaveByName) -> Save:
        """The engine save of a save by name: its URI, a new checkpoint id and its directory ("" for
        weights kept in memory only)."""
        _invalid_unless(check_checkpoint_name, c.name)
        if c.visibility not in CHECKPOINT_VISIBILITIES:
            raise InvalidRequest(f"visibility {c.visibility!r}: use {' or '.join(CHECKPOINT_VISIBILITIES)}")
        _invalid_unless(check_ttl_seconds, c.ttl_seconds)
        part = "state" if c.kind == "state" else "weights"
        uri = f"trio://{r.id}/{part}/{c.name}"
        existing = self.store.checkpoint_by_uri(uri)
        if (existing is not None or uri in self._reserved_uris()) and not c.overwrite:
            raise Conflict(
                f"checkpoint {uri} already exists; pick another name or save with overwrite=True",
                code="checkpoint_exists",
            )
        path = ""
        if c.kind == "state" or c.visibility == "WORKSPACE":
            path = str(self.store.checkpoint_dir / key.id / r.id / part / c.name)
        return Save(kind=c.kind, checkpoint_id=new_id("ck"), path=path, uri=uri, inflight=c.inflight)

    def _reserved_uris(self) -> set[str]:
        return {
            live.pending.op.uri
            for live in self.live.values()
            if isinstance(live.pending.op, Save) and not live.done.is_set()
        }

    # ------------------------------------------------------------------ reading
    async def event(self, key: ApiKey, run_id: str, event_id: str, wait: float = 0.0) -> EventRecord:
        """The event's state, after waiting up to `wait` seconds for it to finish."""
        event_id = self._stored_id(run_id, event_id)
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
        if live is not None:
            return live.record
        return self.unstored.get(event_id) or self.store.event(event_id)

    def _missing_index(self, rep: Replica, run_id: str, event_id: str) -> None:
        """Fail `event_id` if it still waits for a lower index (its queue's next) that never came."""
        live = self.live.get(event_id)
        q = rep.scheduler.queues.get(run_id) if rep.scheduler else None
        if live is None or q is None or live.record.status != "accepted":
            return
        index = live.pending.index
        if q.waiting.get(index) is not live.pending or q.next_index >= index:
            return
        missing = q.next_index
        q.waiting.pop(index)
        self.fail(
            live,
            "event_index_missing",
            f"metadata.index: event index {missing} of run {run_id} never arrived (waited "
            f"{self.missing_index_seconds:g} s), and events run in index order; send index {missing} "
            f"(an event the server refused took no index), then send this event ({index}) again "
            "under a new event id",
        )

    def queued_tokens(self, api_key_id: str) -> int:
        """Tokens of the key's forward events accepted and not yet running."""
        return sum(
            live.pending.op.tokens
            for live in self.live.values()
            if live.record.api_key_id == api_key_id
            and live.record.status == "accepted"
            and isinstance(live.pending.op, Forward)
        )

    def progressing(self) -> bool:
        """Some accepted event is running or can run (not only waiting for a missing index)."""
        for live in self.live.values():
            if live.record.status == "running":
                return True
            sched = live.replica.scheduler
            q = sched.queues.get(live.record.run_id) if sched is not None else None
            if q is not None and q.ready():
                return True
        return False

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
            span = (0.0, 0.0)  # the cycle's wall-clock start and end in the engine, for session traces
            try:
                result = await rep.engine.run_cycle(cycle)
                outcomes = result.outcomes
                rep.cycle_tally.observe(result.seconds, sum(o.train_tokens for o in outcomes.values()))
                span = (result.started_at, result.started_at + result.seconds)
            except EngineLost as e:
                self.on_lost(m, rep, str(e))  # fails this plan's events and the rest of the replica's
                outcomes = _all_failed(
                    plan,
                    "worker_lost",
                    f"the engine replica running this event was "
                    f"lost ({e}); restore the run from a saved state and send it again",
                )
            except Exception as e:  # the worker died or stopped
                outcomes = _all_failed(plan, "internal_error", f"engine failure: {e}")
            for run_id, evs in plan.runs.items():
                for ev in evs:
                    live = self.live.get(ev.event_id)
                    if live is not None:
                        try:
                            self.settle(m, live, outcomes[ev.event_id], plan.number, span)
                        except DiskFull as e:  # its checkpoint or usage row could not be stored
                            self._finish(live, EventResult.failure(e.code, str(e)))
                if self.store.training_run(run_id) is not None:
                    self.store.update_training_run(run_id, last_cycle=plan.number)

        return execute

    def settle(
        self,
        m: ServedModel,
        live: LiveEvent,
        out: EventOutcome,
        cycle: int | None,
        span: tuple[float, float] = (0.0, 0.0),
    ) -> None:
        """Store an event's result (and usage, and its timing) and wake its waiters. `span`: the
        wall-clock start and end of the cycle it ran in."""
        rec, op = live.record, live.pending.op
        run = self.store.training_run(rec.run_id)
        res = EventResult(
            "failed" if out.error else "succeeded",
            cycle=cycle,
            train_tokens=out.train_tokens,
            loss_tokens=out.loss_tokens,
            train_sequence_tokens=out.train_sequence_tokens,
            notes=live.notes,
        )
        if out.error:
            res.error = {"code": out.error[0], "message": out.error[1]}
        else:
            res.logprobs, res.losses, res.metrics = out.logprobs, out.losses, out.metrics
            if isinstance(op, Save):
                ck = self.checkpoints.record_saved(
                    m, run, live.command, op, out.size_bytes, out.weights_version
                )
                if op.kind == "weights":  # the cycle published the snapshot on this replica
                    self.checkpoints.adapters.remember(live.replica, ck.id)
                res.checkpoint = {
                    "uri": ck.uri,
                    "checkpoint_id": ck.id,
                    "kind": ck.kind,
                    "size_bytes": ck.size_bytes,
                    "base_model": m.name,
                }
                if op.inflight:  # ... and moved the run's inflight target there
                    res.checkpoint["weights_version"] = out.weights_version
                    self.inflight.published(m, run.id, live.replica, out.weights_version, ck.id)
        metered = self.meter.event(
            rec,
            out,
            session_id=run.session_id if run is not None else "",
            base_model=m.name,
            replica=live.replica.index,
            cycle=cycle,
            span=span,
        )
        if metered.usage is not None:
            self.store.add_usage(metered.usage)
            res.cost = metered.cost
        self._store_timing(rec, metered.timing)
        self._finish(live, res)

    def _store_timing(self, rec: EventRecord, timing: Timing) -> None:
        """The event's way through its replica, for session traces: advisory, so a full disk only
        loses the row (the event's result and usage are what must be stored)."""
        try:
            self.store.add_timing(timing)
        except DiskFull as e:
            log.warning("event %s: its timing was not stored (%s)", rec.id, e)

    def fail(self, live: LiveEvent, code: str, message: str) -> None:
        """Fail an event that has not run (its run ended, or its replica was lost)."""
        self._finish(live, EventResult.failure(code, message))

    def _finish(self, live: LiveEvent, res: EventResult) -> None:
        rec = live.record
        rec.status, rec.cycle, rec.response = res.status, res.cycle, res.pack()
        try:
            self.store.update_event(rec.id, status=rec.status, cycle=rec.cycle, response=rec.response)
            self.unstored.pop(rec.id, None)
        except DiskFull as e:  # readable from memory until the server stops (a restart fails it)
            log.error("event %s settled but could not be stored: %s", rec.id, e)
            self.unstored[rec.id] = rec
        live.done.set()
        self.live.pop(rec.id, None)

    def fail_all(self, code: str, message: str) -> int:
        """Fail every event accepted and not settled (queued or running) and empty the queues;
        how many. A cycle still running in an engine settles none of them afterwards."""
        failed = list(self.live.values())
        for live in failed:
            sched = live.replica.scheduler
            q = sched.queues.get(live.record.run_id) if sched is not None else None
            if q is not None:
                q.waiting.pop(live.pending.index, None)
            self.fail(live, code, message)
        return len(failed)

    def fail_waiting(self, rep: Replica, run_id: str, code: str, message: str) -> None:
        """Drop a run's queue on `rep` and fail the events that were waiting in it."""
        q = rep.scheduler.drop(run_id) if rep.scheduler else None
        for pend in q.waiting.values() if q else ():
            live = self.live.get(pend.event_id)
            if live is not None:
                self.fail(live, code, message)

    def fail_unfinished_after_restart(self) -> None:
        for rec in self.store.unfinished_events():
            res = EventResult.failure(
                "server_restarted",
                "the server restarted while this event was "
                "queued or running, and the run's in-memory weights were lost; "
                "restore the run from a saved state and send it again",
            )
            self.store.update_event(rec.id, status="failed", response=res.pack())


def _share(ph) -> RunShare:
    def events(pending: list[Pending]) -> list[CycleEvent]:
        return [CycleEvent(p.event_id, p.type, p.op) for p in pending]

    return RunShare(events(ph.pre), events(ph.forward), events(ph.optim), events(ph.post))


def _all_failed(plan: CyclePlan, code: str, message: str) -> dict[str, EventOutcome]:
    return {ev.event_id: EventOutcome(error=(code, message)) for evs in plan.runs.values() for ev in evs}


def _prepared(op: Forward, m: ServedModel) -> Forward:
    """`op` prepared for `m` (engine/prepare.py): every datum checked and counted once."""
    try:
        return prepare_forward(op, m.vocab_size, m.max_seq_len, m.name)
    except ValueError as e:
        raise InvalidRequest(str(e)) from None


def _invalid_unless(check, value) -> None:
    try:
        check(value)
    except ValueError as e:
        raise InvalidRequest(str(e)) from None
