"""The order in which the sampler admits waiting requests: the `AdmissionPolicy` the scheduler
asks, first come first admitted (`FifoAdmission`), or fair across tenants (`FairAdmission`).

A request's tenant is `SampleRequest.tenant` (the service sets the caller's API key id). The
scheduler asks `peek(held)` for the next request whose tenant is not `held` (a tenant at its
concurrency limit); when it fits the KV pool, `pop(r)` admits it; when it does not, admission stops
for this step.
"""

from __future__ import annotations

from collections import deque
from typing import Collection, Protocol

from .sequence import Request


class AdmissionPolicy(Protocol):
    def push(self, r: Request) -> None: ...
    def peek(self, held: Collection[str] = ()) -> Request | None: ...
    def pop(self, r: Request) -> None: ...  # `r`, which peek() returned, is admitted
    def remove(self, r: Request) -> bool: ...  # False if `r` is not waiting
    def __len__(self) -> int: ...


class FifoAdmission:
    """First come, first admitted (among tenants not held)."""

    def __init__(self) -> None:
        self._queue: deque[Request] = deque()

    def push(self, r: Request) -> None:
        self._queue.append(r)

    def peek(self, held: Collection[str] = ()) -> Request | None:
        return next((r for r in self._queue if r.tenant not in held), None)

    def pop(self, r: Request) -> None:
        self.remove(r)

    def remove(self, r: Request) -> bool:
        """Take `r` out of the queue; False if it is not there."""
        try:
            self._queue.remove(r)
        except ValueError:
            return False
        return True

    def __len__(self) -> int:
        return len(self._queue)


def admission_cost(r: Request) -> int:
    """Tokens a request may cost the engine: its prompt, plus every sample's `max_tokens`."""
    return len(r.prompt) + r.samples * r.max_new


class FairAdmission:
    """Fair queuing by tokens across tenants (a virtual token counter).

    Each tenant's requests wait in arrival order. Every waiting tenant has a counter of the tokens
    (`admission_cost`) admitted for it since it started waiting; the next request is the head of
    the tenant with the lowest counter (ties: the earlier arrival). A tenant that starts waiting
    starts at the lowest counter among the tenants already waiting (0 if none), so time spent idle
    banks no credit and a flood banks no debt once it is served. So while tenants wait, the tokens
    admitted for any two of them differ by at most one request's cost; a single tenant is served
    first come, first admitted."""

    def __init__(self) -> None:
        self._queues: dict[str, deque[Request]] = {}
        self._charged: dict[str, int] = {}  # of the waiting tenants only

    def push(self, r: Request) -> None:
        t = r.tenant
        if t not in self._queues:
            self._charged[t] = min(self._charged.values(), default=0)
            self._queues[t] = deque()
        self._queues[t].append(r)

    def peek(self, held: Collection[str] = ()) -> Request | None:
        heads = [(self._charged[t], q[0].order, q[0]) for t, q in self._queues.items() if t not in held]
        return min(heads, key=lambda h: h[:2])[2] if heads else None

    def pop(self, r: Request) -> None:
        self._charged[r.tenant] += admission_cost(r)
        self.remove(r)

    def remove(self, r: Request) -> bool:
        """Take `r` out of its tenant's queue; False if it is not waiting."""
        t = r.tenant
        q = self._queues.get(t)
        if q is None or r not in q:
            return False
        q.remove(r)
        if not q:
            del self._queues[t], self._charged[t]
        return True

    def __len__(self) -> int:
        return sum(len(q) for q in self._queues.values())
