"""The in-process backend of the engine interface: one `EngineWorker` thread per base model.

Every call becomes a job or a sample request in the worker's inbox; results come back as asyncio
futures on the caller's loop. The Ray backend runs one of these inside each replica actor.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections import deque
from pathlib import Path
from typing import AsyncIterator

from ..api import (
    CycleResult,
    CycleStats,
    EngineInfo,
    EngineStats,
    LoRAConfig,
    SampleDelta,
    SampleRequest,
    SampleResult,
    TrainingCycle,
)
from ..config import EngineConfig
from ..interface import Engine
from ..model.lora import lora_features
from ..trainer.adapter_import import adapter_targets
from .cycle import CycleRunner
from .worker import EngineWorker

RECENT_CYCLES = 32


class LocalEngine(Engine):
    def __init__(
        self,
        name: str,
        model_dir: str | Path,
        config: EngineConfig = EngineConfig(),
        *,
        replica: str = "local",
    ):
        self.worker = EngineWorker(name, model_dir, config)
        self.replica = replica
        self.recent_cycles: deque[CycleStats] = deque(maxlen=RECENT_CYCLES)
        self._runner = CycleRunner(self.worker)

    async def start(self) -> EngineInfo:
        loop = asyncio.get_running_loop()
        await loop.run_in_executor(None, self.worker.start, loop)
        w = self.worker
        self.info = EngineInfo(
            w.name,
            str(w.model_dir),
            w.vocab_size,
            w.max_seq_len,
            w.model.cfg.model_type,
            w.sampler.block_size,
            str(w.model.device),
            self.replica,
            lora_features(w.model),
            vision=w.vision,
            linear_shapes=adapter_targets(w.model),
            full_tuning=w.trainer.full_tuning,
        )
        return self.info

    async def stop(self) -> None:
        await asyncio.get_running_loop().run_in_executor(None, self.worker.stop)

    async def sample(self, req: SampleRequest) -> SampleResult:
        return await self.worker.sample(req)

    async def sample_stream(self, req: SampleRequest) -> AsyncIterator[SampleDelta | SampleResult]:
        """A SampleDelta per sequence per engine step, then the result. Closing the iterator early
        cancels the request."""
        async with contextlib.aclosing(self.worker.sample_stream(req)) as items:
            async for item in items:
                yield item

    async def cancel(self, request_id: str) -> SampleResult | None:
        return await self.worker.cancel(request_id)

    async def run_cycle(self, cycle: TrainingCycle) -> CycleResult:
        res = await self.worker.submit(lambda w: self._runner.run(cycle))
        self.recent_cycles.append(CycleStats(cycle.number, list(cycle.runs), len(res.outcomes), res.seconds))
        return res

    async def drop_run(self, run_id: str) -> None:
        await self.worker.submit(lambda w: w.drop_run(run_id))

    async def load_adapter(self, checkpoint_id: str, path: str) -> int:
        return await self.worker.submit(lambda w: w.load_adapter(checkpoint_id, path))

    async def evict_adapter(self, checkpoint_id: str) -> None:
        await self.worker.submit(lambda w: w.evict_adapter(checkpoint_id))

    async def spill_adapter(self, checkpoint_id: str, lora: LoRAConfig, path: str) -> int:
        return await self.worker.submit(lambda w: w.spill_adapter(checkpoint_id, lora, path))

    async def publish_target(self, target: str, version: int, checkpoint_id: str) -> None:
        await self.worker.submit(lambda w: w.publish_checkpoint(target, version, checkpoint_id))

    async def lost(self) -> str:
        return await asyncio.shield(self.worker.exited)

    async def stats(self) -> EngineStats:
        """Read without queueing behind a cycle (counters may be one step apart)."""
        w = self.worker
        return EngineStats(
            w.name,
            self.replica,
            dict(w.sampler.stats),
            queued_jobs=w.queued_jobs,
            pending_samples=w.pending_samples,
            runs=w.trainer.num_runs,
            adapters=len(w.adapters),
            recent_cycles=list(self.recent_cycles),
            kernels=dict(w.kernels),
        )
