"""The engine's configuration: frozen, checked once with the field named, pickled as built (Ray)."""

from __future__ import annotations

import dataclasses
import pickle

import pytest

from trine.engine.config import EngineConfig, SamplerConfig, TrainerConfig


def test_a_config_pickles_to_an_equal_one():
    config = EngineConfig(
        device="cpu",
        num_threads=2,
        dtype="bfloat16",
        batch_invariant=True,
        sampler=SamplerConfig(kv_cache_bytes=8 << 20, max_running=3, fair=False),
        trainer=TrainerConfig(micro_batch_tokens=256, prefix_sharing=False),
    )
    again = pickle.loads(pickle.dumps(config))
    assert again == config and again is not config
    assert pickle.loads(pickle.dumps(EngineConfig())) == EngineConfig()


def test_a_config_is_frozen():
    with pytest.raises(dataclasses.FrozenInstanceError):
        EngineConfig().num_threads = 2
    with pytest.raises(dataclasses.FrozenInstanceError):
        EngineConfig().sampler.max_running = 2


@pytest.mark.parametrize(
    "build, field",
    [
        (lambda: EngineConfig(dtype="float16"), "dtype"),
        (lambda: EngineConfig(num_threads=0), "num_threads"),
        (lambda: EngineConfig(device=""), "device"),
        (lambda: EngineConfig(sampler={"max_running": 2}), "sampler"),
        (lambda: SamplerConfig(kv_cache_bytes=0), "kv_cache_bytes"),
        (lambda: SamplerConfig(block_size=0), "block_size"),
        (lambda: SamplerConfig(max_running=1.5), "max_running"),
        (lambda: SamplerConfig(prefill_share=0), "prefill_share"),
        (lambda: SamplerConfig(tenant_share=1.5), "tenant_share"),
        (lambda: SamplerConfig(prefill_step_seconds=0), "prefill_step_seconds"),
        (lambda: SamplerConfig(burst_stall_seconds=-1), "burst_stall_seconds"),
        (lambda: TrainerConfig(micro_batch_tokens=0), "micro_batch_tokens"),
        (lambda: TrainerConfig(logits_chunk_tokens=0), "logits_chunk_tokens"),
    ],
)
def test_a_bad_value_is_refused_naming_its_field(build, field):
    with pytest.raises(ValueError, match=f"^{field}: "):
        build()


def test_the_defaults_are_what_the_engine_ran_with():
    s, t = SamplerConfig(), TrainerConfig()
    assert (s.kv_cache_bytes, s.block_size, s.max_batch_tokens, s.max_running) == (None, 16, 2048, 64)
    assert (s.prefill_share, s.prefill_step_seconds, s.idle_prefill_seconds) == (0.5, 0.25, 1.0)
    assert (s.min_prefill_tokens, s.burst_seconds, s.burst_stall_seconds, s.tenant_share) == (
        128,
        0.5,
        5.0,
        0.5,
    )
    assert s.enable_prefix_cache and s.fair
    assert (t.micro_batch_tokens, t.logits_chunk_tokens, t.prefix_sharing, t.min_shared_tokens) == (
        4096,
        1024,
        True,
        16,
    )
    e = EngineConfig()
    assert (e.device, e.num_threads, e.dtype, e.batch_invariant) == (None, None, "auto", False)
