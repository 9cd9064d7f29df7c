"""APIFuture: what every client call returns at once. `.result(timeout)` blocks; `await fut`
works in any event loop; `.map(fn)` derives a future (cancelling it cancels the source)."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable, Generator
from concurrent.futures import CancelledError, Future, InvalidStateError
from typing import Generic, TypeVar

T = TypeVar("T")
U = TypeVar("U")


class APIFuture(Generic[T]):
    def __init__(self, future: Future):
        self._future = future

    @staticmethod
    def completed(value: U) -> APIFuture[U]:
        f: Future = Future()
        f.set_result(value)
        return APIFuture(f)

    def result(self, timeout: float | None = None) -> T:
        return self._future.result(timeout=timeout)

    def done(self) -> bool:
        return self._future.done()

    def exception(self, timeout: float | None = None) -> BaseException | None:
        return self._future.exception(timeout=timeout)

    def cancel(self) -> bool:
        return self._future.cancel()

    def add_done_callback(self, fn: Callable[[APIFuture[T]], object]) -> None:
        self._future.add_done_callback(lambda _f: fn(self))

    def map(self, fn: Callable[[T], U]) -> APIFuture[U]:
        out: Future = Future()

        def resolve(src: Future) -> None:
            if out.done():
                return
            if src.cancelled():
                out.cancel()
                return
            try:
                value = fn(src.result())
            except CancelledError:
                out.cancel()
                return
            except BaseException as e:  # noqa: BLE001 - a future carries any failure
                settle(out, exc=e)
                return
            settle(out, value)

        self._future.add_done_callback(resolve)
        out.add_done_callback(lambda f: self._future.cancel() if f.cancelled() else None)
        return APIFuture(out)

    def __await__(self) -> Generator[object, None, T]:
        return asyncio.wrap_future(self._future).__await__()


def settle(f: Future, value=None, exc: BaseException | None = None) -> None:
    """Complete `f` unless it was cancelled meanwhile (by another thread)."""
    try:
        if exc is not None:
            f.set_exception(exc)
        else:
            f.set_result(value)
    except InvalidStateError:
        pass


def gather(futures: list[APIFuture]) -> APIFuture[list]:
    """One future for many: their results in the given order, or the first failure."""
    if not futures:
        return APIFuture.completed([])
    out: Future = Future()
    results: dict[int, object] = {}
    lock = threading.Lock()

    def resolve(i: int, src: Future) -> None:
        with lock:
            if out.done():
                return
            if src.cancelled():
                out.cancel()
                return
            exc = src.exception()
            if exc is not None:
                settle(out, exc=exc)
                return
            results[i] = src.result()
            if len(results) == len(futures):
                settle(out, [results[k] for k in range(len(futures))])

    for i, f in enumerate(futures):
        f._future.add_done_callback(lambda src, i=i: resolve(i, src))
    return APIFuture(out)
