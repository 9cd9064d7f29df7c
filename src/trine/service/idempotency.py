"""One request id, one piece of work: the idempotency primitive of events and samples.

A client retries a request under the id it first used. While the first call runs, a retry joins it
(a keyed future); once it is stored, the caller finds the stored answer. Either way the retry must
carry the same body: its fingerprint (a hash the front end computes over what a retry must repeat)
must equal the first's, or the retry is a 409 that names the id. An empty fingerprint is unchecked.

Invariants
- At most one call runs per key at a time; every joiner gets its result or its exception, and a
  joiner that is cancelled does not cancel the work (`asyncio.shield`).
- The key is free again once the call ends, whatever the outcome: the caller stores what a later
  retry must find before the call returns.
"""

from __future__ import annotations

import asyncio
from typing import Awaitable, Callable, Generic, Hashable, TypeVar

from .errors import Conflict

T = TypeVar("T")


def check_same_body(first: str | None, again: str | None, *, what: str, code: str) -> None:
    """A reused id must carry the request it was first used for: `what` names the id."""
    if first and again and first != again:
        raise Conflict(
            f"{what} was already used for a different request; a retry must resend the same body: give a "
            "new request its own id",
            code=code,
        )


class SingleFlight(Generic[T]):
    """Keyed futures: `run(key, fingerprint, work)` runs `work()` once per key at a time."""

    def __init__(self, *, what: Callable[[Hashable], str], code: str):
        self._what, self._code = what, code
        self._running: dict[Hashable, tuple[asyncio.Future, str]] = {}

    def __contains__(self, key: Hashable) -> bool:
        return key in self._running

    def check(self, key: Hashable, first: str | None, again: str | None) -> None:
        check_same_body(first, again, what=self._what(key), code=self._code)

    async def run(self, key: Hashable, fingerprint: str, work: Callable[[], Awaitable[T]]) -> T:
        """The result of `work()`, or of the call already running under `key` (a retry joins it)."""
        if key in self._running:
            fut, first = self._running[key]
            self.check(key, first, fingerprint)
            return await asyncio.shield(fut)
        fut = asyncio.get_running_loop().create_future()
        self._running[key] = (fut, fingerprint)
        try:
            out = await work()
        except BaseException as e:
            fut.set_exception(e)
            fut.exception()  # retrieved: joiners re-raise it, nobody else needs to
            raise
        finally:
            self._running.pop(key, None)
        fut.set_result(out)
        return out
