"""The training events of one run: submitted in order, polled concurrently.

Invariants (what the server's per-run FIFO relies on):
- events are POSTed one at a time, in the order the client calls were made, with metadata
  index 1, 2, 3... (no gaps; it advances only when the server accepted the event);
- `step` counts completed forward_backward groups; the chunks of one group share a step;
- a retried POST reuses its event id (the server deduplicates; `409 event_exists` = accepted);
- at most `max_events_in_flight` events are accepted-but-unfinished at once.
An event the server refuses with a 4xx was not accepted: its future fails, its index is reused by
the next event, and the run goes on. A POST whose fate is unknown (network errors or 5xx after
every retry), or any failure of one chunk of a split forward_backward, breaks the run: later calls
raise RunBrokenError (the gradient state is unknown).
Futures resolve to the server's whole terminal event response (result, usage, cycle...).
"""

from __future__ import annotations

import asyncio
from concurrent.futures import Future
from dataclasses import dataclass

from ..errors import ActorAPIError, EventFailedError, RunBrokenError, TrineError
from ..limits import FORWARD_BACKWARD
from .futures import settle
from .http import ActorConnection, Settings
from .wire import event_envelope, new_event_id

TERMINAL = ("succeeded", "failed")
MSGPACK = "application/msgpack"


@dataclass
class _Queued:
    type: str
    payload: dict
    future: Future
    ends_step: bool
    breaks_run: bool


class EventQueue:
    def __init__(self, conn: ActorConnection, run_id: str, settings: Settings, sdk_version: str):
        self.conn = conn
        self.run_id = run_id
        self.settings = settings
        self.sdk_version = sdk_version
        self.index = 1
        self.step = 0
        self.broken: str | None = None
        self._queue: asyncio.Queue[_Queued] = asyncio.Queue()
        self._slots = asyncio.Semaphore(settings.max_events_in_flight)
        self._polls: set[asyncio.Task] = set()
        self._dispatcher = asyncio.ensure_future(self._dispatch())

    def submit(self, event_type: str, payloads: list[dict]) -> list[Future]:
        """Admit a group of events atomically (no await: nothing can interleave)."""
        if self.broken:
            raise RunBrokenError(self.broken, code="training.run_broken")
        items = [
            _Queued(
                event_type,
                p,
                Future(),
                ends_step=event_type == FORWARD_BACKWARD and k == len(payloads) - 1,
                breaks_run=event_type == FORWARD_BACKWARD and len(payloads) > 1,
            )
            for k, p in enumerate(payloads)
        ]
        for item in items:
            self._queue.put_nowait(item)
        return [item.future for item in items]

    def _break(self, reason: str) -> None:
        self.broken = (
            self.broken
            or f"training run {self.run_id} cannot continue: {reason}; create a new training client"
        )

    async def _dispatch(self) -> None:
        try:
            await self._dispatch_forever()
        except asyncio.CancelledError:  # the ServiceClient is closing
            while not self._queue.empty():
                settle(self._queue.get_nowait().future, exc=_closed())
            raise

    async def _dispatch_forever(self) -> None:
        while True:
            item = await self._queue.get()
            if item.future.done():
                continue
            if self.broken:
                settle(item.future, exc=RunBrokenError(self.broken, code="training.run_broken"))
                continue
            event_id = new_event_id()
            body = event_envelope(
                item.type,
                item.payload,
                event_id=event_id,
                index=self.index,
                step=self.step,
                run_id=self.run_id,
                sdk_version=self.sdk_version,
            )
            try:
                await self._slots.acquire()
                response = await self._post(event_id, body)
            except asyncio.CancelledError:
                settle(item.future, exc=_closed())
                raise
            except Exception as e:  # noqa: BLE001 - delivered through the event's future
                refused = isinstance(e, ActorAPIError) and 400 <= e.status_code < 500
                if not refused or item.breaks_run:
                    self._break(f"submitting {item.type} failed ({e})")
                settle(item.future, exc=e)
                self._slots.release()
                continue
            self.index += 1
            if item.ends_step:
                self.step += 1
            if response.get("status") in TERMINAL:
                self._finish(item, response)
                self._slots.release()
            else:
                task = asyncio.ensure_future(self._poll(item, event_id))
                self._polls.add(task)
                task.add_done_callback(self._polls.discard)

    async def _post(self, event_id: str, body: bytes) -> dict:
        r = await self.conn.request(
            "POST", "v1/events", content=body, headers={"Content-Type": MSGPACK, "Accept": MSGPACK}
        )
        if r.status_code == 409:
            try:
                self.conn.raise_for_error(r, "event submit")
            except ActorAPIError as e:
                if e.code == "event_exists":
                    return {"status": "accepted", "event_id": event_id}
                raise
        response = self.conn.raise_for_error(r, "event submit")
        if not isinstance(response, dict) or response.get("event_id") != event_id:
            raise ActorAPIError(
                f"the server answered event {event_id} with a different event", code="actor.event_mismatch"
            )
        return response

    async def _poll(self, item: _Queued, event_id: str) -> None:
        wait = self.settings.poll_wait_s
        try:
            while not item.future.done():
                r = await self.conn.request(
                    "GET",
                    f"v1/events/{event_id}",
                    timeout=wait + 15,
                    headers={"Accept": MSGPACK, "Prefer": f"wait={wait}"},
                )
                response = self.conn.raise_for_error(r, f"event {event_id} poll")
                if isinstance(response, dict) and response.get("status") in TERMINAL:
                    self._finish(item, response)
                    return
                await asyncio.sleep(0.05)
        except asyncio.CancelledError:
            settle(item.future, exc=_closed())
            raise
        except Exception as e:  # noqa: BLE001 - delivered through the event's future
            if item.breaks_run:
                self._break(f"a chunk of a split forward_backward could not be polled ({e})")
            settle(item.future, exc=e)
        finally:
            self._slots.release()

    def _finish(self, item: _Queued, response: dict) -> None:
        if response["status"] == "succeeded":
            settle(item.future, response)
            return
        error = response.get("error") or {}
        if item.breaks_run:
            self._break("a chunk of a split forward_backward failed")
        settle(
            item.future,
            exc=EventFailedError(
                response.get("event_id", ""),
                str(error.get("code", "")),
                str(error.get("message", "the event failed")),
            ),
        )


def _closed() -> TrineError:
    return TrineError("the ServiceClient was closed before this event finished", code="client_closed")
