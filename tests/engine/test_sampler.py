"""Sampler on tiny random models: cache equivalence, metering, stops, seeds, adapters, batching."""

from __future__ import annotations

import random

import pytest
import torch
from tolerance import assert_same_samples, fp64_adapter, fp64_model

from trine.engine.api import LoRAConfig, SampleRequest, SamplingOptions, WeightsIdentity
from trine.engine.config import SamplerConfig
from trine.engine.model.lora import Adapter
from trine.engine.model.tokenizer import Tokenizer
from trine.engine.model.weights import load_model
from trine.engine.sampler.sampler import Sampler

W = WeightsIdentity("tiny")
MB = 2**20
BLOCK = 2 * 4 * 16 * 2 * 24 * 4  # bytes of one KV block of the tiny models (fp32)


@pytest.fixture(scope="module")
def model_tok(tiny_model_dir):
    return load_model(tiny_model_dir, "cpu"), Tokenizer(tiny_model_dir)


@pytest.fixture(scope="module")
def twins(model_tok, tiny_model_dir):
    """The fp32 model and its fp64 twin, each with the tokenizer: the sampler's logprobs are
    compared as kind 3 (tests/tolerance.py), each path run on both."""
    return model_tok, (fp64_model(tiny_model_dir), model_tok[1])


def same_samples(compute, twins) -> None:
    """Kind 3, against fp64: `compute(model_tok)` returns (reference, path, tokens), the first two
    dicts of logprob groups. The sampler's paths are the same math in another order (cached or
    not, chunked, batched), so in fp64 they agree to FP64_SAME_MATH; in fp32 the path is within
    MARGIN x the reference's own fp32 rounding. Not a fixed 1e-4: that held on one CPU's kernels."""
    (m32, tok), (m64, _) = twins
    assert_same_samples(lambda m: compute((m, tok)), m32, m64)


def make(model_tok, **kw) -> Sampler:
    kw.setdefault("kv_cache_bytes", 16 * MB)
    return Sampler(*model_tok, SamplerConfig(**kw))


def prompt(n: int, seed: int = 0) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(100, 40000) for _ in range(n)]


_ids = iter(range(10**9))


def req(p, max_tokens=6, n=1, weights=W, adapter=None, **opts):
    """A request, paired with the adapter it runs when `weights` names one (Sampler.run/add)."""
    extra = {k: opts.pop(k) for k in ("prompt_logprobs", "topk_prompt_logprobs", "generate") if k in opts}
    opts.setdefault("stop_at_eos", False)
    r = SampleRequest(
        f"r{next(_ids)}",
        list(p),
        SamplingOptions(max_tokens=max_tokens, **opts),
        weights,
        num_samples=n,
        **extra,
    )
    return r if adapter is None else (r, adapter)


def full_logprobs(model, tokens, adapter=None):
    """log_softmax of a plain full forward (the training path, no KV pool): [len, vocab]."""
    from trine.engine.model.lora import AdapterBatch

    with torch.inference_mode():
        return torch.log_softmax(model(torch.tensor([tokens]), adapters=AdapterBatch.single(adapter))[0], -1)


def full_forward_logprobs(model, p, seq, adapter=None) -> list[float]:
    """The logprobs a plain full forward of prompt + completion gives the sequence's tokens: the
    reference the sampler's reported logprobs are compared with (kind 3)."""
    lp = full_logprobs(model, p + seq.tokens, adapter)
    return lp[len(p) - 1 : -1].gather(1, torch.tensor(seq.tokens)[:, None])[:, 0].tolist()


def against_full_forward(model, p, seqs, adapter=None) -> tuple[dict, dict]:
    """(reference, path) groups: each sequence's logprobs from a full forward and from the sampler."""
    return {"full": [full_forward_logprobs(model, p, x, adapter) for x in seqs]}, {
        "full": [x.logprobs for x in seqs]
    }


