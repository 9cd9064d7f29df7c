"""Prompt scores in the sampler: prompt_logprobs_last_n reads the cached prefix, alt-token draws,
target-id logprobs; each against a plain full forward of the tiny model."""

from __future__ import annotations

import dataclasses
import random

import pytest
import torch
from tolerance import assert_same_samples, fp64_model

from trine.engine.api import SampleRequest, SamplingOptions, WeightsIdentity
from trine.engine.config import SamplerConfig
from trine.engine.model.lora import AdapterBatch
from trine.engine.model.tokenizer import Tokenizer
from trine.engine.model.weights import load_model
from trine.engine.sampler.sampler import Sampler

W = WeightsIdentity("tiny")
_ids = iter(range(10**9))


@pytest.fixture(scope="module")
def model_tok(tiny_model_dir):
    return load_model(tiny_model_dir, "cpu"), Tokenizer(tiny_model_dir)


@pytest.fixture(scope="module")
def twins(model_tok, tiny_model_dir):
    """The fp32 model and its fp64 twin, each with the tokenizer (kind 3 comparisons)."""
    return model_tok, (fp64_model(tiny_model_dir), model_tok[1])


def same_scores(compute, twins) -> None:
    """Kind 3, against fp64: `compute(model_tok)` returns (reference, path, tokens). Scores read
    from cached KV, computed in other chunks or batches, are the same math as the reference's in
    another order: in fp64 they agree to FP64_SAME_MATH, in fp32 the path is within MARGIN x the
    reference's own rounding (not a fixed 1e-4 or 1e-5, tuned on one CPU)."""
    (m32, tok), (m64, _) = twins
    assert_same_samples(lambda m: compute((m, tok)), m32, m64)


def sampler(model_tok) -> Sampler:
    return Sampler(*model_tok, SamplerConfig(kv_cache_bytes=16 * 2**20))


def prompt(n: int, seed: int = 0) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(100, 40000) for _ in range(n)]


def req(p, max_tokens=3, *, temperature=0.0, seed=None, **kw) -> SampleRequest:
    return SampleRequest(
        f"r{next(_ids)}",
        list(p),
        SamplingOptions(max_tokens, temperature, seed=seed, stop_at_eos=False),
        W,
        **kw,
    )


def full_logprobs(model, tokens):
    """log_softmax of a plain full forward (no KV pool): [len, vocab]; row i predicts tokens[i + 1]."""
    with torch.inference_mode():
        return torch.log_softmax(model(torch.tensor([tokens]), adapters=AdapterBatch.single(None))[0], -1)


def test_last_n_reads_the_cached_prefix_and_equals_the_full_computation(twins):
    p = prompt(45)

    def compute(mt):  # the whole prompt's scores are the reference
        s = sampler(mt)
        whole = s.run([req(p, prompt_logprobs=True, topk_prompt_logprobs=2)])[0]  # also caches the prompt
        assert whole.usage.cached_tokens == 0
        last = s.run([req(p, prompt_logprobs=True, topk_prompt_logprobs=2, prompt_logprobs_last_n=5)])[0]
        u = last.usage
        # every token before the first scored one: 2 full blocks and 7 of the first request's tail
        assert u.cached_tokens == 39 and u.prefill_tokens == 6 and u.prompt_tokens == 45
        assert last.prompt_logprobs[:40] == [None] * 40 and last.topk_prompt_logprobs[:40] == [None] * 40
        for a, b in zip(last.topk_prompt_logprobs[40:], whole.topk_prompt_logprobs[40:]):
            assert [t for t, _ in a] == [t for t, _ in b]
        # compute_logprobs (no decoding) reads the cache the same way; the samples are unchanged
        only = s.run([req(p, generate=False, prompt_logprobs_last_n=5)])[0]
        assert only.usage.cached_tokens == 39 and only.sequences == []
        assert last.sequences[0].tokens == whole.sequences[0].tokens
        want = whole.prompt_logprobs[40:]
        return (
            {"last": want, "only": want},
            {"last": last.prompt_logprobs[40:], "only": only.prompt_logprobs[40:]},
            [],
        )

    same_scores(compute, twins)


