"""The engine pieces streaming needs: per-step deltas, top logprobs, and cancellation that frees KV."""

from __future__ import annotations

import asyncio
import dataclasses

import pytest

from trine.engine.api import SampleCancelled, SampleRequest, SampleResult, SamplingOptions, WeightsIdentity
from trine.engine.config import EngineConfig, SamplerConfig
from trine.engine.model.tokenizer import Tokenizer
from trine.engine.model.weights import load_model
from trine.engine.runtime.worker import EngineWorker
from trine.engine.sampler.sampler import Sampler

W = WeightsIdentity("tiny")
PROMPT = list(range(300, 340))  # 40 tokens: two full blocks and a partial one


@pytest.fixture(scope="module")
def model_tok(tiny_model_dir):
    return load_model(tiny_model_dir, "cpu"), Tokenizer(tiny_model_dir)


def request(rid: str, n: int = 3, max_tokens: int = 8, **opts) -> SampleRequest:
    opts = {"temperature": 1.0, "seed": 7, "stop_at_eos": False, **opts}
    return SampleRequest(rid, list(PROMPT), SamplingOptions(max_tokens=max_tokens, **opts), W, num_samples=n)


def test_deltas_concatenate_to_the_result_with_top_logprobs(model_tok):
    sampler = Sampler(*model_tok, SamplerConfig(kv_cache_bytes=16 << 20))
    req = dataclasses.replace(request("a", top_logprobs=3), stream=True)
    sampler.add(req)
    deltas, result, steps = [], None, 0
    while result is None:
        done = sampler.step()
        steps += 1
        step_deltas = sampler.take_deltas()
        assert sorted(d.sequence for d in step_deltas) == [0, 1, 2]  # one per sequence per step
        deltas += step_deltas
        result = done[0] if done else None
    assert steps == 8  # the prefill's first token, then 7 decode steps
    for i, seq in enumerate(result.sequences):
        parts = [d for d in deltas if d.sequence == i]
        assert [t for d in parts for t in d.tokens] == seq.tokens
        assert [x for d in parts for x in d.logprobs] == seq.logprobs
        assert [x for d in parts for x in d.top_logprobs] == seq.top_logprobs
        assert parts[-1].stop_reason == "length" and parts[-1].text == seq.text
        assert all(p.stop_reason is None and p.text is None for p in parts[:-1])
        for tok, lp, top in zip(seq.tokens, seq.logprobs, seq.top_logprobs):
            assert len(top) == 3 and top[0][1] >= top[1][1] >= top[2][1] and top[0][1] >= lp
            # kind 1: a token's logprob and its top-logprobs entry are read from the same tensor
            assert dict(top).get(tok, lp) == lp


def test_cancel_frees_sequences_and_blocks_at_once(model_tok):
    # "a" decodes a token every step from the first on: not held while "b" (sent with it) prefills
    sampler = Sampler(*model_tok, SamplerConfig(kv_cache_bytes=16 << 20, burst_stall_seconds=0))
    free = sampler.kv.num_free
    sampler.add(request("a", n=4, max_tokens=200))
    sampler.add(request("b", n=1, max_tokens=3))
    for _ in range(3):
        sampler.step()
    assert sampler.kv.num_used > 0
    partial = sampler.cancel("a")
    assert [s.stop_reason for s in partial.sequences] == ["cancelled"] * 4
    assert all(len(s.tokens) == 3 for s in partial.sequences)
    assert partial.usage.prompt_tokens == len(PROMPT) and partial.usage.sample_tokens == 12
    results = []
    while sampler.has_work():
        results += sampler.step()
    assert [r.request_id for r in results] == ["b"]  # the cancelled request never comes back
    assert sampler.cancel("a") is None and sampler.cancel("b") is None
    assert sampler.kv.num_used == 0 and sampler.stats["blocks_reserved"] == 0
    assert sampler.kv.num_free == free  # every block is free again (cached ones are evictable)
    sampler.add(request("w", n=2))  # cancelled before admission: holds nothing, reports no usage
    assert sampler.cancel("w").usage.prompt_tokens == 0 and not sampler.has_work()


def test_worker_stream_yields_deltas_then_result_and_closing_it_cancels(tiny_model_dir):
    async def main():
        worker = EngineWorker(
            "tiny",
            tiny_model_dir,
            EngineConfig(device="cpu", num_threads=1, sampler=SamplerConfig(kv_cache_bytes=16 << 20)),
        )
        loop = asyncio.get_running_loop()
        await loop.run_in_executor(None, worker.start, loop)
        try:
            items = [x async for x in worker.sample_stream(request("s", n=2, max_tokens=4))]
            res = items[-1]
            assert isinstance(res, SampleResult) and len(items) == 1 + 2 * 4
            assert [t for d in items[:-1] if d.sequence == 1 for t in d.tokens] == res.sequences[1].tokens
            # a consumer that stops early: the request is cancelled and its KV freed
            stream = worker.sample_stream(request("long", n=2, max_tokens=3000))
            await anext(stream)
            waiter = worker.sample(request("other", n=1, max_tokens=2))
            await stream.aclose()
            await waiter
            stats = await worker.submit(lambda w: w.sampler.stats)
            assert stats["running"] == 0 and stats["waiting"] == 0 and stats["blocks_used"] == 0
            assert stats["sample_tokens"] < 100  # stopped long before its 3000 tokens
            # cancel() by id: the waiter gets SampleCancelled, the canceller what was computed
            fut = worker.sample(request("c", n=1, max_tokens=3000))
            while (await worker.submit(lambda w: w.sampler.stats))["running"] == 0:
                await asyncio.sleep(0.01)
            partial = await worker.cancel("c")
            with pytest.raises(SampleCancelled):
                await fut
            assert partial.sequences[0].stop_reason == "cancelled"
            assert partial.usage.prompt_tokens == len(PROMPT) and partial.usage.sample_tokens >= 1
            assert await worker.cancel("c") is partial  # asked again: the same answer, once
            assert await worker.cancel("never-sent") is None
        finally:
            await loop.run_in_executor(None, worker.stop)

    asyncio.run(main())
