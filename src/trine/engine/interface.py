"""The engine interface: the only calls the service makes on an engine (docs/architecture.md).

One `Engine` serves one base model: its weights, KV block pool + prefix cache, sampler, trainer
(training runs with their LoRA adapters and optimizer state) and a table of sampler adapters keyed
by checkpoint id. Two backends implement it:
- `engine.runtime.local.LocalEngine`: an engine thread inside the server process (the default);
- `engine.runtime.ray_backend.RayEngine`: one replica as a Ray actor (`trine serve --ray`), which holds a
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
- Every argument and result is a type of `engine.api` (torch-free): no closures, live modules or
  caller tensors cross the interface. A request names its adapter by `weights.adapter` (a
  checkpoint id that was loaded or published first; otherwise it fails with ValueError); the
  engine resolves it into its own request state.
- Usage is exact: `prompt_tokens == prefill_tokens + cached_tokens` for every SampleResult; a
  failed request reports none, a cancelled one reports what it computed only through `cancel()`
  (asking again returns the same answer), so the service meters it exactly once.
- Errors a caller caused raise ValueError (the service turns them into 400s); an engine that died
  raises `EngineLost` from every call, including calls in flight, promptly (no call hangs).
- `run_cycle` returns an outcome for every event of the cycle; events fail one by one, never the
  whole cycle, unless the engine itself fails.
- Calls are served in arrival order per engine; sampling keeps running between the micro-batches of
  a training cycle.
"""  # noqa: E501  (a table)

from __future__ import annotations

import abc
from typing import AsyncIterator

from .api import (
    CycleResult,
    EngineInfo,
    EngineStats,
    LoRAConfig,
    SampleDelta,
    SampleRequest,
    SampleResult,
    TrainingCycle,
)


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