def test_alt_token_draws_have_the_models_logprobs_and_leave_the_samples_alone(model_tok, twins):
    model, s, p = model_tok[0], sampler(model_tok), prompt(20, seed=1)
    lp = full_logprobs(model, p)
    drawn = s.run([req(p, 4, temperature=1.0, seed=5, prompt_alt_tokens_k=3)])[0]
    plain = s.run([req(p, 4, temperature=1.0, seed=5)])[0]
    assert drawn.sequences[0].tokens == plain.sequences[0].tokens  # the draws use their own generator
    toks, lps = drawn.prompt_alt_tokens, drawn.prompt_alt_logprobs
    assert len(toks) == len(lps) == len(p) - 1 and all(len(row) == 3 for row in toks)
    assert len({t for row in toks for t in row}) > len(p)  # temperature 1 on a random model: spread out

    def compute(mt):  # the drawn tokens' logprobs, a full forward's the reference
        d = (
            drawn
            if mt is model_tok
            else sampler(mt).run([req(p, 4, temperature=1.0, seed=5, prompt_alt_tokens_k=3)])[0]
        )
        want = full_logprobs(mt[0], p)[:-1].gather(1, torch.tensor(d.prompt_alt_tokens))
        return {"alt": want.tolist()}, {"alt": d.prompt_alt_logprobs}, d.prompt_alt_tokens

    same_scores(compute, twins)
    again = s.run([req(p, 4, temperature=1.0, seed=5, prompt_alt_tokens_k=3)])[0]
    assert again.prompt_alt_tokens == toks  # seeded
    greedy = s.run([req(p, 1, prompt_alt_tokens_k=2)])[0]
    assert greedy.prompt_alt_tokens == [[t, t] for t in lp[:-1].argmax(-1).tolist()]
    assert drawn.prompt_logprobs is None and drawn.usage.cached_tokens == 0  # every position is drawn at


def test_target_ids_get_their_logprobs_and_rows_before_the_first_read_the_cache(twins):
    p = prompt(40, seed=2)
    rows = [[] for _ in range(len(p) - 1)]
    rows[3], rows[37], rows[38] = [7, 9], [p[38], 11], [12]
    late = [[] for _ in range(len(p) - 1)]
    late[38] = [12]

    def compute(mt):  # a full forward is the reference for the first, the first for the second
        s, lp = sampler(mt), full_logprobs(mt[0], p)
        first = s.run([req(p, 1, target_prompt_ids=rows)])[0]
        assert [len(r) for r in first.target_prompt_logprobs] == [len(r) for r in rows]
        second = s.run([req(p, 1, target_prompt_ids=late)])[0]
        assert second.usage.cached_tokens == 38  # its first scored row is the last: the prefix came cached
        picked = [i for i, ids in enumerate(rows) if ids]
        reference = {"full": [lp[i, rows[i]].tolist() for i in picked]}
        path = {"full": [first.target_prompt_logprobs[i] for i in picked]}
        reference["cached"], path["cached"] = (
            first.target_prompt_logprobs[38],
            second.target_prompt_logprobs[38],
        )
        return reference, path, []

    same_scores(compute, twins)


@pytest.mark.parametrize(
    "bad, field",
    [
        (dict(prompt_logprobs=True, prompt_logprobs_last_n=0), "prompt_logprobs_last_n"),
        (
            dict(prompt_logprobs=True, prompt_logprobs_last_n=5),
            "prompt_logprobs_last_n",
        ),  # len(prompt) - 1 = 4
        (dict(prompt_logprobs_last_n=2), "prompt_logprobs_last_n"),  # without prompt logprobs
        (dict(prompt_alt_tokens_k=-1), "prompt_alt_tokens_k"),
        (dict(prompt_alt_tokens_k=65), "prompt_alt_tokens_k"),
        (dict(target_prompt_ids=[[1]]), "target_prompt_logprobs"),  # needs 4 rows
        (dict(target_prompt_ids=[[], [], [], []]), "target_prompt_logprobs"),  # names no id
        (dict(target_prompt_ids=[[], [], [], [10**6]]), "target_prompt_logprobs"),
    ],
)
def test_bad_prompt_score_options_raise_naming_the_field(model_tok, bad, field):
    s = sampler(model_tok)
    with pytest.raises(ValueError, match=field):
        s.add(req([5, 6, 7, 8, 9], **bad))
    assert not s.has_work()


