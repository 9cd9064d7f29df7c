"""Reading training events: an event's state (with a bounded long-poll for its result), its
record wherever it is (live, kept in memory unstored, or in the store), and what the live events
add up to (queued tokens per key, whether a run is busy, whether any is progressing)."""

from __future__ import annotations

import asyncio

from ...engine.api import Forward
from ...store import ApiKey, EventRecord
from ..errors import NotFound
from .state import EventsState


class Reading(EventsState):
    """event, record, queued_tokens, progressing, busy: reads only, nothing changes."""

    async def event(self, key: ApiKey, run_id: str, event_id: str, wait: float = 0.0) -> EventRecord:
        """The event's state, after waiting up to `wait` seconds for it to finish."""
        event_id = self._stored_id(run_id, event_id)
        ev = self.live.get(event_id)
        if ev is not None and wait > 0 and not ev.done.is_set():
            self.ownership.event(key, run_id, ev.record)
            try:
                await asyncio.wait_for(ev.done.wait(), wait)
            except asyncio.TimeoutError:
                pass
        rec = self.record(event_id)
        if rec is None:
            raise NotFound(f"event {event_id} not found", code="event_not_found")
        return self.ownership.event(key, run_id, rec)

    def record(self, event_id: str) -> EventRecord | None:
        ev = self.live.get(event_id)
        if ev is not None:
            return ev.record
        return self.unstored.get(event_id) or self.store.event(event_id)

    def _stored_id(self, run_id: str, event_id: str) -> str:
        """`event_id`, or `event_id~run_id` when another run used that id first."""
        rec = self.record(event_id)
        if rec is None or rec.run_id == run_id:
            return event_id
        return f"{event_id}~{run_id}"

    def queued_tokens(self, api_key_id: str) -> int:
        """Tokens of the key's forward events accepted and not yet running."""
        return sum(
            ev.op.tokens
            for ev in self.live.values()
            if ev.record.api_key_id == api_key_id
            and ev.record.status == "accepted"
            and isinstance(ev.op, Forward)
        )

    def progressing(self) -> bool:
        """Some accepted event is running or can run (not only waiting for a missing index)."""
        for ev in self.live.values():
            if ev.record.status == "running":
                return True
            sched = ev.replica.scheduler
            q = sched.queues.get(ev.run_id) if sched is not None else None
            if q is not None and q.ready():
                return True
        return False

    def busy(self, run_id: str) -> bool:
        return any(ev.run_id == run_id for ev in self.live.values())
