"""The engine interface through its in-process backend: plain serialisable calls only."""

from __future__ import annotations

import asyncio
import dataclasses
import pickle

import pytest

from trine.engine.api import (
    FORWARD_BACKWARD,
    INIT_RUN,
    OPTIMIZE_STEP,
    SAVE_WEIGHTS,
    AdamConfig,
    CycleEvent,
    Forward,
    InitRun,
    LoRAConfig,
    Loss,
    OptimStep,
    RunShare,
    SampleCancelled,
    SampleDelta,
    SampleRequest,
    SampleResult,
    SamplingOptions,
    Save,
    TrainDatum,
    TrainingCycle,
    WeightsIdentity,
)
from trine.engine.config import EngineConfig, SamplerConfig, TrainerConfig
from trine.engine.runtime.local import LocalEngine


def _engine(model_dir) -> LocalEngine:
    return LocalEngine(
        "tiny",
        model_dir,
        EngineConfig(
            device="cpu",
            num_threads=1,
            sampler=SamplerConfig(kv_cache_bytes=8 << 20),
            trainer=TrainerConfig(micro_batch_tokens=256),
        ),
    )


def _cycle(n: int, run_id: str, *events: tuple[str, str, object]) -> TrainingCycle:
    share = RunShare()
    for ev_id, type_, op in events:
        phase = {
            INIT_RUN: share.pre,
            FORWARD_BACKWARD: share.forward,
            OPTIMIZE_STEP: share.optim,
            SAVE_WEIGHTS: share.post,
        }[type_]
        phase.append(CycleEvent(ev_id, type_, op))
    return TrainingCycle(n, {run_id: share})


def test_train_publish_sample_spill_and_reload_by_checkpoint_id(tiny_model_dir, tmp_path):
    async def main():
        eng = _engine(tiny_model_dir)
        info = await eng.start()
        try:
            tokens = list(range(100, 132))
            data = [TrainDatum(tokens, tokens[1:] + [-100], [1.0] * 32)]
            cycle = _cycle(
                1,
                "run",
                ("e1", INIT_RUN, InitRun(LoRAConfig(rank=4, seed=3))),
                ("e2", FORWARD_BACKWARD, Forward(data, Loss.parse("cross_entropy"))),
                ("e3", OPTIMIZE_STEP, OptimStep(AdamConfig(learning_rate=1e-2))),
                ("e4", SAVE_WEIGHTS, Save("weights", checkpoint_id="ck1")),
            )
            cycle = pickle.loads(pickle.dumps(cycle))  # what crosses is plain data
            res = await eng.run_cycle(cycle)
            res = pickle.loads(pickle.dumps(res))
            assert [res.outcomes[e].error for e in ("e1", "e2", "e3", "e4")] == [None] * 4
            fb = res.outcomes["e2"]
            assert len(fb.logprobs) == 1 and len(fb.logprobs[0]) == 32 and fb.train_tokens == 32
            assert all(isinstance(x, float) for x in fb.logprobs[0] + fb.losses[0])

            opts = SamplingOptions(max_tokens=4, temperature=0.0)
            tuned = SampleRequest("a", [5, 6, 7, 8], opts, WeightsIdentity("tiny", "ck1"))
            base = SampleRequest("b", [5, 6, 7, 8], opts, WeightsIdentity("tiny"))
            out_tuned, out_base = await asyncio.gather(eng.sample(tuned), eng.sample(base))
            assert out_tuned.usage.prompt_tokens == 4 and out_tuned.sequences[0].tokens
            stats = await eng.stats()
            assert stats.adapters == 1 and stats.runs == 1
            assert [(c.number, c.runs, c.events) for c in stats.recent_cycles] == [(1, ["run"], 4)]
            assert stats.sampler["blocks_total"] > 0

            # spill to disk, evict, and load it back under another id: same greedy tokens
            path = str(tmp_path / "snap")
            assert await eng.spill_adapter("ck1", LoRAConfig(rank=4, seed=3), path) > 0
            await eng.evict_adapter("ck1")
            with pytest.raises(ValueError, match="not loaded"):
                await eng.sample(SampleRequest("c", [5, 6, 7, 8], opts, WeightsIdentity("tiny", "ck1")))
            assert await eng.load_adapter("ck2", path) > 0
            again = await eng.sample(SampleRequest("d", [5, 6, 7, 8], opts, WeightsIdentity("tiny", "ck2")))
            assert again.sequences[0].tokens == out_tuned.sequences[0].tokens

            await eng.drop_run("run")
            assert (await eng.stats()).runs == 0
            return info
        finally:
            await eng.stop()

    info = asyncio.run(main())
    assert info.vocab_size == 49152 and info.max_seq_len == 4096 and info.architecture == "llama"


def test_stream_cancel_and_no_live_modules_across(tiny_model_dir):
    async def main():
        eng = _engine(tiny_model_dir)
        await eng.start()
        try:
            opts = SamplingOptions(max_tokens=5, temperature=1.0, seed=7)
            items = [
                x
                async for x in eng.sample_stream(
                    SampleRequest("s", [9, 10, 11], opts, WeightsIdentity("tiny"), num_samples=2)
                )
            ]
            deltas, final = items[:-1], items[-1]
            assert isinstance(final, SampleResult) and all(isinstance(d, SampleDelta) for d in deltas)
            for i, seq in enumerate(final.sequences):
                assert [t for d in deltas if d.sequence == i for t in d.tokens] == seq.tokens

            long = asyncio.ensure_future(
                eng.sample(
                    SampleRequest(
                        "long",
                        [9, 10, 11],
                        SamplingOptions(max_tokens=1000, stop_at_eos=False),
                        WeightsIdentity("tiny"),
                    )
                )
            )
            await asyncio.sleep(0.2)
            await eng.cancel("long")
            with pytest.raises(SampleCancelled):
                await asyncio.wait_for(long, 10)

            # a request names its weights; the adapter they resolve to stays inside the engine
            assert "adapter" not in {f.name for f in dataclasses.fields(SampleRequest)}
        finally:
            await eng.stop()

    asyncio.run(main())


def test_lora_config_named_by_reads_the_planes_and_the_stores_names():
    """One conversion: a wire body names `rank`, a run or checkpoint record `lora_rank`; a missing
    seed is the engine's default (None)."""
    from types import SimpleNamespace

    from trine.engine.api import LoRAConfig

    flags = dict(train_mlp=False, train_attn=True, train_unembed=False)
    body = SimpleNamespace(rank=8, seed=3, **flags)
    record = SimpleNamespace(lora_rank=4, **flags)
    assert LoRAConfig.named_by(body) == LoRAConfig(rank=8, seed=3, **flags)
    assert LoRAConfig.named_by(record) == LoRAConfig(rank=4, seed=None, **flags)
