"""Per-run event ordering and the plan of one clock cycle; plain logic, no I/O, no asyncio.

`plan_cycle` builds the engine's `TrainingCycle` itself (each run's `RunShare` of `CycleEvent`s,
split by phase), with the service's `Event`s it holds beside it (`CyclePlan.runs`), for settling.

Invariants
- A run's events execute strictly in index order 1, 2, 3, ... with no gaps: an event that arrives
  early waits until every lower index has been taken.
- An index is used once: a second event id for a taken or waiting index is a Conflict.
- One cycle takes, per run, the longest head of its queue of the form
      (init | save)*  (forward | forward_backward)*  optimize_step?  save*
  (init, end and refused placeholders stand alone)
  so a loop that submits forward_backward and optimize_step before waiting needs one cycle per step,
  and gradients of all chunks of one step are accumulated before the step is applied.
- With a cycle token budget (`plan_cycle(cycle_tokens=)`), the budget is shared equally by the
  tenants (API keys) with work ready, and each tenant's share equally by its runs: a run whose
  forward events exceed its share takes the rest in later cycles (at least one event per cycle;
  its optimize_step follows its last forward). So one key's long queue delays another key's step
  by at most about its share of a cycle.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

from ..engine.api import CycleEvent, Refused, RunShare, TrainingCycle
from ..limits import (
    END_RUN,
    FORWARD,
    FORWARD_BACKWARD,
    INIT_RUN,
    MAX_WAITING_EVENTS_PER_RUN,
    OPTIMIZE_STEP,
    REFUSED,
    SAVE_STATE,
    SAVE_WEIGHTS,
)
from .errors import Conflict, TooManyRequests

_PRE, _FWD, _OPT, _POST = 0, 1, 2, 3
_FWD_TYPES = (FORWARD, FORWARD_BACKWARD)
_SAVE_TYPES = (SAVE_STATE, SAVE_WEIGHTS)


class Event(Protocol):
    """What ordering reads and writes of an `events.Event` (it cannot import it: events/ sits above
    the scheduler, which imports this module)."""

    cycle: int | None

    @property
    def id(self) -> str: ...

    @property
    def index(self) -> int: ...

    @property
    def type(self) -> str: ...

    @property
    def op(self) -> Any: ...


class RunQueue:
    """The not-yet-executed events of one training run, released in index order."""

    def __init__(
        self,
        run_id: str,
        next_index: int = 1,
        max_waiting: int = MAX_WAITING_EVENTS_PER_RUN,
        tenant: str = "",
    ):
        self.run_id = run_id
        self.tenant = tenant  # the API key id that owns the run
        self.next_index = next_index
        self.max_waiting = max_waiting
        self.waiting: dict[int, Event] = {}

    def add(self, ev: Event) -> None:
        if ev.index < self.next_index:
            raise Conflict(
                f"event index {ev.index} of run {self.run_id} was already used; the next "
                f"index is {self.next_index}",
                code="index_conflict",
            )
        other = self.waiting.get(ev.index)
        if other is not None and other.id != ev.id:
            raise Conflict(
                f"event index {ev.index} of run {self.run_id} is taken by event "
                f"{other.id}; send a new event with the next index",
                code="index_conflict",
            )
        if len(self.waiting) >= self.max_waiting:
            raise TooManyRequests(
                f"run {self.run_id} already has {self.max_waiting} events waiting; "
                "wait for some to finish before sending more"
            )
        self.waiting[ev.index] = ev

    def ready(self) -> bool:
        return self.next_index in self.waiting

    def take_cycle(self, forward_tokens: int | None = None) -> list[Event]:
        """Remove and return this run's share of the next cycle (possibly empty), in index order;
        forward events stop once they hold `forward_tokens` tokens (None: no bound)."""
        taken: list[Event] = []
        state = _PRE
        tokens = 0
        while self.next_index in self.waiting:
            t = _kind(self.waiting[self.next_index])
            if t in _FWD_TYPES and state <= _FWD:
                if forward_tokens is not None and tokens and tokens >= forward_tokens:
                    break
                state = _FWD
                tokens += _tokens(self.waiting[self.next_index])
            elif t == OPTIMIZE_STEP and state <= _FWD:
                state = _OPT
            elif t in _SAVE_TYPES:
                state = _PRE if state == _PRE else _POST
            elif t in (INIT_RUN, END_RUN, REFUSED) and state == _PRE and not taken:
                taken.append(self.waiting.pop(self.next_index))
                self.next_index += 1
                break  # init and end stand alone: later events depend on their outcome
            else:
                break
            taken.append(self.waiting.pop(self.next_index))
            self.next_index += 1
        return taken


def split_phases(events: list[Event]) -> RunShare:
    """One run's events of a cycle (in index order) as the engine's share, split by phase."""
    share = RunShare()
    trained = False
    for ev in events:
        entry = CycleEvent(ev.id, ev.type, ev.op)
        kind = _kind(ev)
        if kind in _FWD_TYPES:
            share.forward.append(entry)
            trained = True
        elif kind == OPTIMIZE_STEP:
            share.optim.append(entry)
            trained = True
        else:
            (share.post if trained else share.pre).append(entry)
    return share


@dataclass
class CyclePlan:
    """One planned cycle: what the engine runs (`cycle`) and the service's events it holds."""

    cycle: TrainingCycle
    runs: dict[str, list[Event]]  # run id -> its events this cycle, in index order

    @property
    def number(self) -> int:
        return self.cycle.number

    def __len__(self) -> int:
        return sum(len(v) for v in self.runs.values())


def _kind(ev: Event) -> str:
    """How an event is ordered: by its type, but a refused one (whatever type its request came as)
    as REFUSED: alone, and never in a forward batch."""
    return REFUSED if isinstance(ev.op, Refused) else ev.type


def _tokens(ev: Event) -> int:
    """Tokens of a forward event's batch."""
    return sum(len(d.tokens) for d in getattr(ev.op, "data", None) or ())


def plan_cycle(number: int, queues: list[RunQueue], cycle_tokens: int | None = None) -> CyclePlan:
    """Every ready run's share of cycle `number` (see the module docstring for `cycle_tokens`)."""
    ready = [q for q in queues if q.ready()]
    runs_of: dict[str, int] = {}
    for q in ready:
        runs_of[q.tenant] = runs_of.get(q.tenant, 0) + 1
    plan = CyclePlan(TrainingCycle(number, {}), {})
    for q in ready:
        share = None if cycle_tokens is None else max(1, cycle_tokens // len(runs_of) // runs_of[q.tenant])
        evs = q.take_cycle(share)
        if evs:
            for ev in evs:
                ev.cycle = number
            plan.runs[q.run_id] = evs
            plan.cycle.runs[q.run_id] = split_phases(evs)
    return plan
