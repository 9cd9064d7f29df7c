"""The engine interface: the only calls the service makes on an engine (docs/architecture.md).

One `Engine` serves one base model: its weights, KV block pool + prefix cache, sampler, trainer
(training runs with their LoRA adapters and optimizer state) and a table of sampler adapters keyed
by checkpoint id. Two backends implement it:
- `engine.local.LocalEngine`: an engine thread inside the server process (the default);
- `engine.ray_backend.RayEngine`: one replica as a Ray actor (`trine serve --ray`), which holds a
  LocalEngine in its own process.

Calls (all async on the service's event loop; every argument and result is a plain dataclass of
ints, floats, strings and lists, so it pickles across a process boundary unchanged):

| call | in | out |
|---|---|---|
| `start()` | | `EngineInfo` (vocab size, context, ...) |
| `sample(req)` | `SampleRequest` | `SampleResult` with its `SampleUsage` |
| `sample_stream(req)` | `SampleRequest` | async iterator: a `SampleDelta` per sequence per engine step, then the `SampleResult`; closing it early cancels the request |
| `cancel(request_id)` | | frees the request's sequences and KV blocks at once; its waiter gets `SampleCancelled`; returns its partial `SampleResult` (None if it was not running) |
| `run_cycle(cycle)` | `TrainingCycle` (init/forward/forward_backward/optim/save/end of many runs) | `CycleResult` |
| `drop_run(run_id)` | | the run's adapter, optimizer state and inflight target are freed |
| `load_adapter(checkpoint_id, path)` | a PEFT directory every replica can read | bytes held |
| `evict_adapter(checkpoint_id)` | | the adapter leaves memory |
| `spill_adapter(checkpoint_id, lora, path)` | | bytes written (a published snapshot goes to disk) |
| `publish_target(target, version, checkpoint_id)` | a loaded checkpoint id | inflight target `target` (a training run id) moves to those weights at `version`; its live requests switch at their next step |
| `stats()` | | `EngineStats` |
| `lost()` | | returns (the reason) only once the engine is gone: a watch for faults |
| `stop()` | | |

Runs and their state: a run is created by the `InitRun` op of a cycle (fresh LoRA, or loaded from
a saved state: "load a run's state"), saved by its `Save` ops ("save a run's state" for kind
"state"; kind "weights" writes a PEFT adapter and *publishes a sampler snapshot* into the adapter
table under the save's checkpoint id), and dropped by `drop_run` or an `EndRun` op. Those travel in
cycles because they must run in the run's event order, between its training steps. An inflight
weights save (`Save.inflight`) also moves the run's *inflight target* on its replica to the new
snapshot at the next version; other replicas follow through `publish_target`. A sample request with
`inflight=True` names a target by `weights.adapter`: it runs the target's current weights, switching
between steps when they move, and records per token the version that produced it.

Invariants
- No closures, live modules or caller tensors cross the interface. `SampleRequest.adapter` is
  engine-internal: callers leave it None and name the adapter by `weights.adapter` (a checkpoint
  id that was loaded or published first; otherwise the request fails with ValueError).
- Usage is exact: `prompt_tokens == prefill_tokens + cached_tokens` for every SampleResult; a
  failed request reports none, a cancelled one reports what it computed only through `cancel()`
  (asking again returns the same answer), so the service meters it exactly once.
- Errors a caller caused raise ValueError (the service turns them into 400s); an engine that died
  raises `EngineLost` from every call, including calls in flight, promptly (no call hangs).
- `run_cycle` returns an outcome for every event of the cycle; events fail one by one, never the
  whole cycle, unless the engine itself fails.
- Calls are served in arrival order per engine; sampling keeps running between the micro-batches of
  a training cycle.
"""
from __future__ import annotations

import abc
from dataclasses import dataclass, field
from typing import AsyncIterator

from .lora import LoRAConfig
from .ops import CycleResult, TrainingCycle
from .requests import SampleDelta, SampleRequest, SampleResult  # noqa: F401  (part of the interface)
from .worker import SampleCancelled  # noqa: F401  (part of the interface)


class EngineLost(RuntimeError):
    """The engine (a replica) died: its in-flight calls fail with this, and so does every new call."""

    code = "worker_lost"


@dataclass
class EngineInfo:
    name: str  # the base model's name
    model_dir: str
    vocab_size: int
    max_seq_len: int
    architecture: str = ""  # the config's model_type (llama, qwen3, ...)
    block_size: int = 16  # KV block size of its prefix cache (routing hashes whole blocks)
    device: str = "cpu"
    replica: str = "local"  # where it runs: "local" or the Ray actor's node / id
    lora_features: dict[str, int] = field(default_factory=dict)  # lora.lora_features: sizes adapters


@dataclass
class CycleStats:
    number: int
    runs: list[str]  # the training runs it batched
    events: int
    seconds: float


@dataclass
class EngineStats:
    """A snapshot of one engine. `sampler` holds the KV pool and cache counters (blocks_total,
    blocks_used, blocks_cached, cache_hit_blocks, cache_queried_blocks, prompt/prefill/cached/sample
    token totals, waiting, running)."""

    name: str
    replica: str
    sampler: dict = field(default_factory=dict)
    queued_jobs: int = 0  # training cycles and adapter loads waiting for the thread
    pending_samples: int = 0  # sample requests admitted and not finished
    runs: int = 0  # training runs held (adapters + optimizer state)
    adapters: int = 0  # sampler adapters held
    recent_cycles: list[CycleStats] = field(default_factory=list)


class Engine(abc.ABC):
    """One base model's engine. See the module docstring for the contract of each call."""

    info: EngineInfo | None = None

    @abc.abstractmethod
    async def start(self) -> EngineInfo: ...

    @abc.abstractmethod
    async def stop(self) -> None: ...

    @abc.abstractmethod
    async def sample(self, req: SampleRequest) -> SampleResult: ...

    @abc.abstractmethod
    def sample_stream(self, req: SampleRequest) -> AsyncIterator[SampleDelta | SampleResult]: ...

    @abc.abstractmethod
    async def cancel(self, request_id: str) -> SampleResult | None: ...

    @abc.abstractmethod
    async def run_cycle(self, cycle: TrainingCycle) -> CycleResult: ...

    @abc.abstractmethod
    async def drop_run(self, run_id: str) -> None: ...

    @abc.abstractmethod
    async def load_adapter(self, checkpoint_id: str, path: str) -> int: ...

    @abc.abstractmethod
    async def evict_adapter(self, checkpoint_id: str) -> None: ...

    @abc.abstractmethod
    async def spill_adapter(self, checkpoint_id: str, lora: LoRAConfig, path: str) -> int: ...

    @abc.abstractmethod
    async def publish_target(self, target: str, version: int, checkpoint_id: str) -> None: ...

    @abc.abstractmethod
    async def stats(self) -> EngineStats: ...

    @abc.abstractmethod
    async def lost(self) -> str: ...
