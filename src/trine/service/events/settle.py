"""Executing and settling training events: the scheduler's `execute` for a replica (run the
plan's `TrainingCycle` in the engine, settle every event of it), storing each result with its usage
and timing before waking its waiters, failing events that cannot run, and failing, after a restart,
those the server lost (see __init__.py for the invariants)."""

from __future__ import annotations

from ...diskspace import DiskFull
from ...engine.api import FULL_RANK, EngineLost, EventOutcome, Save
from ...store import EventRecord, Timing
from ..models import Replica, ServedModel
from ..ordering import CyclePlan
from ..results import EventResult
from .event import Event
from .state import EventsState, log


class Settling(EventsState):
    """executor, settle, fail, fail_all, fail_waiting, fail_unfinished_after_restart."""

    def executor(self, m: ServedModel, rep: Replica):
        """The scheduler's `execute` for one replica: run the plan there, settle every event."""

        async def execute(plan: CyclePlan) -> None:
            for evs in plan.runs.values():
                for ev in evs:
                    if self.live.get(ev.id) is ev:  # not failed meanwhile
                        ev.record.status = "running"
            span = (0.0, 0.0)  # the cycle's wall-clock start and end in the engine, for session traces
            try:
                result = await rep.engine.run_cycle(plan.cycle)
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
                    if self.live.get(ev.id) is ev:  # not failed meanwhile
                        try:
                            self.settle(m, ev, outcomes[ev.id], plan.number, span)
                        except DiskFull as e:  # its checkpoint or usage row could not be stored
                            self._finish(ev, EventResult.failure(e.code, str(e)))
                if self.store.training_run(run_id) is not None:
                    self.store.update_training_run(run_id, last_cycle=plan.number)

        return execute

    def settle(
        self,
        m: ServedModel,
        ev: Event,
        out: EventOutcome,
        cycle: int | None,
        span: tuple[float, float] = (0.0, 0.0),
    ) -> None:
        """Store an event's result (and usage, and its timing) and wake its waiters. `span`: the
        wall-clock start and end of the cycle it ran in."""
        rec, op = ev.record, ev.op
        run = self.store.training_run(rec.run_id)
        res = EventResult(
            "failed" if out.error else "succeeded",
            cycle=cycle,
            train_tokens=out.train_tokens,
            loss_tokens=out.loss_tokens,
            train_sequence_tokens=out.train_sequence_tokens,
            notes=ev.notes,
        )
        if out.error:
            res.error = {"code": out.error[0], "message": out.error[1]}
        else:
            res.logprobs, res.losses, res.metrics = out.logprobs, out.losses, out.metrics
            if isinstance(op, Save):
                ck = self.checkpoints.record_saved(
                    m, run, ev.command, op, out.size_bytes, out.weights_version
                )
                if op.kind == "weights":  # the cycle published the snapshot on this replica
                    self.checkpoints.adapters.remember(ev.replica, ck.id)
                res.checkpoint = {
                    "uri": ck.uri,
                    "checkpoint_id": ck.id,
                    "kind": ck.kind,
                    "size_bytes": ck.size_bytes,
                    "base_model": m.name,
                }
                if op.inflight:  # ... and moved the run's inflight target there
                    res.checkpoint["weights_version"] = out.weights_version
                    self.inflight.published(m, run.id, ev.replica, out.weights_version, ck.id)
        metered = self.meter.event(
            rec,
            out,
            session_id=run.session_id if run is not None else "",
            base_model=m.name,
            replica=ev.replica.index,
            cycle=cycle,
            span=span,
            full=run is not None and run.lora_rank == FULL_RANK,
        )
        if metered.usage is not None:
            self.store.add_usage(metered.usage)
            res.cost = metered.cost
        self._store_timing(rec, metered.timing)
        self._finish(ev, res)

    def _store_timing(self, rec: EventRecord, timing: Timing) -> None:
        """The event's way through its replica, for session traces: advisory, so a full disk only
        loses the row (the event's result and usage are what must be stored)."""
        try:
            self.store.add_timing(timing)
        except DiskFull as e:
            log.warning("event %s: its timing was not stored (%s)", rec.id, e)

    def fail(self, ev: Event, code: str, message: str) -> None:
        """Fail an event that has not run (its run ended, or its replica was lost)."""
        self._finish(ev, EventResult.failure(code, message))

    def _finish(self, ev: Event, res: EventResult) -> None:
        rec = ev.record
        rec.status, rec.cycle, rec.response = res.status, res.cycle, res.pack()
        try:
            self.store.update_event(rec.id, status=rec.status, cycle=rec.cycle, response=rec.response)
            self.unstored.pop(rec.id, None)
        except DiskFull as e:  # readable from memory until the server stops (a restart fails it)
            log.error("event %s settled but could not be stored: %s", rec.id, e)
            self.unstored[rec.id] = rec
        ev.done.set()
        self.live.pop(rec.id, None)

    def fail_all(self, code: str, message: str) -> int:
        """Fail every event accepted and not settled (queued or running) and empty the queues;
        how many. A cycle still running in an engine settles none of them afterwards."""
        failed = list(self.live.values())
        for ev in failed:
            sched = ev.replica.scheduler
            q = sched.queues.get(ev.run_id) if sched is not None else None
            if q is not None:
                q.waiting.pop(ev.index, None)
            self.fail(ev, code, message)
        return len(failed)

    def fail_waiting(self, rep: Replica, run_id: str, code: str, message: str) -> None:
        """Drop a run's queue on `rep` and fail the events that were waiting in it."""
        q = rep.scheduler.drop(run_id) if rep.scheduler else None
        for waiting in q.waiting.values() if q else ():
            ev = self.live.get(waiting.id)
            if ev is not None:
                self.fail(ev, code, message)

    def fail_unfinished_after_restart(self) -> None:
        for rec in self.store.unfinished_events():
            res = EventResult.failure(
                "server_restarted",
                "the server restarted while this event was "
                "queued or running, and the run's in-memory weights were lost; "
                "restore the run from a saved state and send it again",
            )
            self.store.update_event(rec.id, status="failed", response=res.pack())


def _all_failed(plan: CyclePlan, code: str, message: str) -> dict[str, EventOutcome]:
    return {ev.id: EventOutcome(error=(code, message)) for evs in plan.runs.values() for ev in evs}
