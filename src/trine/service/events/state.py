"""What the three parts of `Events` share: the collaborators and the live events (see __init__.py)."""

from __future__ import annotations

import logging
from typing import Callable

from ...store import EventRecord, Store
from ..activity import Activity
from ..checkpoints import Checkpoints
from ..gate import WorkGate
from ..idempotency import SingleFlight
from ..inflight import Inflight
from ..meter import Meter
from ..models import Replica, ServedModel
from ..ownership import Ownership
from ..quotas import KeyQuotas
from .event import Event

log = logging.getLogger("trine.service")
MISSING_INDEX_SECONDS = 60.0  # how long an event waits for a lower index that has not arrived


class EventsState:
    """The state `Accepting`, `Settling` and `Reading` work on; `Events` combines them."""

    def __init__(
        self,
        *,
        store: Store,
        ownership: Ownership,
        models: dict[str, ServedModel],
        checkpoints: Checkpoints,
        activity: Activity,
        meter: Meter,
        on_lost: Callable[[ServedModel, Replica, str], None],
        quotas: KeyQuotas | None = None,
        inflight: Inflight | None = None,
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
        self.live: dict[str, Event] = {}  # stored event id -> the event, until it settles
        self._accepting = SingleFlight(
            what=lambda event_id: f"event_id {event_id.split('~', 1)[0]}", code="event_id_reused"
        )  # stored event id -> its acceptance

    # the parts call each other through these (each defined in one part: reads.py, settle.py)
    def record(self, event_id: str) -> EventRecord | None:
        raise NotImplementedError

    def _stored_id(self, run_id: str, event_id: str) -> str:
        raise NotImplementedError

    def queued_tokens(self, api_key_id: str) -> int:
        raise NotImplementedError

    def fail(self, ev: Event, code: str, message: str) -> None:
        raise NotImplementedError
