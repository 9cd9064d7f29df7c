"""The sampler on a hybrid model (Qwen3.5: Gated DeltaNet + gated attention, tiny and random):
recurrent state per sequence, and the prefix cache over it (sampler/state_cache.py).

A hit serves what a fresh prefill computes: kind 3 (tests/tolerance.py) against a sampler without
a prefix cache and against a plain full forward; kind 1 (bit for bit) under batch-invariant kernels,
where the sampler's logprobs also equal the training forward's."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from test_model_parity import random_adapter
from test_sampler import against_full_forward, full_forward_logprobs, prompt, req
from tolerance import assert_bitwise, assert_same_samples, fp64_model

from trine.engine.api import LoRAConfig, WeightsIdentity
from trine.engine.config import SamplerConfig
from trine.engine.model import invariant
from trine.engine.model.lora import Adapter
from trine.engine.model.tokenizer import Tokenizer
from trine.engine.model.weights import load_model
from trine.engine.sampler.sampler import Sampler
from trine.engine.sampler.state_cache import state_bytes

MB = 2**20
K = 32  # state_snapshot_tokens of these tests: two blocks


@pytest.fixture(scope="module")
def model_tok(tiny_qwen3_5_dir):
    return load_model(tiny_qwen3_5_dir, "cpu"), Tokenizer(tiny_qwen3_5_dir)


@pytest.fixture(scope="module")
def twins(model_tok, tiny_qwen3_5_dir):
    return model_tok, (fp64_model(tiny_qwen3_5_dir), model_tok[1])


def same_samples(compute, twins) -> None:
    (m32, tok), (m64, _) = twins
    assert_same_samples(lambda m: compute((m, tok)), m32, m64)


def make(mt, **kw) -> Sampler:
    kw.setdefault("kv_cache_bytes", 4 * MB)
    kw.setdefault("state_snapshot_tokens", K)
    return Sampler(*mt, SamplerConfig(**kw))


def checked(s: Sampler) -> Sampler:
    """The KV cache's and the state cache's invariants, once every request is done."""
    s.kv.check()
    s.states.check([])
    assert s.stats["blocks_used"] == 0 and s.stats["state_slots_free"] == s.stats["state_slots_total"]
    return s


def usage(res) -> tuple[int, int]:
    return res.usage.prefill_tokens, res.usage.cached_tokens


def logprobs(results) -> list[list[float]]:
    return [x.logprobs for r in results for x in r.sequences]


def tokens(results) -> list[list[int]]:
    return [x.tokens for r in results for x in r.sequences]


def against_cold(mt, hot: list, reqs: list, p_of) -> tuple[dict, dict]:
    """(reference, path): each hot result's samples from a sampler without a prefix cache (its
    tokens must be the same) and from a full forward of its prompt + completion."""
    cold = make(mt, enable_prefix_cache=False).run(reqs)
    assert tokens(cold) == tokens(hot)
    ref, path = {"cold": logprobs(cold)}, {"cold": logprobs(hot)}
    full = [against_full_forward(mt[0], p_of(r), r.sequences) for r in hot]
    ref["full"] = [x for f, _ in full for x in f["full"]]
    path["full"] = [x for _, f in full for x in f["full"]]
    return ref, path


# ----------------------------------------------------------------------------- parity
def test_greedy_samples_and_prompt_logprobs_match_transformers(tiny_qwen3_5_dir, twins):
    """Greedy decoding is transformers' `generate`, token for token, and the sampled and prompt
    logprobs are its log-softmax (kind 3: transformers' fp32 within our fp32 rounding of the fp64
    result)."""
    from tolerance import Rounding
    from transformers import AutoModelForCausalLM

    prompts = [prompt(37, seed=60), prompt(21, seed=61)]
    hf = AutoModelForCausalLM.from_pretrained(tiny_qwen3_5_dir, dtype=torch.float32).eval()
    want_tokens, want = [], {"sampled": [], "prompt": []}
    with torch.no_grad():
        for p in prompts:
            out = hf.generate(
                torch.tensor([p]),
                max_new_tokens=8,
                do_sample=False,
                output_logits=True,
                return_dict_in_generate=True,
            )
            got = out.sequences[0, len(p) :].tolist()
            want_tokens.append(got)
            lp = torch.log_softmax(torch.cat(out.logits).double(), -1)
            want["sampled"].append(lp.gather(1, torch.tensor(got)[:, None])[:, 0])
            plp = torch.log_softmax(hf(torch.tensor([p])).logits[0].double(), -1)
            want["prompt"].append(plp[:-1].gather(1, torch.tensor(p[1:])[:, None])[:, 0])

    def ours(mt):
        res = make(mt).run([req(p, 8, temperature=0, prompt_logprobs=True) for p in prompts])
        assert tokens(res) == want_tokens
        return {
            "sampled": torch.tensor([x for lp in logprobs(res) for x in lp]),
            "prompt": torch.tensor([x for r in res for x in r.prompt_logprobs[1:]]),
        }

    (m32, tok), (m64, _) = twins
    Rounding(ours((m32, tok)), ours((m64, tok))).assert_within({k: torch.cat(v) for k, v in want.items()})


def test_seeded_samples_alone_equal_them_batched_with_others(twins):
    """A request's seeded samples are the same tokens alone and decoded beside other requests (a
    group, other prompt lengths), its logprobs the same within rounding (kind 3)."""
    p = prompt(45, seed=62)

    def compute(mt):
        alone = make(mt).run([req(p, 8, n=2, seed=9)])[0]
        others = [req(prompt(20, seed=63), 10, n=3, seed=1), req(prompt(70, seed=64), 6, seed=2)]
        batched = make(mt).run([others[0], req(p, 8, n=2, seed=9), others[1]])[1]
        return {"lp": logprobs([alone])}, {"lp": logprobs([batched])}, tokens([batched])

    same_samples(compute, twins)


def test_sequences_in_scattered_state_slots_decode_as_alone(twins):
    """A request that arrives while another decodes takes the slots a finished one freed: the decode
    batch's slots are then not consecutive (read and written back by index, not as one view of the
    pool), and every sample is still the one it is alone (kind 3)."""
    prompts = [prompt(20, seed=70), prompt(25, seed=71), prompt(30, seed=72)]
    shapes = [(3, 2), (1, 12), (2, 6)]  # (samples, max_tokens): the first ends early

    def compute(mt):
        s = make(mt)
        reqs = [req(p, m, n=n, seed=i) for i, (p, (n, m)) in enumerate(zip(prompts, shapes))]
        s.add(reqs[0])
        s.add(reqs[1])
        done = []
        while len(done) < 1:
            done += s.step()
        s.add(reqs[2])
        assert [q.slot for q in s.scheduler.running] == [3]
        while s.has_work():
            done += s.step()
            assert len(done) == 3 or s.scheduler.running[0].slot == 3
        res = sorted(done, key=lambda r: int(r.request_id[1:]))
        alone = [
            make(mt).run([req(p, m, n=n, seed=i)])[0] for i, (p, (n, m)) in enumerate(zip(prompts, shapes))
        ]
        assert tokens(res) == tokens(alone)
        checked(s)
        return {"lp": logprobs(alone)}, {"lp": logprobs(res)}, tokens(res)

    same_samples(compute, twins)


# ----------------------------------------------------------------------------- where snapshots serve
def test_a_group_and_a_repeated_prompt_prefill_it_once(twins):
    """A group of 4 samples prefills its prompt once; the same request again computes only the
    last prompt token (the state after the other 69 is the prompt's snapshot)."""
    p = prompt(70)

    def compute(mt):
        s = make(mt)
        first = s.run([req(p, 6, n=4, seed=1)])[0]
        again = s.run([req(p, 6, n=4, seed=1)])[0]
        assert usage(first) == (70, 0) and usage(again) == (1, 69)
        assert tokens([first]) == tokens([again]) and len(set(map(tuple, tokens([first])))) > 1
        assert s.stats["state_snapshot_hits"] == 1
        checked(s)
        ref, path = against_cold(mt, [first, again], [req(p, 6, n=4, seed=1) for _ in range(2)], lambda r: p)
        return ref, path, tokens([first])

    same_samples(compute, twins)


def test_separate_requests_of_one_prompt_prefill_it_once(twins):
    """Three requests of one prompt sent together: the first prefills it, the others wait for its
    blocks and are served its snapshot: the last token each."""
    p = prompt(70, seed=1)

    def compute(mt):
        s = make(mt)
        reqs = [req(p, 5, seed=i) for i in range(3)]
        res = s.run(reqs)
        assert [usage(r) for r in res] == [(70, 0), (1, 69), (1, 69)]
        checked(s)
        ref, path = against_cold(mt, res, [req(p, 5, seed=i) for i in range(3)], lambda r: p)
        return ref, path, tokens(res)

    same_samples(compute, twins)


def test_a_chats_next_turn_computes_only_its_new_tokens(twins):
    """A finished sequence leaves the state after all but its last token: the next turn (the
    reply, then new tokens) computes the reply's last token and the new ones."""
    p = prompt(20, seed=2)

    def compute(mt):
        s = make(mt)
        reply = s.run([req(p, 12, seed=3)])[0].sequences[0].tokens
        turn = p + reply + prompt(9, seed=4)
        hot = s.run([req(turn, 6, n=2, seed=5)])[0]
        assert usage(hot) == (10, 31)
        checked(s)
        ref, path = against_cold(mt, [hot], [req(turn, 6, n=2, seed=5)], lambda r: turn)
        return ref, path, [reply, *tokens([hot])]

    same_samples(compute, twins)


def test_prompts_sharing_a_system_prompt_share_its_aligned_part(twins):
    """Snapshots every K tokens: a second prompt with the same 80-token system prompt is served
    its first 64 (2 K); one that leaves the first between two snapshots (at 90, beyond the one at
    64 and before the one at 96) recomputes from the earlier one."""
    system = prompt(80, seed=6)
    a, b = system + prompt(20, seed=7), system + prompt(12, seed=8)
    c = a[:90] + prompt(8, seed=9)

    def compute(mt):
        s = make(mt)
        res = s.run([req(a, 5, seed=1)]) + s.run([req(b, 5, seed=1)]) + s.run([req(c, 5, seed=1)])
        assert [usage(r) for r in res] == [(100, 0), (len(b) - 64, 64), (len(c) - 64, 64)]
        checked(s)
        prompts = {r.request_id: q for r, q in zip(res, (a, b, c))}
        ref, path = against_cold(
            mt, res, [req(q, 5, seed=1) for q in (a, b, c)], lambda r: prompts[r.request_id]
        )
        return ref, path, tokens(res)

    same_samples(compute, twins)


def test_snapshots_inside_a_chunk_equal_chunk_boundaries(twins):
    """A prompt prefilled in chunks that end elsewhere than its snapshots (20 tokens a chunk
    beside a decoding sequence): the snapshots taken inside the chunks serve the same prompt
    again as well as those of a prompt prefilled whole."""
    p = prompt(75, seed=10)

    def compute(mt):
        s = make(mt, max_batch_tokens=20, min_prefill_tokens=16)
        first = s.run([req(p, 4, seed=2)])[0]
        assert s.stats["prefill_forwards"] == 4 and s.stats["state_snapshots_taken"] >= 3  # 32, 64, 74, end
        again = s.run([req(p[:70] + prompt(3, seed=11), 4, seed=2)])[0]
        assert usage(again) == (9, 64)
        checked(s)
        q = p[:70] + prompt(3, seed=11)
        ref, path = against_cold(mt, [first, again], [req(p, 4, seed=2), req(q, 4, seed=2)], lambda r: p)
        ref["full"], path["full"] = (
            [
                full_forward_logprobs(mt[0], p, first.sequences[0]),
                full_forward_logprobs(mt[0], q, again.sequences[0]),
            ],
            logprobs([first, again]),
        )
        return ref, path, tokens([first, again])

    same_samples(compute, twins)


# ----------------------------------------------------------------------------- budget and identity
def test_a_small_snapshot_budget_evicts_and_keeps_serving_correct_results(twins):
    """Room for 2 snapshots: each prompt's own snapshots evict older ones (least recently used
    first), while their KV blocks stay cached; every result is the cold sampler's."""
    prompts = [prompt(40, seed=20 + i) for i in range(4)]

    def compute(mt):
        s = make(mt, state_cache_bytes=2 * state_bytes(mt[0].cfg, mt[0].dtype) + 1)
        assert s.stats["state_snapshots_total"] == 2
        res = [s.run([req(q, 4, seed=3)])[0] for q in prompts]
        again = s.run([req(prompts[-1], 4, seed=3)])[0]  # its snapshot after 39 tokens survived
        first = s.run([req(prompts[0], 4, seed=3)])[0]  # its snapshots did not: blocks alone serve nothing
        assert usage(again) == (1, 39) and usage(first) == (40, 0)
        assert s.stats["state_snapshot_evictions"] >= 6 and s.stats["state_snapshots"] == 2
        assert s.stats["blocks_cached"] >= 4 * 2
        checked(s)
        res += [again, first]
        prompt_of = dict(zip([r.request_id for r in res], prompts + [prompts[-1], prompts[0]]))
        reqs = [req(prompt_of[r.request_id], 4, seed=3) for r in res]
        ref, path = against_cold(mt, res, reqs, lambda r: prompt_of[r.request_id])
        return ref, path, tokens(res)

    same_samples(compute, twins)


def test_evicting_kv_blocks_drops_their_snapshots(model_tok):
    """A KV pool of a few blocks: blocks evicted for new prompts take their snapshots with them
    (the cache's invariants hold throughout), and a later prompt is served correctly."""
    cfg = model_tok[0].cfg
    block = 2 * len(cfg.attention_layers) * 16 * cfg.num_kv_heads * cfg.head_dim * 4
    s = make(model_tok, kv_cache_bytes=12 * block)
    for i in range(6):
        s.run([req(prompt(40, seed=30 + i), 3, seed=1)])
        checked(s)
    assert s.stats["cache_evictions"] > 0 and s.stats["state_snapshots"] <= s.stats["blocks_cached"]
    cold = make(model_tok, enable_prefix_cache=False)
    p = prompt(40, seed=35)
    assert tokens(s.run([req(p, 5, seed=4)])) == tokens(cold.run([req(p, 5, seed=4)]))


def test_random_traffic_keeps_the_caches_invariants_and_serves_cold_results(model_tok):
    """Requests sharing stems at random lengths (groups, chat turns, repeats), added between steps,
    some cancelled, on a small KV pool and a 3-snapshot budget: after every step the block pool's
    and the state cache's invariants hold (every slot held once, every snapshot on a keyed block),
    and every request that ran to its end sampled what a sampler without a prefix cache samples."""
    import random

    rng = random.Random(5)
    stems = [prompt(40, seed=80), prompt(70, seed=81)]
    cfg = model_tok[0].cfg
    block = 2 * len(cfg.attention_layers) * 16 * cfg.num_kv_heads * cfg.head_dim * 4
    s = make(model_tok, kv_cache_bytes=40 * block, state_cache_bytes=3 * state_bytes(cfg, model_tok[0].dtype))
    sent, done, history = {}, {}, []
    for i in range(14):
        stem = rng.choice(stems + history[-2:])
        p = stem[: rng.randrange(len(stem) // 2, len(stem) + 1)] + prompt(rng.randrange(1, 20), seed=100 + i)
        r = req(p, rng.randrange(2, 8), n=rng.choice([1, 1, 3]), seed=i)
        sent[r.request_id] = r
        s.add(r)
        for _ in range(rng.randrange(1, 4)):
            for res in s.step():
                done[res.request_id] = res
                history.append(sent[res.request_id].prompt + res.sequences[0].tokens)
            live = [x for q in s.scheduler.prefilling for x in q.slots] + [
                q.slot for q in s.scheduler.running
            ]
            s.kv.check()
            s.states.check(live)
        if i % 5 == 4:
            cancelled = s.cancel(r.request_id)
            if cancelled is not None:
                done[r.request_id] = None
    while s.has_work():
        for res in s.step():
            done[res.request_id] = res
    checked(s)
    assert s.stats["state_snapshot_hits"] > 0 and s.stats["state_snapshot_evictions"] > 0
    cold = make(model_tok, enable_prefix_cache=False)
    for rid, res in done.items():
        if res is not None:
            assert tokens([res]) == tokens(
                cold.run([dataclasses.replace(sent[rid], request_id=rid + "c")])
            ), rid


def test_other_weights_never_get_the_snapshots(model_tok):
    """A snapshot is served only to the weights identity that computed it: another version, or an
    adapter, gets no cached tokens."""
    s = make(model_tok)
    p = prompt(50, seed=40)
    s.run([req(p, 3)])
    assert usage(s.run([req(p, 3)])[0]) == (1, 49)
    assert usage(s.run([req(p, 3, weights=WeightsIdentity("tiny", None, 1))])[0]) == (50, 0)
    adapter = Adapter(model_tok[0], LoRAConfig(rank=4))
    assert usage(s.run([req(p, 3, weights=WeightsIdentity("tiny", "a", 0), adapter=adapter)])[0]) == (50, 0)
    checked(s)


def test_prompt_logprobs_never_read_the_snapshots(model_tok):
    s = make(model_tok)
    p = prompt(40, seed=41)
    s.run([req(p, 3)])
    scored = s.run([req(p, 3, prompt_logprobs=True)])[0]
    assert usage(scored) == (40, 0) and len(scored.prompt_logprobs) == 40
    checked(s)


def test_requests_that_reuse_cached_prompt_scores_are_served_at_snapshots(twins):
    """The OpenAI plane's requests (`reuse_prompt_scores`): one that scores nothing is served its
    prompt's snapshot like any other; one that scores its prompt is served whole blocks that carry
    scores, up to the last snapshot at a block's end (K), and computes the same prompt logprobs."""
    p = prompt(50, seed=43)

    def reuse(r):
        return dataclasses.replace(r, reuse_prompt_scores=True)

    def compute(mt):
        s = make(mt)
        s.run([req(p, 3)])
        assert usage(s.run([reuse(req(p, 3))])[0]) == (1, 49)
        first = s.run([reuse(req(p, 3, seed=1, prompt_logprobs=True))])[0]
        scored = s.run([reuse(req(p, 3, seed=1, prompt_logprobs=True))])[0]
        assert usage(first) == (50, 0) and usage(scored) == (50 - K, K)
        checked(s)
        return {"lp": first.prompt_logprobs[1:]}, {"lp": scored.prompt_logprobs[1:]}, tokens([scored])

    same_samples(compute, twins)


def test_a_group_larger_than_the_state_pool_is_refused(model_tok):
    s = make(model_tok, max_running=4)
    with pytest.raises(ValueError, match="num_samples.*max_running"):
        s.add(req(prompt(10), 3, n=5))
    assert s.run([req(prompt(10), 3, n=4)])[0].usage.sample_tokens == 12


def test_mixed_adapters_in_one_batch(twins):
    """Requests on two adapters and the base model decode in one batch; each sample's logprobs are
    a full forward's under its own weights (kind 3)."""
    p = prompt(30, seed=42)

    def compute(mt):
        model = mt[0]
        adapters = [random_adapter(model, LoRAConfig(rank=4), seed=i) for i in range(2)]
        names = [WeightsIdentity("tiny", f"a{i}", 0) for i in range(2)]
        reqs = [req(p, 5, seed=1, weights=names[0], adapter=adapters[0]), req(p, 5, seed=1)]
        reqs.append(req(p, 5, seed=1, weights=names[1], adapter=adapters[1]))
        res = make(mt).run(reqs)
        ref, path = {"full": []}, {"full": []}
        for r, a in zip(res, [adapters[0], None, adapters[1]]):
            f, g = against_full_forward(model, p, r.sequences, a)
            ref["full"] += f["full"]
            path["full"] += g["full"]
        return ref, path, tokens(res)

    same_samples(compute, twins)


# ----------------------------------------------------------------------------- batch invariant
@pytest.fixture()
def batch_invariant():
    invariant.enable(True)
    yield
    invariant.enable(False)


def test_batch_invariant_hits_equal_fresh_prefills_and_the_trainer_bit_for_bit(model_tok, batch_invariant):
    """Under batch-invariant kernels a hit is exact: each scenario's samples (a repeated group, a
    chat's next turn, a shared system prompt) have the logprobs of a sampler without a prefix
    cache and of the training forward, bit for bit."""
    system = prompt(70, seed=50)
    s = make(model_tok)
    results, prompts = [], []

    def run(p, **kw):
        results.append(s.run([req(p, 5, seed=6, **kw)])[0])
        prompts.append(p)
        return results[-1]

    run(system, n=3)
    assert usage(run(system, n=3)) == (1, 69)
    turn = system + results[-1].sequences[0].tokens + prompt(5, seed=51)
    assert usage(run(turn)) == (6, 74)
    assert usage(run(system + prompt(9, seed=52))) == (10, 69)  # the system prompt's own snapshot
    assert usage(run(system[:66] + prompt(9, seed=53))) == (11, 64)  # its snapshot every K tokens
    checked(s)
    cold = make(model_tok, enable_prefix_cache=False)
    fresh = [cold.run([req(p, 5, seed=6, n=len(r.sequences))])[0] for p, r in zip(prompts, results)]
    assert tokens(fresh) == tokens(results)
    assert_bitwise(logprobs(results), logprobs(fresh))
    trainer = [
        full_forward_logprobs(model_tok[0], p, x) for p, r in zip(prompts, results) for x in r.sequences
    ]
    assert_bitwise(logprobs(results), trainer)
