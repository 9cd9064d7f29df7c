"""Executing one clock cycle inside the engine worker thread.

Phases, across all runs of the plan: pre (init_run, saves queued before any training), one batched
`Trainer.forward_backward(backward=False)` for every `forward`, one batched call for every
`forward_backward`, each run's optim step, then post saves. The sampler steps between micro-batches
and between phases (`worker.tick`).

Failure isolation: the trainer validates every entry before it computes anything, so if a batched
call raises ValueError the entries are retried one by one and only the culprit fails. Any other
exception fails the events of that call with `internal_error`.
"""
from __future__ import annotations

import logging
import math
import os
import shutil
import traceback
import uuid
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from ..engine.checkpoint import load_peft_adapter
from ..engine.model import Adapter
from ..engine.requests import ForwardResult
from .ops import EndRun, Forward, InitRun, OptimStep, Save
from .ordering import CyclePlan, Pending

log = logging.getLogger("trine.cycle")


@dataclass
class Outcome:
    """What one event produced. `result` is the event's result map (PyTRIO shapes)."""

    result: dict = field(default_factory=dict)
    error: tuple[str, str] | None = None  # (code, message)
    train_tokens: int = 0
    loss_tokens: int = 0
    snapshot: Adapter | None = None  # save_weights: the saved weights, for samplers
    size_bytes: int = 0


def wire_tensor(values, dtype: str = "<f4") -> dict:
    """A PyTRIO WireTensor map: raw little-endian bytes, shape [N] (N >= 1)."""
    arr = np.ascontiguousarray(np.asarray(values, dtype=dtype))
    return {"dtype": arr.dtype.str, "shape": list(arr.shape), "encoding": "raw_le",
            "data": arr.tobytes()}


def forward_outcome(op: Forward, res: ForwardResult) -> Outcome:
    if not math.isfinite(res.loss_sum):
        return Outcome(error=("non_finite_loss", f"the loss is {res.loss_sum}: check the logprobs and "
                              "advantages (policy losses) or weights you sent"))
    outputs = []
    for lp in res.logprobs:
        if op.auto_shift:  # target j was scored from position j-1; position 0 has no score
            lp = [0.0] + list(lp[:-1])
        outputs.append({"logprobs": wire_tensor(lp)})
    metrics = {"loss_sum": float(res.loss_sum), "loss_mean": float(res.loss_mean),
               "token_count": int(res.token_count)}
    return Outcome({"loss_fn_outputs": outputs, "metrics": metrics},
                   train_tokens=res.usage.train_tokens, loss_tokens=res.usage.loss_tokens)


def _failed(e: BaseException) -> Outcome:
    if isinstance(e, ValueError):
        return Outcome(error=(getattr(e, "code", "validation_failed"), str(e)))
    log.error("engine error:\n%s", traceback.format_exc())
    return Outcome(error=("internal_error", f"{type(e).__name__}: {e}"))


def replace_dir(tmp: Path, final: Path) -> None:
    """Move the fully written directory `tmp` to `final`, replacing any old one (crash-safe: the
    old directory stays complete until the new one is in place)."""
    trash = None
    if final.exists():
        trash = final.with_name(f".{final.name}.old-{uuid.uuid4().hex}")
        os.replace(final, trash)
    os.replace(tmp, final)
    if trash is not None:
        shutil.rmtree(trash, ignore_errors=True)


def save_dir(final: Path, write) -> int:
    """Run `write(tmp_dir) -> bytes` into a sibling temp directory, then move it into place."""
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = final.with_name(f".{final.name}.tmp-{uuid.uuid4().hex}")
    try:
        size = write(tmp)
        replace_dir(tmp, final)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return size


def adapter_bytes(adapter: Adapter) -> int:
    return sum(p.numel() * p.element_size() for p in adapter.parameters())


class CycleRunner:
    """Runs plans on one worker's trainer. Lives in the worker thread (no asyncio, no store)."""

    def __init__(self, worker):
        self.w = worker

    @property
    def trainer(self):
        return self.w.trainer

    def run(self, plan: CyclePlan) -> dict[str, Outcome]:
        out: dict[str, Outcome] = {}
        phases = plan.phases()
        for run_id, ph in phases.items():
            for ev in ph.pre:
                out[ev.event_id] = self._single(run_id, ev)
                self.w.tick()
        for backward in (False, True):
            entries = [(run_id, ev) for run_id, ph in phases.items() for ev in ph.forward
                       if ev.op.backward == backward]
            if entries:
                out.update(self._forward(entries, backward))
                self.w.tick()
        for run_id, ph in phases.items():
            for ev in ph.optim + ph.post:
                out[ev.event_id] = self._single(run_id, ev)
                self.w.tick()
        return out

    # ------------------------------------------------------------------ phases
    def _forward(self, entries: list[tuple[str, Pending]], backward: bool) -> dict[str, Outcome]:
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
        batch = [(run_id, ev.op.data, ev.op.loss_fn, ev.op.loss_config) for run_id, ev in live]
        return self.trainer.forward_backward(batch, backward=backward,
                                             between_microbatches=self.w.tick)

    def _single(self, run_id: str, ev: Pending) -> Outcome:
        op = ev.op
        try:
            if isinstance(op, InitRun):
                return self._init(run_id, op)
            if isinstance(op, EndRun):
                if self.trainer.has_run(run_id):
                    self.trainer.delete_run(run_id)
                return Outcome()
            if not self.trainer.has_run(run_id):
                return _not_initialized(run_id)
            if isinstance(op, OptimStep):
                metrics = self.trainer.optim_step(run_id, op.adam)
                return Outcome({"metrics": {k: float(v) for k, v in metrics.items()}})
            if isinstance(op, Save):
                return self._save(run_id, op)
        except Exception as e:
            return _failed(e)
        return Outcome(error=("invalid_event", f"{ev.type} cannot run in a training cycle"))

    def _init(self, run_id: str, op: InitRun) -> Outcome:
        if self.trainer.has_run(run_id):
            self.trainer.delete_run(run_id)
        if op.checkpoint_path:
            self.trainer.load_state(run_id, Path(op.checkpoint_path), with_optimizer=op.load_optimizer)
        else:
            self.trainer.create_run(run_id, op.lora)
        return Outcome()

    def _save(self, run_id: str, op: Save) -> Outcome:
        if op.kind == "state":
            size = save_dir(Path(op.path), lambda tmp: self.trainer.save_state(run_id, tmp))
            return Outcome(size_bytes=size)
        snap = self.trainer.snapshot(run_id)
        if op.path:
            size = save_dir(Path(op.path), lambda tmp: self.trainer.save_weights(run_id, tmp))
        else:
            size = adapter_bytes(snap)
        return Outcome(snapshot=snap, size_bytes=size)


def _not_initialized(run_id: str) -> Outcome:
    return Outcome(error=("run_not_initialized", f"training run {run_id} has no weights: its init_run "
                          "event did not succeed; create a new training client"))


def load_adapter(worker, path: str) -> Adapter:
    """Load a saved PEFT adapter directory onto the worker's model (worker thread)."""
    adapter, _ = load_peft_adapter(worker.model, path)
    adapter.requires_grad_(False)
    return adapter


def spill_adapter(worker, adapter: Adapter, lora, path: str, base_model: str) -> int:
    """Write an in-memory snapshot to disk so it can leave memory (worker thread)."""
    from ..engine.checkpoint import save_peft_adapter
    return save_dir(Path(path), lambda tmp: save_peft_adapter(adapter, lora, tmp, base_model,
                                                              worker.model.source_dir))
