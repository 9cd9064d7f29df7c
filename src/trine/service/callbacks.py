"""The callbacks the `Service` hands its parts, each with a name that says what it does.

- `Spawn`: runs a coroutine in the background; the service keeps a reference to its task until it
  is done (so it is not collected half-way), and nobody awaits it.
- `OnLoop`: runs a function on the service's event loop: at once when called from that loop, soon
  when called from another thread (an engine's worker thread, a thread of `asyncio.to_thread`).
- `ReplicaLost`: reports that an engine replica of a model died, with the reason (faults.py).
"""

from __future__ import annotations

from typing import Any, Callable, Coroutine

from .models import Replica, ServedModel

Spawn = Callable[[Coroutine[Any, Any, Any]], None]
OnLoop = Callable[[Callable[[], None]], None]
ReplicaLost = Callable[[ServedModel, Replica, str], None]
