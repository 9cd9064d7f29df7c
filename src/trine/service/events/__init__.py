"""Training events: acceptance (idempotent, ordered), execution in clock cycles, settling.

One accepted event is one `Event` (event.py) until it settles. `Events` is three parts on one
state (state.py): `Accepting` (accept.py), `Settling` (settle.py: the cycle executor, settle, fail)
and `Reading` (reads.py: the event long-poll, records, what the live events add up to).

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
  index may be sent again). A refused event (a 4xx/5xx answer) takes no index; but clients that
  number their calls (Tinker's seq_id, PyTRIO's event index) submit through `submit_or_refuse`,
  where a command refused for its content still takes its index, as a `Refused` event stored under
  the type it was sent as, which fails with the refusal: only that call fails, and the client's
  later ones do not wait for the index (the official PyTRIO client treats any refused submit as
  fatal to its training client).
- New work passes the `WorkGate` (gate.py) first: none while the server drains for shutdown, none
  without the disk space it may need. A full disk while settling keeps the result in memory
  (readable, `unstored`) instead of losing it.
"""

from __future__ import annotations

from .accept import Accepting
from .event import Event
from .reads import Reading
from .settle import Settling
from .state import MISSING_INDEX_SECONDS


class Events(Accepting, Settling, Reading):
    """The training events of every base model: accept, execute, settle, read. Construct it with
    keywords only (state.py's `EventsState`)."""


__all__ = ["Event", "Events", "MISSING_INDEX_SECONDS"]
