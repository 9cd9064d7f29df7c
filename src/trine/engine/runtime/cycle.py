"""Executing one clock cycle inside the engine worker thread, on its `EngineWorker`'s trainer.

Phases, across all runs of the cycle: pre (init_run, saves queued before any training), one batched
`Trainer.forward_backward(backward=False)` for every `forward`, one batched call for every
`forward_backward`, each run's optim step, then post saves. The sampler steps between micro-batches
and between phases (`EngineWorker.tick`).

Failure isolation: every forward op was checked when its event was accepted (engine/prepare.py); an
op that was not (a direct caller's) is checked by the trainer before it computes anything, so if a
batched call raises ValueError the entries are retried one by one and only the culprit fails. Any other
exception fails the events of that call with `internal_error`, except a save that finds the disk
full: it fails with `disk_full`, naming the checkpoint's path and the bytes free there.
"""

from __future__ import annotations

import logging
import math
import time
import traceback
from pathlib import Path
from typing import TYPE_CHECKING

from ...diskspace import DiskFull, raise_if_full
from ..api import (
    CycleEvent,
    CycleResult,
    EndRun,
    EventOutcome,
    Forward,
    InitRun,
    OptimStep,
    Refused,
    Save,
    TrainingCycle,
)
from ..trainer.checkpoint import adapter_bytes, by_uri, save_dir
from ..trainer.trainer import ForwardResult, Trainer

if TYPE_CHECKING:  # the worker imports this module's runner's inputs, not the other way round
    from .worker import EngineWorker

log = logging.getLogger("trine.cycle")


def forward_outcome(op: Forward, res: ForwardResult) -> EventOutcome:
    if res.error:
        return EventOutcome(error=("custom_loss_failed", res.error))
    if not math.isfinite(res.loss_sum):
        return EventOutcome(
            error=(
                "non_finite_loss",
                f"the loss is {res.loss_sum}: check the logprobs "
                "and advantages (policy losses) or weights you sent",
            )
        )
    logprobs = [[float(x) for x in lp] for lp in res.logprobs]
    losses = [[float(x) for x in loss] for loss in res.losses]
    metrics = {
        "loss_sum": float(res.loss_sum),
        "loss_mean": float(res.loss_mean),
        "token_count": int(res.token_count),
        **res.metrics,  # a custom loss's own (custom/<name>:sum|mean)
    }
    return EventOutcome(
        logprobs=logprobs,
        losses=losses,
        metrics=metrics,
        train_tokens=res.usage.train_tokens,
        train_sequence_tokens=res.usage.sequence_tokens,
        loss_tokens=res.usage.loss_tokens,
    )


def _timed(started: float, outcome: EventOutcome) -> EventOutcome:
    """`outcome` with the wall-clock span of the step that computed it, from `started` to now."""
    outcome.started_at, outcome.ended_at = started, time.time()
    return outcome


def _failed(e: BaseException) -> EventOutcome:
    if isinstance(e, DiskFull):  # the server's disk, not the event: coded, naming the path
        return EventOutcome(error=(e.code, str(e)))
    if isinstance(e, ValueError):
        return EventOutcome(error=(getattr(e, "code", "validation_failed"), str(e)))
    log.error("engine error:\n%s", traceback.format_exc())
    return EventOutcome(
        error=(
            "internal_error",
            f"an internal error in the engine ({type(e).__name__}); the server logged it",
        )
    )


