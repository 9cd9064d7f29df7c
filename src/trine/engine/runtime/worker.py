"""The engine worker: one thread per base model that owns its model, tokenizer, Sampler and Trainer.

The asyncio side never touches those objects. It hands work to the thread through an inbox and gets
asyncio futures back, settled with `loop.call_soon_threadsafe`:
- `sample(req)`: the request joins the Sampler's continuous batch; the future gets its SampleResult.
- `submit(fn)`: `fn(worker)` runs in the thread (a training cycle, a checkpoint load, ...).
- `sample_stream(req)`: an async iterator of the request's SampleDeltas, one per sequence per
  engine step, then its SampleResult; closing it early cancels the request.
- `cancel(request_id)`: the request stops and frees its sequences' KV blocks at the thread's next
  turn; its waiter gets `SampleCancelled`, and the future cancel() returns gets the partial result.

The thread also owns the adapter table (`adapters`, adapters.py: snapshots by checkpoint id and
inflight targets); a sample request names its weights by `weights.adapter` and the thread resolves
them when the request arrives. A full fine-tuning snapshot is a model of its own: its requests run
on `weights_samplers` (weights_samplers.py), stepped beside the base model's `sampler`.
`publish_target` moves a target and every live request on it to new weights between steps;
`drop_run`, `load_adapter`, `evict_adapter`, `spill_adapter` and `publish_checkpoint` are the jobs
on the trainer and that table that are not a cycle (cycle.py runs those). This class is the
machinery; `runtime.local.LocalEngine` is the interface the service uses.

Between jobs, and between training micro-batches (`tick`, passed as the Trainer's
`between_microbatches`), the thread admits newly arrived sample requests and runs one sampler step,
so sampling never waits for a whole training cycle.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import queue
import threading
import traceback
from collections import OrderedDict, deque
from pathlib import Path
from typing import Any, AsyncIterator, Callable

import torch

from ..api import LoRAConfig, SampleCancelled, SampleDelta, SampleRequest, SampleResult, VisionSpec
from ..config import EngineConfig
from ..model import invariant
from ..model.kernels.active import active, startup_line
from ..model.lora import Adapter, linear_shapes
from ..model.model import Transformer
from ..model.multimodal import load_image_encoder
from ..model.tokenizer import Tokenizer
from ..model.weights import auto_dtype, default_device, load_model, parse_dtype
from ..setup import configure
from ..trainer import full
from ..trainer.checkpoint import adapter_bytes, load_peft_adapter, save_dir, save_peft_adapter
from .adapters import AdapterTable
from .cpu_share import CpuShare, release_openmp_pool

log = logging.getLogger("trine.worker")


RECENT_CANCELS = 256  # cancel() answers kept, so a second cancel of a request gets the same one


_END = object()


def _settle(fut: asyncio.Future, result: Any = None, exc: BaseException | None = None) -> None:
    if fut.done():  # the waiter went away (cancelled); nothing to deliver
        return
    if exc is not None:
        fut.set_exception(exc)
    else:
        fut.set_result(result)


class EngineWorker:
    """Owns one base model. Create it, then `start(loop)` (loads the weights, blocks until ready)."""

    def __init__(
        self,
        name: str,
        model_dir: str | Path,
        config: EngineConfig = EngineConfig(),
    ):
        self.name = name
        self.config = config
        self.model_dir = Path(model_dir).resolve()
        self.model = self.tokenizer = self.sampler = self.trainer = self.encoder = None
        self.vision: VisionSpec | None = None  # how its model reads images; None: a text model
        self.kernels: dict[str, str] = {}  # op -> its path, decided at start (model/kernels/active.py)
        self.adapters = AdapterTable()  # snapshots and inflight targets (worker thread only)
        self.loop: asyncio.AbstractEventLoop | None = None
        self._inbox: queue.Queue = queue.Queue()
        self._jobs: deque = deque()
        self._pending: dict[str, asyncio.Future] = {}  # sampler request id -> future
        self._streams: dict[str, asyncio.Queue] = {}  # streaming request id -> its deltas
        self._cancels: OrderedDict[str, asyncio.Future] = OrderedDict()  # request id -> partial result
        self._thread: threading.Thread | None = None
        self._ready = threading.Event()
        self._start_error: BaseException | None = None
        self._stopping = False

    # ------------------------------------------------------------------ asyncio side
    def start(self, loop: asyncio.AbstractEventLoop, timeout: float | None = None) -> None:
        self.loop = loop
        self.exited = loop.create_future()  # set to the reason when the thread ends
        for line in configure():  # a no-op where the CLI or another engine did it already
            log.info("engine: %s", line)
        release_openmp_pool()  # this thread's OpenMP workers would throttle the engine thread's spin
        self._thread = threading.Thread(target=self._main, name=f"trine-engine-{self.name}", daemon=True)
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

    async def sample_stream(self, req: SampleRequest) -> AsyncIterator[SampleDelta | SampleResult]:
        """Queue a streaming sample request (a copy with `stream` set): yields its SampleDeltas as the
        engine steps, then its SampleResult (or raises its error). Closing the iterator before the
        result (the consumer went away) cancels the request."""
        req = dataclasses.replace(req, stream=True)
        deltas: asyncio.Queue = asyncio.Queue()
        fut = self.loop.create_future()
        fut.add_done_callback(lambda f: deltas.put_nowait(_END))  # after every delta posted before
        fut.add_done_callback(lambda f: f.cancelled() or f.exception())  # retrieved if unawaited
        self._streams[req.request_id] = deltas  # read by the worker thread after each step
        self._inbox.put(("sample", req, fut))
        settled = False
        try:
            while (item := await deltas.get()) is not _END:
                yield item
            settled = True
        finally:
            self._streams.pop(req.request_id, None)
            if not settled:
                self.cancel(req.request_id)
        yield fut.result()

    def cancel(self, request_id: str) -> asyncio.Future:
        """Stop a queued or running sample request and free its sequences' KV blocks; its waiter
        gets SampleCancelled. The returned future gets the request's partial result (what it had
        computed, usage included), or None if it was not running. Cancelling a request again
        returns the same future."""
        fut = self._cancels.get(request_id)
        if fut is None:
            fut = self._cancels[request_id] = self.loop.create_future()
            while len(self._cancels) > RECENT_CANCELS:
                self._cancels.popitem(last=False)
            self._inbox.put(("cancel", request_id, fut))
        return fut

    def submit(self, fn: Callable[["EngineWorker"], Any]) -> asyncio.Future:
        """Run `fn(self)` in the worker thread; jobs run one at a time, in submission order."""
        fut = self.loop.create_future()
        self._inbox.put(("job", fn, fut))
        return fut

    @property
    def queued_jobs(self) -> int:
        return len(self._jobs) + sum(1 for item in list(self._inbox.queue) if item and item[0] == "job")

    @property
    def pending_samples(self) -> int:
        return len(self._pending)

    @property
    def vocab_size(self) -> int:
        return self.model.cfg.vocab_size

    @property
    def max_seq_len(self) -> int:
        return self.model.cfg.max_position_embeddings

    # ------------------------------------------------------------------ worker thread
    def _main(self) -> None:
        try:
            cfg = self.config
            if cfg.num_threads:
                torch.set_num_threads(cfg.num_threads)
            from ..sampler.kv_cache import default_kv_cache_bytes
            from ..sampler.sampler import Sampler
            from ..trainer.trainer import Trainer
            from .weights_samplers import WeightsSamplers

            if cfg.batch_invariant:  # sampler = trainer, bit for bit
                invariant.enable(True)
            device = torch.device(cfg.device) if cfg.device else default_device()
            dtype, dtype_note = parse_dtype(cfg.dtype), "forced"
            if dtype is None:  # auto: measured on this machine (kernels/dtype_choice.py), cached
                chosen = auto_dtype(self.model_dir, device)
                dtype, dtype_note = chosen.dtype, chosen.reason
            self.model = load_model(self.model_dir, device=device, dtype=dtype)
            self.tokenizer = Tokenizer(self.model_dir)
            # a vision-language model's tower, shared by the sampler, the snapshots' and the trainer
            self.encoder = load_image_encoder(self.model_dir, self.model, cfg.image_cache_bytes)
            self.vision = self.encoder.spec if self.encoder else VisionSpec.from_dir(self.model_dir)
            self._new_sampler = lambda: Sampler(self.model, self.tokenizer, cfg.sampler, self.encoder)
            self.sampler = self._new_sampler()
            base_kv = cfg.sampler.kv_cache_bytes or default_kv_cache_bytes(self.model.device)
            full_kv = cfg.sampler.full_weights_kv_cache_bytes or base_kv // 4
            full_sampler = dataclasses.replace(cfg.sampler, kv_cache_bytes=full_kv)
            self.weights_samplers = WeightsSamplers(
                lambda m: Sampler(m, self.tokenizer, full_sampler, self.encoder)
            )
            budget = cfg.full_ft_memory_bytes or full.available_memory(self.model.device) * 3 // 4
            self.trainer = Trainer(
                self.model,
                base_model=self.name,
                config=cfg.trainer,
                full_tuning=full.tuning_shape(self.model, budget, full_kv),
                encoder=self.encoder,
            )
            # on CPU, the threads other processes leave it (cpu_share.py); a fixed count where the
            # numerics must be (--batch-invariant: its GEMMs' bits depend on the thread count)
            on_cpu = self.model.device.type == "cpu"
            self.cpu_share = CpuShare(cfg.num_threads, enabled=on_cpu and not cfg.batch_invariant)
            # the C kernels are built and the GEMM kernels chosen now, not in the first sample's step
            device, dtype = self.model.device, self.model.dtype
            self.kernels = active(device, dtype, linear_shapes(self.model), cfg.gemm)
            log.info("engine %s: %s", self.name, startup_line(self.kernels, device, dtype, dtype_note))
        except BaseException as e:  # reported to start()
            self._start_error = e
            self._ready.set()
            return
        self._ready.set()
        reason = "stopped"
        try:
            self._serve()
        except BaseException as e:  # a bug in the loop itself: report it as the engine lost
            log.error("engine thread died:\n%s", traceback.format_exc())
            reason = f"engine thread died: {type(e).__name__}: {e}"
        try:
            for fut in list(self._pending.values()) + [f for _, f in self._jobs]:
                self._post(fut, exc=RuntimeError(f"the engine worker {reason}"))
            self._post(self.exited, reason)
        except RuntimeError:  # the event loop is closed: nobody is waiting any more
            pass

    def _sampling(self) -> bool:
        return self.sampler.has_work() or self.weights_samplers.has_work()

    def _serve(self) -> None:
        while not self._stopping:
            self._drain(block=not (self._jobs or self._sampling()))
            if self._jobs:
                fn, fut = self._jobs.popleft()
                self.cpu_share.adapt()
                try:
                    result = fn(self)
                except BaseException as e:  # delivered to the awaiting coroutine
                    if not isinstance(e, ValueError):
                        log.error("engine job failed:\n%s", traceback.format_exc())
                    self._post(fut, exc=e)
                else:
                    self._post(fut, result)
            elif self._sampling():
                self._step()

    def tick(self) -> None:
        """Admit new sample requests and run one sampler step. Worker thread only."""
        self._drain(block=False)
        if self._sampling():
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
                self._cancel(obj, fut)
                continue
            try:
                obj, weights = self.adapters.resolve(obj)
                if isinstance(weights, Transformer):  # a full fine-tuning snapshot
                    self.weights_samplers.add(obj, weights)
                else:
                    self.sampler.add(obj, weights)
            except ValueError as e:
                self._post(fut, exc=e)
            else:
                self._pending[obj.request_id] = fut

    def publish_target(self, target: str, version: int, adapter: Adapter) -> None:
        """Inflight target `target` now has weights `adapter` at `version` (worker thread): new
        requests on it start there, live ones switch at their next step. An older version than the
        one held is ignored. Full fine-tuning weights have no inflight targets."""
        if isinstance(adapter, Transformer):
            raise ValueError(
                "inflight samplers follow LoRA runs; sample a full fine-tuning run from a weights "
                "save (save_weights_for_sampler), which is a snapshot"
            )
        if self.adapters.publish(target, version, adapter):
            self.sampler.publish(target, version, adapter)

    def drop_run(self, run_id: str) -> None:
        """Free a run's adapter, optimizer state and inflight target (worker thread). Requests running
        on the target keep the weights they hold until they finish; new ones are refused."""
        if self.trainer.has_run(run_id):
            self.trainer.delete_run(run_id)
        self.adapters.drop_target(run_id)

    def publish_checkpoint(self, target: str, version: int, checkpoint_id: str) -> None:
        """Point inflight target `target` at the adapter held under `checkpoint_id` (worker thread)."""
        self.publish_target(target, version, self.adapters.snapshot(checkpoint_id))

    def load_adapter(self, checkpoint_id: str, path: str) -> int:
        """Load a saved PEFT adapter directory (or a full fine-tuning run's model directory) into
        the adapter table (worker thread); bytes held."""
        if full.is_full_checkpoint(path):
            weights = load_model(path, device=self.model.device, dtype=self.model.dtype)
            if weights.cfg != self.model.cfg:
                raise ValueError(f"{path}: its config.json describes another model than {self.name}")
        else:
            weights, _ = load_peft_adapter(self.model, path)
        weights.requires_grad_(False)
        self.adapters.hold(checkpoint_id, weights)
        return adapter_bytes(weights)

    def evict_adapter(self, checkpoint_id: str) -> None:
        """Let a checkpoint's weights leave memory (worker thread); a full snapshot's sampler and KV
        pool go too once its last request is done."""
        self.adapters.evict(checkpoint_id)
        self.weights_samplers.prune(self.adapters.holds)

    def spill_adapter(self, checkpoint_id: str, lora: LoRAConfig, path: str) -> int:
        """Write an in-memory snapshot to disk so it can leave memory (worker thread); bytes written."""
        weights = self.adapters.snapshot(checkpoint_id)
        if isinstance(weights, Transformer):
            facts = full.full_facts(self.name, self.model.source_dir, lora)
            return save_dir(Path(path), lambda tmp: full.write_weights(weights, tmp, facts))
        return save_dir(
            Path(path), lambda tmp: save_peft_adapter(weights, lora, tmp, self.name, self.model.source_dir)
        )

    def _cancel(self, request_id: str, done: asyncio.Future) -> None:
        fut = self._pending.pop(request_id, None)
        partial = None
        if fut is not None:  # else finished (or refused) already
            samplers = self.weights_samplers if self.weights_samplers.owns(request_id) else self.sampler
            partial = samplers.cancel(request_id)  # frees its sequences and KV blocks now
            self._post(fut, exc=SampleCancelled(f"sample request {request_id} was cancelled"))
        self._post(done, partial)

    def _step(self) -> None:
        self.cpu_share.adapt()
        try:
            results: list[SampleResult] = self.sampler.step() if self.sampler.has_work() else []
            results += self.weights_samplers.step()
        except Exception as e:  # an engine bug: fail what is running, start from clean samplers
            log.error("sampler step failed:\n%s", traceback.format_exc())
            for fut in self._pending.values():
                self._post(fut, exc=RuntimeError(f"sampling failed: {e}"))
            self._pending.clear()
            self.sampler = self._new_sampler()
            self.weights_samplers.clear()
            return
        for d in self.sampler.take_deltas() + self.weights_samplers.take_deltas():
            deltas = self._streams.get(d.request_id)
            if deltas is not None:
                self.loop.call_soon_threadsafe(deltas.put_nowait, d)
        for r in results:
            fut = self._pending.pop(r.request_id, None)
            if fut is not None:
                self._post(fut, r)
