"""Served base models and their engine replicas; where each training run lives.

A `ServedModel` has one or more `Replica`s, each an `Engine` (in-process thread or Ray actor) with
its own clock-cycle scheduler and its own set of resident sampler adapters. A training run lives on
one replica (its adapter and optimizer state), chosen by load when the run is first placed.

Invariants
- `ServedModel.info` (vocab size, context) is the same on every replica (same weights).
- A run's events only ever go to the replica it was placed on; a replica that is lost takes its
  runs with it (they are marked interrupted by the service, see `events/`).
- The full fine-tuning runs placed on a replica hold at most its budget
  (`EngineInfo.full_tuning.budget_bytes`): a run that fits no live replica is refused when it is
  placed (409 `insufficient_memory`, naming the bytes it needs and the most any replica has free).
"""

from __future__ import annotations

import asyncio
from collections import OrderedDict
from dataclasses import dataclass, field
from pathlib import Path

from ..engine.api import EngineInfo
from ..engine.interface import Engine
from .cycle_tally import CycleTally
from .errors import Conflict, NotFound
from .scheduler import ClockScheduler


@dataclass(eq=False)
class Replica:
    index: int
    engine: Engine
    scheduler: ClockScheduler | None = None
    # checkpoint ids whose sampler weights this replica holds, least recently used first (True: a
    # full fine-tuning snapshot, a model of its own)
    adapters: OrderedDict[str, bool] = field(default_factory=OrderedDict)
    loading: dict[str, asyncio.Future] = field(default_factory=dict)  # checkpoint id -> its load
    runs: set[str] = field(default_factory=set)  # training runs placed here
    full_bytes: dict[str, int] = field(default_factory=dict)  # full fine-tuning run -> memory it holds
    inflight_samples: int = 0  # what routing balances (placement balances `runs`)
    alive: bool = True
    targets: dict[str, int] = field(default_factory=dict)  # inflight target (run id) -> version held
    cycle_tally: CycleTally = field(default_factory=CycleTally)  # its clock cycles, for /metrics


@dataclass(eq=False)
class ServedModel:
    name: str
    dir: Path
    replicas: list[Replica]
    info: EngineInfo | None = None  # set when the engines start
    tokenizer: object | None = None  # tokenizers.ModelTokenizer, loaded at start
    placement: dict[str, Replica] = field(default_factory=dict)  # training run id -> its replica

    @property
    def model_id(self) -> str:
        """What PyTRIO clients get as `model_id`: a local directory they can load the tokenizer from."""
        return str(self.dir)

    @property
    def vocab_size(self) -> int:
        return self.info.vocab_size

    @property
    def max_seq_len(self) -> int:
        return self.info.max_seq_len

    def live_replicas(self) -> list[Replica]:
        return [r for r in self.replicas if r.alive]

    def place(self, run_id: str, full_bytes: int = 0) -> Replica:
        """The replica of a training run, placing it on the least-loaded live replica if new (a full
        fine-tuning run holding `full_bytes`: on one whose budget has them free)."""
        rep = self.placement.get(run_id)
        if rep is not None:
            if not rep.alive:
                raise Conflict(
                    f"training run {run_id} lived on an engine replica that was lost; "
                    "restore it from a saved state with create_training_client_from_state",
                    code="run_interrupted",
                )
            return rep
        live = self.live_replicas()
        if not live:
            raise Conflict(f"no engine replica of {self.name} is running", code="worker_lost", status=503)
        if full_bytes:
            live = self._with_room(live, full_bytes)
        rep = min(live, key=lambda r: (len(r.runs), r.inflight_samples, r.index))
        rep.runs.add(run_id)
        if full_bytes:
            rep.full_bytes[run_id] = full_bytes
        self.placement[run_id] = rep
        return rep

    def _with_room(self, live: list[Replica], need: int) -> list[Replica]:
        budget = self.info.full_tuning.budget_bytes if self.info and self.info.full_tuning else 0
        free = {r.index: budget - sum(r.full_bytes.values()) for r in live}
        fits = [r for r in live if free[r.index] >= need]
        if not fits:
            raise Conflict(
                f"full fine-tuning of {self.name} needs {need} bytes (its weights, a sampler "
                f"snapshot, gradients, fp32 masters and AdamW state); {max(max(free.values()), 0)} of "
                f"the {budget} bytes for full runs are free on its engine (--full-ft-memory): end a "
                "full run, or train LoRA",
                code="insufficient_memory",
            )
        return fits

    def unplace(self, run_id: str) -> Replica | None:
        rep = self.placement.pop(run_id, None)
        if rep is not None:
            rep.runs.discard(run_id)
            rep.full_bytes.pop(run_id, None)
        return rep


def resolve_model(models: dict[str, ServedModel], name_or_id: str) -> ServedModel:
    """A model by its name, its model_id (directory) or that directory's name."""
    s = (name_or_id or "").strip()
    for m in models.values():
        if s in (m.name, m.model_id, m.dir.name) or s.rstrip("/").split("/")[-1] == m.name:
            return m
    raise NotFound(
        f"base_model {name_or_id!r} is not served here; served models: {', '.join(models)}",
        code="model_not_found",
    )
