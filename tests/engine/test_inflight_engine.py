"""Inflight targets in the sampler: requests follow a target's new weights between steps, record the
version of every token, and the prefix cache never serves KV of one version to another."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from trine.engine.api import LoRAConfig, SampleRequest, SamplingOptions, WeightsIdentity
from trine.engine.config import SamplerConfig
from trine.engine.model.lora import Adapter
from trine.engine.model.tokenizer import Tokenizer
from trine.engine.model.weights import load_model
from trine.engine.sampler.sampler import Sampler

MB = 2**20
TARGET = WeightsIdentity("tiny", "tr-run")


@pytest.fixture(scope="module")
def model_tok(tiny_model_dir):
    return load_model(tiny_model_dir, "cpu"), Tokenizer(tiny_model_dir)


def adapter(model, seed: int) -> Adapter:
    """A LoRA adapter that changes the model's greedy output (B is not zero)."""
    a = Adapter(model, LoRAConfig(rank=4, seed=seed))
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in a.B.values():
            p.copy_(torch.randn(p.shape, generator=gen) * 0.5)
    return a.requires_grad_(False)


def inflight(rid: str, prompt: list[int], version: int, ad: Adapter, max_tokens: int = 24):
    """An inflight request as the worker hands it over (resolved to the target's current weights),
    with the adapter it runs."""
    return SampleRequest(
        rid,
        list(prompt),
        SamplingOptions(max_tokens, temperature=0.0, stop_at_eos=False),
        dataclasses.replace(TARGET, version=version),
        inflight=True,
    ), ad


def fixed(rid: str, prompt: list[int], weights: WeightsIdentity, ad: Adapter, max_tokens: int = 4):
    return SampleRequest(
        rid, list(prompt), SamplingOptions(max_tokens, temperature=0.0, stop_at_eos=False), weights
    ), ad


def run_until(s: Sampler, rid: str, steps: int | None = None):
    """Step the sampler `steps` times (None: until `rid` finishes); its result, if it finished."""
    n = 0
    while steps is None or n < steps:
        for res in s.step():
            if res.request_id == rid:
                return res
        n += 1
    return None


PROMPT = list(range(300, 340))  # 40 tokens: 2 full KV blocks of 16


def test_a_running_request_switches_weights_between_steps_and_records_each_tokens_version(model_tok):
    model, _ = model_tok
    a1, a2 = adapter(model, 1), adapter(model, 2)
    s = Sampler(*model_tok, SamplerConfig(kv_cache_bytes=16 * MB))
    s.add(*inflight("r", PROMPT, 1, a1))
    assert run_until(s, "r", steps=5) is None  # prefill + 4 decode steps: 5 tokens under v1
    s.publish("tr-run", 2, a2)
    res = run_until(s, "r")
    seq = res.sequences[0]
    assert seq.weights_versions == [1] * 5 + [2] * 19
    # the tokens before the swap are v1's greedy tokens, the ones after follow v2's weights
    only_v1 = (
        Sampler(*model_tok, SamplerConfig(kv_cache_bytes=16 * MB))
        .run([fixed("a", PROMPT, TARGET, a1, 24)])[0]
        .sequences[0]
    )
    assert seq.tokens[:5] == only_v1.tokens[:5]
    assert seq.tokens != only_v1.tokens
    # a fixed-weights request records no versions
    assert only_v1.weights_versions is None


def test_a_waiting_request_starts_on_the_new_version_and_gets_no_kv_of_the_old(model_tok):
    model, _ = model_tok
    a1, a2 = adapter(model, 1), adapter(model, 2)
    s = Sampler(*model_tok, SamplerConfig(kv_cache_bytes=16 * MB, max_running=1))
    s.add(*inflight("first", PROMPT, 1, a1, 4))
    run_until(s, "first", steps=1)  # prefilled: its prompt blocks are keyed under v1
    s.add(*inflight("waits", PROMPT, 1, a1, 4))  # queued behind it (max_running=1), same prompt, v1
    s.publish("tr-run", 2, a2)
    res = run_until(s, "waits")
    assert res.usage.cached_tokens == 0  # v1's cached prompt is not v2's
    assert res.sequences[0].weights_versions == [2] * 4
    v2 = Sampler(*model_tok, SamplerConfig(kv_cache_bytes=16 * MB)).run([fixed("b", PROMPT, TARGET, a2, 4)])[
        0
    ]
    assert res.sequences[0].tokens == v2.sequences[0].tokens  # wholly v2's greedy output
    # a later request of the old version still hits its own KV (computed wholly under v1)
    old = s.run([fixed("old", PROMPT, dataclasses.replace(TARGET, version=1), a1)])[0]
    assert old.usage.cached_tokens == 32


def test_kv_computed_after_a_swap_is_never_keyed_under_either_version(model_tok):
    model, _ = model_tok
    a1, a2 = adapter(model, 1), adapter(model, 2)
    s = Sampler(*model_tok, SamplerConfig(kv_cache_bytes=16 * MB))
    s.add(*inflight("r", PROMPT, 1, a1, 40))
    run_until(s, "r", steps=2)
    s.publish("tr-run", 2, a2)
    out = run_until(s, "r").sequences[0]
    assert out.weights_versions[:2] == [1, 1] and set(out.weights_versions[2:]) == {2}
    longer = PROMPT + out.tokens  # 80 tokens: blocks 2..4 were decoded across the swap
    for version, ad in ((1, a1), (2, a2)):
        res = s.run([fixed(f"v{version}", longer, dataclasses.replace(TARGET, version=version), ad)])[0]
        assert res.usage.cached_tokens == (32 if version == 1 else 0)  # only v1's own prompt blocks