def scored(p, **kw) -> SampleRequest:
    """A prompt-scoring request as the OpenAI plane sends it (echo, logprobs: 2, max_tokens: 0)."""
    kw.setdefault("reuse_prompt_scores", True)
    return req(p, generate=False, prompt_logprobs=True, topk_prompt_logprobs=2, **kw)


def test_cached_prompt_scores_serve_a_shared_stem_with_the_full_computations_values(twins):
    stem = prompt(40, seed=3)  # 2 full blocks of 16
    p = stem + prompt(9, seed=5)

    def compute(mt):  # a full forward is the reference for served and computed scores alike
        s = sampler(mt)
        first = s.run([scored(stem + prompt(7, seed=4))])[0]
        assert first.usage.cached_tokens == 0
        second = s.run([scored(p)])[0]
        u = second.usage
        assert (u.cached_tokens, u.prefill_tokens, u.prompt_tokens) == (32, 17, 49)
        want = full_logprobs(mt[0], p)
        got = second.prompt_logprobs
        assert got[0] is None and len(got) == len(p)
        for i, top in enumerate(second.topk_prompt_logprobs[1:]):  # served (i < 31) and computed alike
            assert [t for t, _ in top] == want[i].topk(2).indices.tolist()
        # kind 1: the stem's entries are served as they were computed, bit for bit
        assert second.prompt_logprobs[:32] == first.prompt_logprobs[:32]
        # PyTRIO's and Tinker's semantics: whole-prompt logprobs are computed every time
        plain = s.run([scored(p, reuse_prompt_scores=False)])[0]
        assert plain.usage.cached_tokens == 0
        full = want[:-1].gather(1, torch.tensor(p[1:])[:, None])[:, 0]
        return (
            {"served": full.tolist(), "plain": plain.prompt_logprobs[1:]},
            {"served": got[1:], "plain": got[1:]},
            [],
        )

    same_scores(compute, twins)


def test_cached_scores_need_the_top_k_asked_for(model_tok):
    s, stem = sampler(model_tok), prompt(40, seed=6)
    s.run([scored(stem + [7])])  # caches top-2
    wider = s.run(
        [
            req(
                stem + [8],
                generate=False,
                prompt_logprobs=True,
                topk_prompt_logprobs=3,
                reuse_prompt_scores=True,
            )
        ]
    )
    assert wider[0].usage.cached_tokens == 0 and all(len(t) == 3 for t in wider[0].topk_prompt_logprobs[1:])
    narrower = s.run([req(stem + [9], generate=False, prompt_logprobs=True, reuse_prompt_scores=True)])[0]
    assert narrower.usage.cached_tokens == 32 and narrower.topk_prompt_logprobs is None
    # a sampling request's blocks carry no scores: they serve its KV, never a scorer's logprobs
    s2, other = sampler(model_tok), prompt(40, seed=7)
    s2.run([req(other + [1])])
    assert s2.run([scored(other + [2])])[0].usage.cached_tokens == 0


def test_a_batch_sharing_a_stem_prefills_it_once(twins):
    stem = prompt(50, seed=8)
    batch = [scored(stem + prompt(5, seed=20 + i)) for i in range(6)]

    def compute(mt):  # each prompt scored alone is the reference
        out = sampler(mt).run(
            [dataclasses.replace(b, request_id=f"{b.request_id}-{mt[0].dtype}") for b in batch]
        )
        computed = sum(r.usage.prefill_tokens for r in out)
        assert computed == 55 + 5 * (55 - 48)  # the first request's whole prompt, then each one's suffix
        assert [r.usage.cached_tokens for r in out] == [0] + [48] * 5
        alone = [sampler(mt).run([scored(b.prompt, reuse_prompt_scores=False)])[0] for b in batch[3:]]
        reference = {i: b.prompt_logprobs[1:] for i, b in enumerate(alone)}
        return reference, {i: a.prompt_logprobs[1:] for i, a in enumerate(out[3:])}, []

    same_scores(compute, twins)
