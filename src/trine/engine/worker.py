"""The engine worker: one thread per base model that owns its model, tokenizer, Sampler and Trainer.

The asyncio side never touches those objects. It hands work to the thread through an inbox and gets
asyncio futures back, settled with `loop.call_soon_threadsafe`:
- `sample(req)`: the request joins the Sampler's continuous batch; the future gets its SampleResult.
- `sample_stream(req)`: the same, plus the request's SampleDeltas after every engine step, as an
  async iterator (`SampleStream`); `cancel(request_id)` (or `SampleStream.cancel()`) stops a
  request and frees its KV blocks at the worker's next turn, settling it with its partial result.
- `submit(fn)`: `fn(worker)` runs in the thread (a training cycle, a checkpoint load, ...).

Between jobs, and between training micro-batches (`tick`, passed as the Trainer's
`between_microbatches`), the thread admits newly arrived sample requests and runs one sampler step,
so sampling never waits for a whole training cycle.
"""
from __future__ import annotations

import asyncio
import logging
import queue
import threading
import traceback
from collections import deque
from pathlib import Path
from typing import Any, Callable

import torch

from .requests import SampleDelta, SampleRequest, SampleResult
from .tokenizer import Tokenizer
from .weights import load_model

log = logging.getLogger("trine.worker")


def _settle(fut: asyncio.Future, result: Any = None, exc: BaseException | None = None) -> None:
    if fut.done():  # the waiter went away (cancelled); nothing to deliver
        return
    if exc is not None:
        fut.set_exception(exc)
    else:
        fut.set_result(result)


class SampleStream:
    """A streaming sample request, on the asyncio side: `async for delta in stream` yields its
    SampleDeltas in order and ends when the request is settled; `result` is then its SampleResult
    (or raises its error). `cancel()` stops the request; `result` gets the partial result."""

    _END = object()

    def __init__(self, worker: "EngineWorker", request_id: str):
        self.worker = worker
        self.request_id = request_id
        self.result: asyncio.Future = worker.loop.create_future()
        self._deltas: asyncio.Queue = asyncio.Queue()
        self.result.add_done_callback(lambda _: self._deltas.put_nowait(self._END))

    def __aiter__(self):
        return self

    async def __anext__(self) -> SampleDelta:
        item = await self._deltas.get()
        if item is self._END:
            self._deltas.put_nowait(self._END)  # iterating again ends at once
            raise StopAsyncIteration
        return item

    def cancel(self) -> None:
        if not self.result.done():
            self.worker.cancel(self.request_id)