# ----------------------------------------------------------------------------- cache equivalence
@pytest.mark.parametrize("family", ["llama", "qwen2", "qwen3"])
def test_cached_and_uncached_paths_agree(tiny_model_dirs, family):
    """DESIGN.md's contract (cached and uncached logits within 1e-4) is a product bound; the test
    checks the tighter thing, kind 3: the uncached path is the reference for the cached ones, a
    full forward for the sampler's logprobs."""
    d = tiny_model_dirs[family]
    tok = Tokenizer(d)
    p = prompt(53)

    def compute(mt):
        off = make(mt, enable_prefix_cache=False)
        on = make(mt)
        ref = off.run([req(p, 8, temperature=0)])[0].sequences[0]
        first = on.run([req(p, 8, temperature=0)])[0]
        second = on.run([req(p, 8, temperature=0)])[0]
        assert first.usage.cached_tokens == 0 and second.usage.cached_tokens == 52  # all but the last
        for res in (first, second):
            assert res.sequences[0].tokens == ref.tokens
        # every decoded token's logprob is a plain full forward's log-softmax
        full_ref, full_path = against_full_forward(mt[0], p, [second.sequences[0]])
        reference = {"cold": ref.logprobs, "hit": ref.logprobs, **full_ref}
        path = {"cold": first.sequences[0].logprobs, "hit": second.sequences[0].logprobs, **full_path}
        return reference, path, ref.tokens

    same_samples(compute, ((load_model(d, "cpu"), tok), (fp64_model(d), tok)))


def test_full_hit_still_computes_last_token_and_seeded_samples_match(twins):
    p = prompt(48)  # exactly 3 blocks: the last one serves its first 15 tokens, its last is needed

    def compute(mt):
        s = make(mt)
        a = s.run([req(p, 10, n=3, seed=7)])[0]
        b = s.run([req(p, 10, n=3, seed=7)])[0]
        assert b.usage.cached_tokens == 47 and b.usage.prefill_tokens == 1
        assert [x.tokens for x in a.sequences] == [x.tokens for x in b.sequences]
        uncached = make(mt, enable_prefix_cache=False).run([req(p, 10, n=3, seed=7)])[0]
        assert [x.tokens for x in uncached.sequences] == [x.tokens for x in a.sequences]
        return (*against_full_forward(mt[0], p, b.sequences), [x.tokens for x in b.sequences])

    same_samples(compute, twins)


def test_group_prefills_its_prompt_once(model_tok, twins):
    s = make(model_tok)
    p = prompt(70)
    res = s.run([req(p, 5, n=8, seed=1)])[0]
    u = res.usage
    assert (u.prompt_tokens, u.prefill_tokens, u.cached_tokens, u.sample_tokens) == (70, 70, 0, 40)
    assert s.stats["prefill_tokens"] == 70 and s.stats["sample_tokens"] == 40
    assert len(res.sequences) == 8 and len({tuple(x.tokens) for x in res.sequences}) > 1
    assert s.stats["blocks_used"] == 0  # every block released

    def compute(mt):  # forks sharing blocks and copying the partial one compute true logprobs
        seqs = res.sequences if mt is model_tok else make(mt).run([req(p, 5, n=8, seed=1)])[0].sequences
        return (*against_full_forward(mt[0], p, seqs), [x.tokens for x in seqs])

    same_samples(compute, twins)


def test_generated_blocks_are_cached_for_the_next_turn(model_tok):
    s = make(model_tok)
    p = prompt(20)
    first = s.run([req(p, 30, temperature=0)])[0]
    turn2 = p + first.sequences[0].tokens + prompt(10, seed=3)
    res = s.run([req(turn2, 4, temperature=0)])[0]
    # prompt + completion = 50 tokens, 49 of them had KV computed: 3 full blocks and the first
    # token of the completion's partial last block (its tail) are cached
    assert res.usage.cached_tokens == 49
    assert res.usage.prompt_tokens == res.usage.prefill_tokens + res.usage.cached_tokens


def test_partial_hits_compute_what_a_cold_prefill_does(twins):
    """A reply's partial last block (its tail) serves the next turn the tokens they share; the
    samples, forks included, are those of a sampler without a prefix cache (kind 3: the cold
    sampler and a full forward are the references)."""

    def compute(mt):
        s, cold = make(mt), make(mt, enable_prefix_cache=False)
        p = prompt(20)
        reply = s.run([req(p, 12, temperature=0)])[0].sequences[0].tokens  # KV of 31 tokens: 1 block + 15
        turns = [
            (p + reply + prompt(9, seed=4), 31),  # the next turn: all 15 tokens of the tail
            (p + reply[:5] + prompt(3, seed=5), 25),  # a turn that leaves the reply after 5 tokens: 9
        ]
        reference, path, tokens = {}, {}, [reply]
        for i, (turn, cached) in enumerate(turns):
            hot = s.run([req(turn, 6, n=3, seed=2, temperature=1.0)])[0]
            ref = cold.run([req(turn, 6, n=3, seed=2, temperature=1.0)])[0]
            assert hot.usage.cached_tokens == cached and hot.usage.prefill_tokens == len(turn) - cached
            assert [x.tokens for x in hot.sequences] == [x.tokens for x in ref.sequences]
            reference[f"cold{i}"] = [x.logprobs for x in ref.sequences]
            path[f"cold{i}"] = [x.logprobs for x in hot.sequences]
            full_ref, full_path = against_full_forward(mt[0], turn, hot.sequences)
            reference[f"full{i}"], path[f"full{i}"] = full_ref["full"], full_path["full"]
            tokens += [x.tokens for x in hot.sequences]
        assert s.stats["cache_hit_partial_tokens"] == 15 + 9
        s.kv.check()
        assert s.stats["blocks_used"] == 0
        return reference, path, tokens

    same_samples(compute, twins)


