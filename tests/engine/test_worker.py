"""The engine worker thread: futures on the asyncio loop, sampling between training micro-batches."""

from __future__ import annotations

import asyncio
import logging

import pytest

from trine.engine.api import (
    Forward,
    LoRAConfig,
    Loss,
    SampleRequest,
    SamplingOptions,
    TrainDatum,
    WeightsIdentity,
)
from trine.engine.config import EngineConfig, SamplerConfig, TrainerConfig
from trine.engine.runtime.worker import EngineWorker


def test_sampling_is_served_between_training_micro_batches(tiny_model_dir):
    async def main():
        loop = asyncio.get_running_loop()
        w = EngineWorker(
            "tiny",
            tiny_model_dir,
            EngineConfig(
                device="cpu",
                num_threads=1,
                trainer=TrainerConfig(micro_batch_tokens=64),
                sampler=SamplerConfig(kv_cache_bytes=8 << 20),
            ),
        )
        await loop.run_in_executor(None, w.start, loop)
        ticks = []

        def train(w):
            w.trainer.create_run("r", LoRAConfig(rank=4))
            data = [TrainDatum(list(range(10 + i, 74 + i)), list(range(11 + i, 75 + i))) for i in range(10)]

            def tick():
                ticks.append(w.sampler.has_work())
                w.tick()

            w.trainer.forward_backward(
                [("r", Forward(data, Loss.parse("cross_entropy")))], between_microbatches=tick
            )
            return "train"

        finished = []
        job = w.submit(train)
        sample = w.sample(
            SampleRequest(
                "s", [5, 6, 7], SamplingOptions(max_tokens=3, temperature=0), WeightsIdentity("tiny")
            )
        )
        for fut in (job, sample):
            fut.add_done_callback(lambda f: finished.append("train" if f is job else "sample"))
        bad = w.sample(SampleRequest("bad", [], SamplingOptions(max_tokens=3), WeightsIdentity("tiny")))
        failing = w.submit(lambda w: w.trainer.optim_step("no-such-run", None))
        await asyncio.gather(job, sample)
        with pytest.raises(ValueError):
            await bad
        with pytest.raises(ValueError):
            await failing
        result = sample.result()
        await loop.run_in_executor(None, w.stop)
        return finished, ticks, result

    finished, ticks, result = asyncio.run(main())
    assert len(ticks) == 10  # one tick per micro-batch
    assert finished == ["sample", "train"]  # the sample did not wait for the whole training job
    assert result.usage.sample_tokens == len(result.sequences[0].tokens) > 0


def test_the_start_configures_the_process_and_names_the_active_kernels(tiny_model_dir, caplog):
    """The C kernels are built at the start (not in the first step) and one line names each op's path."""
    from trine.engine.model.kernels import fused, paged_attention
    from trine.engine.setup import configure

    caplog.set_level(logging.INFO, logger="trine.worker")

    async def main():
        loop = asyncio.get_running_loop()
        config = EngineConfig(device="cpu", num_threads=1, sampler=SamplerConfig(kv_cache_bytes=8 << 20))
        w = EngineWorker("tiny", tiny_model_dir, config)
        await loop.run_in_executor(None, w.start, loop)
        await loop.run_in_executor(None, w.stop)

    asyncio.run(main())
    lines = [r.getMessage() for r in caplog.records if r.name == "trine.worker"]
    kernels = [ln for ln in lines if "kernels " in ln]
    assert len(kernels) == 1, lines
    fused_ops = "C" if fused.built() else "torch"
    in_place = "C" if paged_attention.available() else "gather"
    assert f"kernels fused_ops={fused_ops} paged_attention={in_place} gemm=" in kernels[0]
    assert kernels[0].endswith("device=cpu dtype=float32 (auto, TRINE_AUTO_DTYPE=float32) threads=1")
    assert all(f"engine: {line}" in lines for line in configure())