class EngineWorker:
    """Owns one base model. Create it, then `start(loop)` (loads the weights, blocks until ready)."""

    def __init__(self, name: str, model_dir: str | Path, *, device: str | None = None,
                 num_threads: int | None = None, sampler_options: dict | None = None,
                 trainer_options: dict | None = None):
        self.name = name
        self.model_dir = Path(model_dir).resolve()
        self.device = device
        self.num_threads = num_threads
        self.sampler_options = dict(sampler_options or {})
        self.trainer_options = dict(trainer_options or {})
        self.model = self.tokenizer = self.sampler = self.trainer = None
        self.loop: asyncio.AbstractEventLoop | None = None
        self._inbox: queue.Queue = queue.Queue()
        self._jobs: deque = deque()
        self._pending: dict[str, asyncio.Future] = {}  # sampler request id -> future
        self._streams: dict[str, SampleStream] = {}  # streaming request id -> its stream
        self._thread: threading.Thread | None = None
        self._ready = threading.Event()
        self._start_error: BaseException | None = None
        self._stopping = False

    # ------------------------------------------------------------------ asyncio side
    def start(self, loop: asyncio.AbstractEventLoop, timeout: float | None = None) -> None:
        self.loop = loop
        self._thread = threading.Thread(target=self._main, name=f"trine-engine-{self.name}",
                                        daemon=True)
        self._thread.start()
        self._ready.wait(timeout)
        if self._start_error is not None:
            raise self._start_error

    def stop(self, timeout: float = 10.0) -> None:
        self._stopping = True
        self._inbox.put(None)
        if self._thread is not None:
            self._thread.join(timeout)

    def sample(self, req: SampleRequest) -> asyncio.Future:
        """Queue a sample request (its request_id must be unique among pending ones)."""
        fut = self.loop.create_future()
        self._inbox.put(("sample", req, fut))
        return fut

    def sample_stream(self, req: SampleRequest) -> SampleStream:
        """Queue a sample request whose per-step deltas are streamed (sets `req.stream`)."""
        req.stream = True
        stream = SampleStream(self, req.request_id)
        self._streams[req.request_id] = stream  # read by the worker thread when it reports deltas
        stream.result.add_done_callback(lambda _: self._streams.pop(req.request_id, None))
        self._inbox.put(("sample", req, stream.result))
        return stream

    def cancel(self, request_id: str) -> None:
        """Stop a queued or running sample request and free its sequences' KV blocks; its future
        gets the partial result (sequences cut short have stop_reason "cancelled")."""
        self._inbox.put(("cancel", request_id, None))

    def submit(self, fn: Callable[["EngineWorker"], Any]) -> asyncio.Future:
        """Run `fn(self)` in the worker thread; jobs run one at a time, in submission order."""
        fut = self.loop.create_future()
        self._inbox.put(("job", fn, fut))
        return fut

    @property
    def vocab_size(self) -> int:
        return self.model.cfg.vocab_size

    @property
    def max_seq_len(self) -> int:
        return self.model.cfg.max_position_embeddings

    # ------------------------------------------------------------------ worker thread
    def _main(self) -> None:
        try:
            if self.num_threads:
                torch.set_num_threads(self.num_threads)
            from .sampler import Sampler
            from .trainer import Trainer
            self.model = load_model(self.model_dir, device=self.device)
            self.tokenizer = Tokenizer(self.model_dir)
            self._new_sampler = lambda: Sampler(self.model, self.tokenizer, **self.sampler_options)
            self.sampler = self._new_sampler()
            self.trainer = Trainer(self.model, base_model=self.name, **self.trainer_options)
        except BaseException as e:  # reported to start()
            self._start_error = e
            self._ready.set()
            return
        self._ready.set()
        while not self._stopping:
            self._drain(block=not (self._jobs or self.sampler.has_work()))
            if self._jobs:
                fn, fut = self._jobs.popleft()
                try:
                    result = fn(self)
                except BaseException as e:  # delivered to the awaiting coroutine
                    if not isinstance(e, ValueError):
                        log.error("engine job failed:\n%s", traceback.format_exc())
                    self._post(fut, exc=e)
                else:
                    self._post(fut, result)
            elif self.sampler.has_work():
                self._step()
        for fut in list(self._pending.values()) + [f for _, f in self._jobs]:
            self._post(fut, exc=RuntimeError("the engine worker stopped"))

    def tick(self) -> None:
        """Admit new sample requests and run one sampler step. Worker thread only."""
        self._drain(block=False)
        if self.sampler.has_work():
            self._step()

    def _post(self, fut: asyncio.Future, result: Any = None, exc: BaseException | None = None):
        self.loop.call_soon_threadsafe(_settle, fut, result, exc)

    def _drain(self, block: bool) -> None:
        while True:
            try:
                item = self._inbox.get(block=block, timeout=0.5 if block else None)
            except queue.Empty:
                return
            block = False
            if item is None:
                return
            kind, obj, fut = item
            if kind == "job":
                self._jobs.append((obj, fut))
                continue
            if kind == "cancel":
                self._cancel(obj)
                continue
            try:
                self.sampler.add(obj)
            except ValueError as e:
                self._post(fut, exc=e)
            else:
                self._pending[obj.request_id] = fut

    def _step(self) -> None:
        try:
            results: list[SampleResult] = self.sampler.step()
        except Exception as e:  # an engine bug: fail what is running, start from a clean sampler
            log.error("sampler step failed:\n%s", traceback.format_exc())
            for fut in self._pending.values():
                self._post(fut, exc=RuntimeError(f"sampling failed: {e}"))
            self._pending.clear()
            self.sampler = self._new_sampler()
            return
        for d in self.sampler.take_deltas():
            stream = self._streams.get(d.request_id)
            if stream is not None:
                self.loop.call_soon_threadsafe(stream._deltas.put_nowait, d)
        for r in results:
            fut = self._pending.pop(r.request_id, None)
            if fut is not None:
                self._post(fut, r)

    def _cancel(self, request_id: str) -> None:
        fut = self._pending.get(request_id)
        if fut is None:  # finished (or refused) already
            return
        result = self.sampler.cancel(request_id)
        if result is not None:
            del self._pending[request_id]
            self._post(fut, result)
