"""Chunked prefill: a long prompt is prefilled over several engine steps of at most
`max_batch_tokens` positions, interleaved with decode steps, so it never stalls other requests;
results equal the one-forward path. Also: tiny temperatures are greedy, stop lists are bounded."""

from __future__ import annotations

import dataclasses
import random

import pytest
from tolerance import assert_same_samples, fp64_model

from trine.engine.api import SampleRequest, SamplingOptions, WeightsIdentity
from trine.engine.config import SamplerConfig
from trine.engine.model.tokenizer import Tokenizer
from trine.engine.model.weights import load_model
from trine.engine.sampler.sampler import Sampler

W = WeightsIdentity("tiny")
_ids = iter(range(10**9))


@pytest.fixture(scope="module")
def model_tok(tiny_model_dir):
    return load_model(tiny_model_dir, "cpu"), Tokenizer(tiny_model_dir)


def prompt(n: int, seed: int = 0) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(100, 40000) for _ in range(n)]


def req(p, max_tokens=6, n=1, **kw) -> SampleRequest:
    extra = {k: kw.pop(k) for k in ("prompt_logprobs", "topk_prompt_logprobs", "generate") if k in kw}
    kw.setdefault("stop_at_eos", False)
    return SampleRequest(
        f"r{next(_ids)}", list(p), SamplingOptions(max_tokens=max_tokens, **kw), W, num_samples=n, **extra
    )


def test_chunked_prefill_equals_one_forward(model_tok, tiny_model_dir):
    """Kind 3, against fp64: one forward over each prompt (a budget of 4096) is the reference,
    48-token chunks the path; the same math, the chunks' attention and GEMMs in another order."""
    long, shared = prompt(300, 1), prompt(40, 2)

    def compute(model):
        mt = (model, model_tok[1])
        results = {}
        for budget in (4096, 48):
            s = Sampler(*mt, SamplerConfig(kv_cache_bytes=16 << 20, max_batch_tokens=budget))
            reqs = [
                req(long, prompt_logprobs=True, topk_prompt_logprobs=3, temperature=0.0),
                req(long, max_tokens=8, n=3, seed=5),
                req(shared + prompt(20, 3), generate=False),
                req(shared + prompt(5, 4), max_tokens=4, temperature=0.0),
            ]
            results[budget] = s.run(reqs)
            assert s.stats["prefilling"] == 0 and s.kv.num_used == 0
        groups = {4096: {}, 48: {}}
        for i, (whole, chunked) in enumerate(zip(results[4096], results[48])):
            assert [q.tokens for q in chunked.sequences] == [q.tokens for q in whole.sequences]
            for budget, res in ((4096, whole), (48, chunked)):
                if res.sequences:
                    groups[budget][f"samples{i}"] = [q.logprobs for q in res.sequences]
            if whole.prompt_logprobs is not None:
                assert chunked.prompt_logprobs[0] is None
                assert len(chunked.prompt_logprobs) == len(whole.prompt_logprobs)
                groups[4096][f"prompt{i}"] = whole.prompt_logprobs[1:]
                groups[48][f"prompt{i}"] = chunked.prompt_logprobs[1:]
            if whole.topk_prompt_logprobs is not None:
                assert [[t for t, _ in row] for row in chunked.topk_prompt_logprobs[1:]] == [
                    [t for t, _ in row] for row in whole.topk_prompt_logprobs[1:]
                ]
            assert chunked.usage == whole.usage
        # the second copy of the long prompt waited for the first one's blocks, then hit them
        assert results[48][1].usage.cached_tokens == results[4096][1].usage.cached_tokens > 0
        tokens = [q.tokens for r in results[4096] for q in r.sequences]
        return groups[4096], groups[48], tokens

    assert_same_samples(compute, model_tok[0], fp64_model(tiny_model_dir))


def test_a_long_prompt_logprobs_request_does_not_stall_a_short_sample(model_tok):
    # sent together by one tenant, yet the sample does not wait for the scoring prompt's chunks
    # (`burst_stall_seconds`): a prompt that only scores never joins the decode batch
    s = Sampler(
        *model_tok, SamplerConfig(kv_cache_bytes=32 << 20, max_batch_tokens=64, burst_stall_seconds=60.0)
    )
    long = req(prompt(1500, 7), generate=False)
    s.add(long)
    s.step()  # the long request is admitted and its first chunk computed
    short = req(prompt(10, 8), max_tokens=5, temperature=0.0)
    s.add(short)
    done_at = {}
    steps = 0
    while s.has_work():
        steps += 1
        before = s.stats["prefill_forwards"]
        for res in s.step():
            done_at[res.request_id] = steps
        assert s.stats["prefill_forwards"] - before <= 1
    # the short request is prefilled in the next step and decodes one token per step meanwhile
    assert done_at[short.request_id] <= 6
    assert done_at[long.request_id] >= 1500 // 64 - 1