# ----------------------------------------------------------------------------- weights identity
def test_new_weights_version_gets_no_cached_tokens(model_tok):
    s = make(model_tok)
    p = prompt(40)
    s.run([req(p)])
    assert s.run([req(p)])[0].usage.cached_tokens == 39
    assert s.run([req(p, weights=WeightsIdentity("tiny", version=1))])[0].usage.cached_tokens == 0
    ad = Adapter(model_tok[0], LoRAConfig(rank=4))
    hit = s.run([req(p, weights=WeightsIdentity("tiny", "run", 3), adapter=ad)])[0]
    assert hit.usage.cached_tokens == 0


# ----------------------------------------------------------------------------- prompt logprobs
def test_prompt_logprobs_and_compute_logprobs_never_read_the_cache(twins):
    p = prompt(45)

    def compute(mt):  # kind 3: a full forward's log-softmax is the reference
        s = make(mt)
        s.run([req(p)])  # the prompt is now cached
        lp = full_logprobs(mt[0], p)
        want = lp[:-1].gather(1, torch.tensor(p[1:])[:, None])[:, 0].tolist()
        with_pl = s.run([req(p, 3, prompt_logprobs=True)])[0]
        scores = s.run([req(p, generate=False, topk_prompt_logprobs=3)])[0]
        for res in (with_pl, scores):
            assert res.usage.cached_tokens == 0 and res.usage.prefill_tokens == 45
            assert len(res.prompt_logprobs) == 45 and res.prompt_logprobs[0] is None
        assert len(with_pl.sequences) == 1 and scores.sequences == []
        top = scores.topk_prompt_logprobs
        assert top[0] is None and len(top) == 45
        v, i = lp[9].topk(3)
        assert [t for t, _ in top[10]] == i.tolist()
        assert s.stats["cached_tokens"] == 0
        reference = {"with": want, "alone": want, "top": v.tolist()}
        path = {"with": with_pl.prompt_logprobs[1:], "alone": scores.prompt_logprobs[1:]}
        path["top"] = [x for _, x in top[10]]
        return reference, path, i.tolist()

    same_samples(compute, twins)


def test_full_forward_requests_write_the_cache(model_tok):
    s = make(model_tok)
    p = prompt(40)
    s.run([req(p, generate=False)])
    assert s.run([req(p)])[0].usage.cached_tokens == 39  # 2 full blocks and 7 tokens of its tail


# ----------------------------------------------------------------------------- stops and lengths
def test_max_tokens_and_stop_token(model_tok):
    s = make(model_tok)
    p = prompt(12)
    res = s.run([req(p, 7, n=2, seed=3)])[0]
    assert all(
        len(x.tokens) == 7 and len(x.logprobs) == 7 and x.stop_reason == "length" for x in res.sequences
    )
    stop_tok = res.sequences[0].tokens[3]
    first = res.sequences[0].tokens.index(stop_tok)
    stopped = s.run([req(p, 7, n=2, seed=3, stop_token_ids=(stop_tok,))])[0].sequences[0]
    assert stopped.tokens == res.sequences[0].tokens[: first + 1] and stopped.stop_reason == "stop"
    tok = model_tok[1]
    assert stopped.text == tok.decode(stopped.tokens[:-1])  # the stop token is not in the text


def test_eos_stops_unless_disabled(model_tok):
    s = make(model_tok)
    p = prompt(12)
    res = s.run([req(p, 7, seed=3)])[0].sequences[0]
    s.eos_ids = frozenset({res.tokens[2]})  # pretend this model's EOS is the third token
    eos = s.run([req(p, 7, seed=3, stop_at_eos=True)])[0].sequences[0]
    assert eos.tokens == res.tokens[: res.tokens.index(res.tokens[2]) + 1] and eos.stop_reason == "stop"
    assert s.run([req(p, 7, seed=3, stop_at_eos=False)])[0].sequences[0].tokens == res.tokens


