"""The machinery behind one ServiceClient: a daemon thread running an asyncio loop, the HTTP
clients, settings, caches and the usage ledger. Every derived client shares it.

Sync methods run a coroutine on that loop and block until it returns (which for training and
sampling calls is right after the request is admitted: they return an APIFuture). `*_async`
methods await the same coroutine from the caller's own loop.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Coroutine
from concurrent.futures import Future
from typing import Any, TypeVar

import httpx

from ..errors import TrineError
from ..types import Usage
from .http import ControlHTTP, Settings

T = TypeVar("T")


class UsageLedger:
    """Running totals of Usage, safe to add to from any thread."""

    def __init__(self, parent: UsageLedger | None = None):
        self._lock = threading.Lock()
        self._total = Usage(cost=0.0)
        self._parent = parent

    def add(self, usage: Usage) -> None:
        with self._lock:
            self._total = self._total + usage
        if self._parent is not None:
            self._parent.add(usage)

    @property
    def total(self) -> Usage:
        with self._lock:
            return self._total.model_copy()


class Runtime:
    def __init__(self, base_url: str, api_key: str, settings: Settings):
        self.settings = settings
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, name="trine-sdk", daemon=True)
        self._thread.start()
        self.usage = UsageLedger()
        self.tokenizers: dict[str, Any] = {}
        self.tokenizer_lock = threading.Lock()
        self.closed = False
        self.flush_on_close: set[asyncio.Task] = set()  # requests close() lets finish (logged metrics)

        async def make_clients():
            return ControlHTTP(base_url, api_key, settings), httpx.AsyncClient(
                timeout=settings.request_timeout_s
            )

        self.control, self.actor_http = self.run_sync(make_clients())

    def _submit(self, coro: Coroutine[Any, Any, T]) -> Future:
        if self.closed:
            coro.close()
            raise TrineError("this ServiceClient is closed; create a new one", code="client_closed")
        return asyncio.run_coroutine_threadsafe(coro, self.loop)

    def run_sync(self, coro: Coroutine[Any, Any, T]) -> T:
        if threading.current_thread() is self._thread:
            coro.close()
            raise RuntimeError(
                "a blocking trine call was made from the SDK's own loop; use the *_async method"
            )
        return self._submit(coro).result()

    async def run_async(self, coro: Coroutine[Any, Any, T]) -> T:
        return await asyncio.wrap_future(self._submit(coro))

    def spawn(self, coro: Coroutine[Any, Any, T]) -> Future:
        return self._submit(coro)

    def close(self, on_loop: Coroutine[Any, Any, None] | None = None) -> None:
        """Run `on_loop` (last requests), close the HTTP clients and stop the loop thread."""
        if self.closed:
            return
        self.closed = True

        async def shutdown():
            try:
                if self.flush_on_close:
                    await asyncio.wait(self.flush_on_close, timeout=self.settings.connect_check_s)
                if on_loop is not None:
                    await on_loop
            finally:
                tasks = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
                for t in tasks:
                    t.cancel()
                await asyncio.gather(*tasks, return_exceptions=True)
                await self.control.aclose()
                await self.actor_http.aclose()

        try:
            asyncio.run_coroutine_threadsafe(shutdown(), self.loop).result(timeout=30)
        finally:
            self.loop.call_soon_threadsafe(self.loop.stop)
            self._thread.join(timeout=5)
