"""One training event, from acceptance to result: the one object the queues, the planner, the
executor and settling all hold.

Invariants
- It is made once, when its event is accepted (accept.py), after its record is stored; the same
  object waits in its run's `RunQueue`, is planned into a cycle (ordering.py) and settles
  (settle.py). `done` is set once, after its result is stored (or kept in memory: `unstored`).
- `id` is the stored event id (scoped `<event_id>~<run_id>` when another run used it first): the
  key of `Events.live` and of the engine's `CycleEvent` / outcome.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field

from ...engine.api import Op
from ...store import EventRecord
from .. import commands
from ..models import Replica


@dataclass(eq=False)
class Event:
    """An accepted training event: its record (status, cycle, result), its command as the front end
    sent it, its prepared engine op, the replica it runs on, and the cycle it was planned into."""

    record: EventRecord
    command: commands.TrainingCommand
    op: Op
    replica: Replica
    notes: dict = field(default_factory=dict)  # the front end's, stored with the result (EventResult.notes)
    cycle: int | None = None  # set when a cycle takes it
    done: asyncio.Event = field(default_factory=asyncio.Event)

    @property
    def id(self) -> str:
        return self.record.id

    @property
    def run_id(self) -> str:
        return self.record.run_id

    @property
    def index(self) -> int:
        return self.record.idx

    @property
    def type(self) -> str:
        return self.record.type