def test_stop_string_spanning_token_boundaries(model_tok):
    tok = model_tok[1]
    s = make(model_tok)
    p = prompt(12)
    base = s.run([req(p, 40, seed=11)])[0].sequences[0]
    texts = [tok.decode(base.tokens[:k]) for k in range(len(base.tokens) + 1)]
    # a stop string made of the end of token k-1 and the start of token k, late in the text
    for k in range(len(base.tokens) - 1, 0, -1):
        a, b = texts[k], texts[k + 1]
        if len(a) >= 2 and b.startswith(a) and len(b) >= len(a) + 2 and "\ufffd" not in b:
            stop = b[len(a) - 2 : len(a) + 2]
            if stop not in texts[k][:-1] and b.find(stop) == len(a) - 2:
                break
    else:
        pytest.fail("no token boundary to test")
    out = s.run([req(p, 40, seed=11, stop_strings=(stop, "never appears \u2603"))])[0].sequences[0]
    assert out.stop_reason == "stop"
    assert k > 20  # later than the window of tokens the sampler decodes at each step
    assert out.tokens == base.tokens[: k + 1]  # up to and including the token completing the stop
    assert out.text == b[: len(a) - 2]
    assert len(out.logprobs) == len(out.tokens)


# ----------------------------------------------------------------------------- seeds
def test_seeds(model_tok):
    s = make(model_tok)
    p = prompt(30)
    a = s.run([req(p, 8, n=4, seed=5)])[0]
    b = s.run([req(p, 8, n=4, seed=5)])[0]  # cached prefix this time
    c = s.run([req(p, 8, n=4, seed=6)])[0]
    toks = lambda r: [x.tokens for x in r.sequences]  # noqa: E731
    assert b.usage.cached_tokens > 0 and toks(a) == toks(b)
    assert toks(a) != toks(c)
    assert len(set(map(tuple, toks(a)))) == 4  # each sample has its own stream
    # the batch around a request does not change its samples
    crowd = s.run([req(prompt(17, 1), 8, n=3, seed=1), req(p, 8, n=4, seed=5), req(prompt(9, 2), 5)])
    assert toks(crowd[1]) == toks(a)
    # no seed: random
    assert toks(s.run([req(p, 8, n=2)])[0]) != toks(s.run([req(p, 8, n=2)])[0])


def test_top_k_top_p_and_temperature(model_tok, twins):
    s = make(model_tok)
    p = prompt(20)
    greedy = s.run([req(p, 6, temperature=0)])[0].sequences[0].tokens
    assert s.run([req(p, 6, top_k=1, seed=1)])[0].sequences[0].tokens == greedy
    assert s.run([req(p, 6, top_p=1e-6, seed=2)])[0].sequences[0].tokens == greedy

    def compute(mt):  # logprobs are the model's own (temperature 1), not the sampling distribution's
        hot = make(mt).run([req(p, 6, temperature=0.5, top_k=5, seed=3)])[0].sequences[0]
        top5 = full_logprobs(mt[0], p + hot.tokens)[len(p) - 1 : -1].topk(5).indices
        assert all(t in row.tolist() for t, row in zip(hot.tokens, top5))
        return (*against_full_forward(mt[0], p, [hot]), hot.tokens)

    same_samples(compute, twins)


# ----------------------------------------------------------------------------- adapters
def test_mixed_adapters_and_base_in_one_batch(model_tok, twins):
    base = []
    for seed in (1, 2):
        ad = Adapter(model_tok[0], LoRAConfig(rank=4, seed=seed))
        with torch.no_grad():
            for b in ad.B.values():
                b.normal_(0, 0.05, generator=torch.Generator().manual_seed(seed))
        base.append(ad)
    ids = [WeightsIdentity("tiny", "a", 0), WeightsIdentity("tiny", "b", 0), W]
    p = prompt(25)

    def compute(mt):  # kind 3: each request alone, and a full forward, are the references
        model = mt[0]
        adapters = base if model is model_tok[0] else [fp64_adapter(a, model) for a in base]
        reqs = lambda: [
            req(p, 6, n=2, seed=4, weights=w, adapter=a)  # noqa: E731
            for w, a in zip(ids, adapters + [None])
        ]
        together = make(mt).run(reqs())
        alone = [make(mt).run([r])[0] for r in reqs()]
        reference, path, tokens = {}, {}, []
        for i, (t, a, ad) in enumerate(zip(together, alone, adapters + [None])):
            assert [x.tokens for x in t.sequences] == [x.tokens for x in a.sequences]
            reference[f"alone{i}"] = [y.logprobs for y in a.sequences]
            path[f"alone{i}"] = [x.logprobs for x in t.sequences]
            full_ref, full_path = against_full_forward(model, p, t.sequences[:1], ad)
            reference[f"full{i}"], path[f"full{i}"] = full_ref["full"], full_path["full"]
            tokens += [x.tokens for x in t.sequences]
        assert [x.tokens for x in together[0].sequences] != [x.tokens for x in together[2].sequences]
        return reference, path, tokens

    same_samples(compute, twins)