class CycleRunner:
    """Runs cycles on one worker's trainer. Lives in the worker thread (no asyncio, no store).

    A weights save publishes its snapshot into the worker's adapter table under the checkpoint id."""

    def __init__(self, worker: EngineWorker):
        self.w = worker

    @property
    def trainer(self) -> Trainer:
        return self.w.trainer

    def run(self, cycle: TrainingCycle) -> CycleResult:
        t0, started = time.perf_counter(), time.time()
        out: dict[str, EventOutcome] = {}
        for run_id, share in cycle.runs.items():
            for ev in share.pre:
                out[ev.event_id] = _timed(time.time(), self._single(run_id, ev))
                self.w.tick()
        for backward in (False, True):
            entries = [
                (run_id, ev)
                for run_id, share in cycle.runs.items()
                for ev in share.forward
                if ev.op.backward == backward
            ]
            if entries:
                t = time.time()
                for event_id, o in self._forward(entries, backward).items():
                    out[event_id] = _timed(t, o)
                self.w.tick()
        for run_id, share in cycle.runs.items():
            for ev in share.optim + share.post:
                out[ev.event_id] = _timed(time.time(), self._single(run_id, ev))
                self.w.tick()
        return CycleResult(cycle.number, out, time.perf_counter() - t0, started)

    # ------------------------------------------------------------------ phases
    def _forward(self, entries: list[tuple[str, CycleEvent]], backward: bool) -> dict[str, EventOutcome]:
        out = {}
        live = []
        for run_id, ev in entries:
            if not self.trainer.has_run(run_id):
                out[ev.event_id] = _not_initialized(run_id)
            else:
                live.append((run_id, ev))
        if not live:
            return out
        try:
            results = self._call(live, backward)
        except ValueError as e:
            if len(live) == 1:
                out[live[0][1].event_id] = _failed(e)
                return out
            for entry in live:  # nothing was computed: find the culprit entry by entry
                out.update(self._forward([entry], backward))
            return out
        except Exception as e:
            for _, ev in live:
                out[ev.event_id] = _failed(e)
            return out
        for (_, ev), res in zip(live, results):
            out[ev.event_id] = forward_outcome(ev.op, res)
        return out

    def _call(self, live, backward):
        batch = [(run_id, ev.op) for run_id, ev in live]
        return self.trainer.forward_backward(batch, backward=backward, between_microbatches=self.w.tick)

    def _single(self, run_id: str, ev: CycleEvent) -> EventOutcome:
        op = ev.op
        try:
            if isinstance(op, Refused):
                return EventOutcome(error=(op.code, op.message))
            if isinstance(op, InitRun):
                return self._init(run_id, op)
            if isinstance(op, EndRun):
                self.w.drop_run(run_id)
                return EventOutcome()
            if not self.trainer.has_run(run_id):
                return _not_initialized(run_id)
            if isinstance(op, OptimStep):
                metrics = self.trainer.optim_step(run_id, op.params)
                return EventOutcome(metrics={k: float(v) for k, v in metrics.items()})
            if isinstance(op, Save):
                return self._save(run_id, op)
        except Exception as e:
            return _failed(e)
        return EventOutcome(error=("invalid_event", f"{ev.type} cannot run in a training cycle"))

    def _init(self, run_id: str, op: InitRun) -> EventOutcome:
        if self.trainer.has_run(run_id):
            self.trainer.delete_run(run_id)
        if op.checkpoint_path:
            try:
                if not Path(op.checkpoint_path).is_dir():
                    raise FileNotFoundError(op.checkpoint_path)
                self.trainer.load_state(
                    run_id, Path(op.checkpoint_path), with_optimizer=op.load_optimizer, optimizer=op.optimizer
                )
            except FileNotFoundError:  # deleted after the event was accepted (or while it loaded)
                error = ValueError(
                    f"checkpoint {op.checkpoint_uri} not found: it was deleted after this "
                    "restore was accepted; restore from another checkpoint"
                )
                error.code = "checkpoint_not_found"
                raise error from None
            except (ValueError, OSError) as e:
                error = ValueError(by_uri(str(e), op.checkpoint_path, op.checkpoint_uri))
                error.code = "checkpoint_invalid"
                raise error from None
        else:
            self.trainer.create_run(run_id, op.lora, optimizer=op.optimizer)
        return EventOutcome()

    def _save(self, run_id: str, op: Save) -> EventOutcome:
        try:
            return self._write_save(run_id, op)
        except OSError as e:  # a full disk names the checkpoint's path and its free bytes
            raise_if_full(e, op.path, f"save {op.uri}")
            raise

    def _write_save(self, run_id: str, op: Save) -> EventOutcome:
        if op.kind in ("state", "external"):
            write = self.trainer.save_state if op.kind == "state" else self.trainer.save_merged
            size = save_dir(Path(op.path), lambda tmp: write(run_id, tmp))
            return EventOutcome(size_bytes=size)
        snap = self.trainer.snapshot(run_id)
        version = 0
        if op.inflight:  # first: a full run's weights are refused before anything is written or held
            version = self.w.adapters.target_version(run_id) + 1
            self.w.publish_target(run_id, version, snap)
        if op.path:
            size = save_dir(Path(op.path), lambda tmp: self.trainer.save_weights(run_id, tmp))
        else:
            size = adapter_bytes(snap)
        if op.checkpoint_id:
            self.w.adapters.hold(op.checkpoint_id, snap)
        return EventOutcome(size_bytes=size, weights_version=version)


def _not_initialized(run_id: str) -> EventOutcome:
    return EventOutcome(
        error=(
            "run_not_initialized",
            f"training run {run_id} has no weights: its "
            "init_run event did not succeed; create a new training client",
        )
    )
