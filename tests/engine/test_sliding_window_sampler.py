"""The sampler on sliding-window models (Gemma 3, OLMo 3; window 8, prompts of 40 tokens): seeded
samples alone and batched, prompt logprobs, and cached prefixes (a group, a chat's next turn, a
shared system prompt) against a fresh prefill, each sampled logprob against a full forward (ours
and transformers'; kind 3, tests/tolerance.py)."""

from __future__ import annotations

import pytest
import torch
from conftest import WINDOWED_FAMILIES
from test_model_parity import hf_model
from test_sampler import against_full_forward, full_logprobs, make, prompt, req
from tolerance import Rounding, assert_same_samples, fp64_model

from trine.engine.model.tokenizer import Tokenizer
from trine.engine.model.weights import load_model

BOTH = list(WINDOWED_FAMILIES)
# OLMo 3's sampler runs the same windowed contexts as Gemma 3's: beyond one test, the slow tier
ONE = ["gemma3", *(pytest.param(f, marks=pytest.mark.slow) for f in WINDOWED_FAMILIES if f != "gemma3")]


@pytest.fixture(scope="module")
def twins(request, tiny_windowed_dirs):
    d = tiny_windowed_dirs[request.param]
    tok = Tokenizer(d)
    return (load_model(d, "cpu"), tok), (fp64_model(d), tok), d


def same_samples(compute, twins) -> None:
    (m32, tok), (m64, _), _ = twins
    assert_same_samples(lambda m: compute((m, tok)), m32, m64)


def like_transformers(twins, p, seqs) -> None:
    """Each sequence's logprobs from a full forward of transformers' model are within our fp32
    rounding of our fp64 full forward (kind 3): the sampler's are within it of ours
    (`against_full_forward`), so the sampler computes transformers' model."""
    (m32, _), (m64, _), d = twins
    ref = hf_model(d)
    for s in seqs:
        t = torch.tensor([p + s.tokens])
        pick = torch.tensor(s.tokens)[:, None]
        with torch.no_grad():
            theirs = torch.log_softmax(ref(t).logits[0], -1)[len(p) - 1 : -1].gather(1, pick)
        ours32 = full_logprobs(m32, p + s.tokens)[len(p) - 1 : -1].gather(1, pick)
        ours64 = full_logprobs(m64, p + s.tokens)[len(p) - 1 : -1].gather(1, pick)
        Rounding(ours32, ours64).assert_within(theirs)


@pytest.mark.parametrize("twins", BOTH, indirect=True)
def test_seeded_samples_alone_and_batched(twins):
    """A request's seeded samples are the same alone and in a batch beside others of other lengths
    (decode steps packed by request and not), and their logprobs are a full forward's."""
    p = prompt(40)
    others = [prompt(23, seed=1), prompt(57, seed=2)]

    def compute(mt):
        alone = make(mt).run([req(p, 12, n=3, seed=5)])[0]
        batched = make(mt).run([req(o, 9, seed=i) for i, o in enumerate(others)] + [req(p, 12, n=3, seed=5)])
        assert [s.tokens for s in batched[-1].sequences] == [s.tokens for s in alone.sequences]
        ref, path = against_full_forward(mt[0], p, alone.sequences)
        ref["batched"], path["batched"] = ref["full"], [s.logprobs for s in batched[-1].sequences]
        return ref, path, [s.tokens for s in alone.sequences]

    same_samples(compute, twins)
    alone = make(twins[0]).run([req(p, 12, n=3, seed=5)])[0]
    like_transformers(twins, p, alone.sequences)


@pytest.mark.parametrize("twins", ONE, indirect=True)
def test_prompt_logprobs_are_a_full_forwards(twins):
    p = prompt(40, seed=3)

    def compute(mt):
        res = make(mt).run([req(p, 1, seed=0, prompt_logprobs=True)])[0]
        full = full_logprobs(mt[0], p)[:-1].gather(1, torch.tensor(p[1:])[:, None])[:, 0]
        return {"prompt": full.tolist()}, {"prompt": res.prompt_logprobs[1:]}, res.sequences[0].tokens

    same_samples(compute, twins)


@pytest.mark.parametrize("twins", ONE, indirect=True)
def test_cached_prefixes_serve_what_a_fresh_prefill_computes(twins):
    """A group's second request, a chat's next turn and a prompt sharing another's system prompt
    are served from the cache (metered as cached) and sample what a sampler without a prefix cache
    samples; every logprob is a full forward's."""
    system, p = prompt(32, seed=4), prompt(40, seed=5)

    def compute(mt):
        hot, cold = make(mt), make(mt, enable_prefix_cache=False)
        reference, path, tokens = {}, {}, []
        group = hot.run([req(p, 8, n=4, seed=1)])[0]
        reply = hot.run([req(p, 8, temperature=0)])[0].sequences[0].tokens
        cases = {
            "group": (p, 39, dict(n=4, seed=1)),
            "turn": (p + reply + prompt(5, seed=6), 47, dict(n=2, seed=2)),
            "system": (system + prompt(9, seed=7), 32, dict(n=2, seed=3)),
        }
        hot.run([req(system + prompt(11, seed=8), 2)])  # caches the system prompt's two blocks
        for name, (q, cached, kw) in cases.items():
            got = hot.run([req(q, 8, **kw)])[0]
            want = cold.run([req(q, 8, **kw)])[0]
            assert got.usage.cached_tokens == cached and want.usage.cached_tokens == 0
            assert [s.tokens for s in got.sequences] == [s.tokens for s in want.sequences]
            reference[name] = [s.logprobs for s in want.sequences]
            path[name] = [s.logprobs for s in got.sequences]
            ref, full = against_full_forward(mt[0], q, got.sequences)
            reference[name + " full"], path[name + " full"] = ref["full"], full["full"]
            tokens += [s.tokens for s in got.sequences]
        assert [s.tokens for s in group.sequences] == tokens[:4]
        hot.kv.check()
        assert hot.stats["blocks_used"] == 0
        return reference, path, tokens

    same_samples(compute, twins)


@pytest.mark.parametrize("twins", ONE, indirect=True)
def test_chunked_prefill_across_the_window_is_one_prefill(twins):
    """A 40-token prompt prefilled in chunks of 16 (each chunk's windowed layers read keys of the
    chunk before) samples as one prefill does."""
    p = prompt(40, seed=9)

    def compute(mt):
        whole = make(mt).run([req(p, 8, n=2, seed=4)])[0]
        chunked = make(mt, max_batch_tokens=16, min_prefill_tokens=16).run([req(p, 8, n=2, seed=4)])[0]
        assert [s.tokens for s in chunked.sequences] == [s.tokens for s in whole.sequences]
        return (
            {"chunked": [s.logprobs for s in whole.sequences]},
            {"chunked": [s.logprobs for s in chunked.sequences]},
            [s.tokens for s in whole.sequences],
        )

    same_samples(compute, twins)