def test_tiny_temperature_samples_greedily(model_tok):
    s = Sampler(*model_tok, SamplerConfig(kv_cache_bytes=16 << 20))
    p = prompt(12, 9)
    greedy, tiny = s.run(
        [req(p, max_tokens=8, temperature=0.0), req(p, max_tokens=8, temperature=1e-300, seed=3)]
    )
    assert tiny.sequences[0].tokens == greedy.sequences[0].tokens
    # kind 1: the model's own logprobs (temperature 1) of the same tokens, two identical rows of
    # each forward: the same ops on the same inputs
    assert tiny.sequences[0].logprobs == greedy.sequences[0].logprobs


def test_stop_lists_are_bounded(model_tok):
    s = Sampler(*model_tok, SamplerConfig(kv_cache_bytes=16 << 20))
    for opts, field in (
        (dict(stop_strings=tuple(f"s{i}" for i in range(300_000))), "stop strings"),
        (dict(stop_strings=("x" * 10_000,)), "characters"),
        (dict(stop_token_ids=tuple(range(5000))), "stop_token_ids"),
    ):
        with pytest.raises(ValueError, match=field):
            s.add(req(prompt(5), **opts))
    assert not s.has_work()


def test_while_others_decode_a_prefill_chunk_costs_about_one_decode_step(model_tok):
    s = Sampler(
        *model_tok, SamplerConfig(kv_cache_bytes=32 << 20, max_batch_tokens=4096)
    )  # the token bound alone: 1 chunk
    short = dataclasses.replace(req(prompt(10, 10), max_tokens=12, temperature=0.0), tenant="alice")
    s.add(short)
    s.step()  # the short request is decoding from now on
    long = dataclasses.replace(req(prompt(1500, 11), generate=False), tenant="bob")
    s.add(long)
    done_at, steps = {}, 0
    while s.has_work():
        steps += 1
        for res in s.step():
            done_at[res.request_id] = steps
    assert done_at[short.request_id] == 11  # one token per step, never held up
    assert done_at[long.request_id] > 2  # split into chunks while the short one decoded


def test_one_tenants_batch_sent_together_prefills_in_large_chunks_while_its_first_sequences_decode(
    model_tok,
):
    """vLLM's throughput on a batch: its later prompts do not trickle in `prefill_step_seconds`
    chunks, one decode step each, behind its own first sequences (nobody else waits on them)."""

    def prefill_forwards(burst_seconds: float) -> int:
        s = Sampler(
            *model_tok,
            SamplerConfig(kv_cache_bytes=32 << 20, max_batch_tokens=256, prefill_step_seconds=1e-9),
        )
        s.scheduler.burst_seconds = burst_seconds
        s.scheduler.min_prefill_tokens = 16
        s.run([req(prompt(100, i), max_tokens=80) for i in range(12)])  # decoding throughout
        return s.stats["prefill_forwards"]

    # 1200 prompt tokens: 256 a forward as one batch; 16 (the floor) a forward when held to time
    assert prefill_forwards(burst_seconds=60.0) <= 6 < 40 <= prefill_forwards(burst_seconds=0.0)


def test_a_batch_sent_together_decodes_once_its_prompts_are_prefilled(model_tok):
    """A batch's first sequences wait for its other prompts' chunks (up to `burst_stall_seconds`)
    instead of decoding a few rows between them: fewer decode forwards, the same tokens."""

    def run(stall: float, clock=None):
        s = Sampler(
            *model_tok,
            SamplerConfig(kv_cache_bytes=32 << 20, max_batch_tokens=256, burst_stall_seconds=stall),
        )
        s.scheduler.burst_seconds = 60.0
        if clock is not None:
            s.scheduler.clock = clock
        out = s.run([req(prompt(100, i), max_tokens=8, temperature=1.0, seed=i) for i in range(12)])
        return s.stats["decode_forwards"], s.stats["prefill_forwards"], [r.sequences[0].tokens for r in out]

    waits, chunks, tokens = run(stall=60.0)
    assert chunks >= 4  # 1200 prompt tokens, 256 a forward
    assert waits == 7  # the first token comes from the prefill; then all 12 decode together
    eager, _, eager_tokens = run(stall=0.0)
    assert eager >= waits + chunks - 2  # a decode step beside (nearly) every chunk
    assert eager_tokens == tokens  # seeded sampling: the schedule changes no token
    ticks = iter(range(10**6))  # a clock one second per reading: the wait is bounded
    bounded, _, _ = run(stall=1.5, clock=lambda: float(next(ticks)))
    assert waits < bounded < eager