# ----------------------------------------------------------------------------- batching
def test_many_concurrent_requests_under_memory_pressure(model_tok):
    rng = random.Random(0)
    shared = prompt(40, seed=9)
    reqs = []
    for i in range(14):
        p = (shared if i % 3 == 0 else []) + prompt(rng.randrange(3, 60), seed=100 + i)
        reqs.append(req(p, rng.randrange(1, 12), n=rng.randrange(1, 4), temperature=0))
    # a small pool and few running slots: requests queue, blocks are evicted and reused
    s = make(model_tok, kv_cache_bytes=24 * BLOCK, max_running=6, max_batch_tokens=128)
    together = s.run(reqs)
    alone = make(model_tok)
    for r, t in zip(reqs, together):
        a = alone.run([req(r.prompt, r.options.max_tokens, n=r.num_samples, temperature=0)])[0]
        assert [x.tokens for x in t.sequences] == [x.tokens for x in a.sequences]
        assert len(t.sequences) == r.num_samples
        assert all(len(x.tokens) == r.options.max_tokens for x in t.sequences)
        u = t.usage
        assert u.prompt_tokens == u.prefill_tokens + u.cached_tokens == len(r.prompt)
    st = s.stats
    assert st["blocks_used"] == 0 and st["running"] == 0 and st["cache_evictions"] > 0
    assert st["prompt_tokens"] == st["prefill_tokens"] + st["cached_tokens"]
    s.kv.check()


def test_shared_prefix_in_one_batch_is_computed_once(model_tok):
    s = make(model_tok)
    pre = prompt(64, seed=5)
    reqs = [req(pre + prompt(8, seed=i), 2, temperature=0) for i in range(4)]
    res = s.run(reqs)
    assert [r.usage.cached_tokens for r in res] == [0, 64, 64, 64]
    assert s.stats["prefill_tokens"] == 72 + 3 * 8


def test_step_api_returns_finished_requests(model_tok):
    s = make(model_tok)
    s.add(req(prompt(10), 1))
    s.add(req(prompt(11), 3))
    assert s.has_work()
    first = s.step()  # prefill: the max_tokens=1 request finishes at once
    assert [len(r.sequences[0].tokens) for r in first] == [1]
    done = []
    while s.has_work():
        done += s.step()
    assert len(done) == 1 and len(done[0].sequences[0].tokens) == 3


# ----------------------------------------------------------------------------- validation
@pytest.mark.parametrize(
    "bad, field",
    [
        (dict(p=[]), "prompt"),
        (dict(p=[1, 49152]), "prompt"),
        (dict(p=[-1]), "prompt"),
        (dict(max_tokens=0), "max_tokens"),
        (dict(n=0), "num_samples"),
        (dict(max_tokens=5000), "context"),
        (dict(temperature=-1.0), "temperature"),
        (dict(top_p=0.0), "top_p"),
        (dict(top_k=-2), "top_k"),
        (dict(top_k=0), "top_k"),  # -1 is off (limits.SAMPLING_BOUNDS); 0 is OpenAI's plane's alias only
        (dict(stop_token_ids=(10**6,)), "stop_token_ids"),
        (dict(stop_strings=("",)), "stop_strings"),
        (dict(weights=WeightsIdentity("tiny", "run")), "adapter"),
    ],
)
def test_bad_requests_raise_and_the_sampler_keeps_serving(model_tok, bad, field):
    s = make(model_tok)
    args = dict(p=[5, 6, 7], max_tokens=3)
    args.update(bad)
    with pytest.raises(ValueError, match=field):
        s.add(req(args.pop("p"), **args))
    assert not s.has_work()
    assert len(s.run([req([5, 6, 7], 2)])[0].sequences[0].tokens) == 2


def test_request_larger_than_the_pool_is_refused(model_tok):
    s = make(model_tok, kv_cache_bytes=10 * BLOCK)  # 10 blocks of 16 tokens
    with pytest.raises(ValueError, match="kv_cache_bytes"):
        s.add(req(prompt(100), 100))
    with pytest.raises(ValueError, match="num_samples"):
        s.add(req(prompt(40), 20, n=8))
    assert len(s.run([req(prompt(100), 50)])[0].sequences[0].tokens) == 50