def test_cancel_while_the_prompt_prefills_in_chunks_frees_everything(model_tok):
    """A client that goes away while its long prompt is still being prefilled (chunk by chunk)
    gets its blocks, partial-block copies and decode reservation back at once; the part already
    computed is reported as its usage (prompt = prefill + cached), and others go on."""
    s = Sampler(*model_tok, SamplerConfig(kv_cache_bytes=16 << 20, max_batch_tokens=48))
    free = s.kv.num_free
    long = req(prompt(300, 7), max_tokens=8, n=3, seed=1)
    other = req(prompt(20, 8), max_tokens=4, temperature=0.0)
    s.add(long)
    s.step()  # admitted: its blocks are allocated, a first chunk computed
    assert s.stats["prefilling"] == 1 and s.kv.num_free < free
    partial = s.cancel(long.request_id)
    assert partial is not None and partial.sequences == []
    u = partial.usage
    assert 0 < u.prompt_tokens < 300 and u.prompt_tokens == u.prefill_tokens + u.cached_tokens
    assert s.stats["prefilling"] == 0 and s.stats["blocks_reserved"] == 0
    assert s.kv.num_used == 0  # what it computed stays only as free cached blocks
    (res,) = s.run([other])
    assert res.request_id == other.request_id and len(res.sequences[0].tokens) == 4
    assert s.kv.num_used == 0 and s.stats["blocks_reserved"] == 0


@pytest.fixture
def costly_chunks(model_tok, monkeypatch):
    """A sampler on a fake clock where every prefill chunk takes 3 s and every decode step 1 s."""
    import trine.engine.sampler.sampler as sampler_module

    clock = [0.0]
    monkeypatch.setattr(sampler_module.time, "perf_counter", lambda: clock[0])

    def build(**kw) -> Sampler:
        s = Sampler(*model_tok, SamplerConfig(kv_cache_bytes=32 << 20, prefill_share=0.5, **kw))
        real_prefill, real_decode = s._prefill, s._decode

        def prefill(rows):
            clock[0] += 3.0
            return real_prefill(rows)

        def decode(seqs):
            clock[0] += 1.0
            return real_decode(seqs)

        monkeypatch.setattr(s, "_prefill", prefill)
        monkeypatch.setattr(s, "_decode", decode)
        s.clock = clock
        return s

    return build


def test_while_others_decode_prefill_gets_its_share_of_time_however_costly_a_chunk_is(costly_chunks):
    """Deep into a long prompt even one block can cost several decode steps: a chunk's time is a
    debt that the decode steps after it pay at `prefill_share` x their own time, so a decoding
    sequence spends at most that share (plus one chunk) waiting on prefill."""
    s = costly_chunks(max_batch_tokens=16)
    clock = s.clock
    short = req(prompt(10, 12), max_tokens=30, temperature=0.0)
    s.add(short)
    s.step()  # prefilled alone; decodes from now on
    long = req(prompt(600, 13), generate=False)
    s.add(long)
    start = clock[0]
    steps, prefills = 0, s.stats["prefill_forwards"]
    while True:
        steps += 1
        if any(res.request_id == short.request_id for res in s.step()):
            break
    assert steps == 29  # one token per step
    prefill_seconds = 3.0 * (s.stats["prefill_forwards"] - prefills)
    decode_seconds = clock[0] - start - prefill_seconds
    assert prefill_seconds <= 0.5 * decode_seconds + 3.0
    assert s.stats["prefill_forwards"] - prefills >= 4  # the long prompt still moved on
    done = []
    while s.has_work():  # alone again, the long prompt runs chunk after chunk
        done += [res.request_id for res in s.step()]
    assert done == [long.request_id]


def test_an_older_prompt_is_held_back_for_a_newer_request_that_decodes(costly_chunks):
    """The long request came first; the short one after it must not wait on its chunks."""
    s = costly_chunks(max_batch_tokens=2048)
    long = req(prompt(600, 14), generate=False)
    s.add(long)
    s.step()  # a first chunk, nobody decoding
    short = req(prompt(10, 15), max_tokens=30, temperature=0.0)
    s.add(short)
    prefills = s.stats["prefill_forwards"]
    while not any(res.request_id == short.request_id for res in s.step()):
        pass
    assert s.stats["prefill_forwards"] - prefills <= 30 // 6 + 2  # about one chunk per 6 decode steps


def test_requests_sent_together_are_prefilled_ahead_of_decoding(costly_chunks):
    """A GRPO step: prompts sent together, each newer than the samples already decoding and short,
    are prefilled every step rather than at the decoders' pace, so they join the decode batch soon."""
    s = costly_chunks(max_batch_tokens=2048)
    reqs = [req(prompt(100, 20 + i), max_tokens=40, temperature=0.0) for i in range(3)]
    for r in reqs:
        s.add(r)
    steps, most_running = 0, 0
    while s.stats["prefilling"] or s.stats["waiting"]:
        s.step()
        steps += 1
        most_running = max(most_running, s.stats["running"])
    assert most_running == 3  # all three decode together
    assert steps <= 3 * 7  # every step prefills (100 tokens at one 16-token block a step, each)
    assert s.stats["prefill_forwards"] == steps
