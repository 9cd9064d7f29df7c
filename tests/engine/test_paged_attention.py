"""Decode attention over the paged pool read in place (engine/model/kernels/paged_attention.py): SDPA's result
over a gathered copy, per row independent of the batch, used only where it suits, and a sampler that
decodes the same tokens with it as without."""

from __future__ import annotations

import random
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F
from tolerance import assert_same_samples, assert_within_bound, attention_bound, fp64_model

from trine.engine.api import SampleRequest, SamplingOptions, WeightsIdentity
from trine.engine.config import SamplerConfig
from trine.engine.model import attention, invariant
from trine.engine.model.kernels import paged_attention
from trine.engine.model.tokenizer import Tokenizer
from trine.engine.model.weights import load_model
from trine.engine.sampler.sampler import Sampler

pytestmark = pytest.mark.skipif(not paged_attention.available(), reason="no C compiler with OpenMP here")


def gathered(q, kp, vp, read, mask):
    """The reference: keys copied out of the pools, torch's SDPA. q [P, Q, H, D] -> same."""
    P, L = read.shape
    kvh, d = kp.shape[1:]
    kc = kp[read.reshape(-1)].view(P, L, kvh, d).transpose(1, 2)
    vc = vp[read.reshape(-1)].view(P, L, kvh, d).transpose(1, 2)
    out = F.scaled_dot_product_attention(
        q.transpose(1, 2), kc, vc, attn_mask=mask[:, None], enable_gqa=kvh != q.shape[2]
    )
    return out.transpose(1, 2)


def assert_attends(got, q, kp, vp, read, mask):
    """Kind 2, a priori: the kernel's result and torch's SDPA over a gathered copy (the reference)
    are each within `attention_bound` of the exact (fp64) attention. Both are fp32 softmax
    attentions that sum in orders of their own, so neither equals the other bit for bit; the bound
    follows from the scores' dot products (gamma_D) through the softmax and the V sum, and holds
    for any summation order, on any CPU's kernels."""
    P, L = read.shape
    kvh, d = kp.shape[1:]
    kc = kp[read.reshape(-1)].view(P, L, kvh, d).transpose(1, 2)
    vc = vp[read.reshape(-1)].view(P, L, kvh, d).transpose(1, 2)
    exact, bound = attention_bound(q.transpose(1, 2), kc, vc, mask[:, None])
    exact, bound = exact.transpose(1, 2), bound.transpose(1, 2)
    assert_within_bound(got, exact, bound, "the paged kernel")
    assert_within_bound(gathered(q, kp, vp, read, mask), exact, bound, "SDPA over a gathered copy")


def case(P, Q, L, H, KVH, D, slots=5000, seed=0):
    g = torch.Generator().manual_seed(seed)
    kp, vp = torch.randn(slots, KVH, D, generator=g), torch.randn(slots, KVH, D, generator=g)
    read = torch.randint(0, slots, (P, L), generator=g)
    mask = torch.rand(P, Q, L, generator=g) < 0.6
    mask[..., 0] = True  # every query sees a key
    return torch.randn(P, Q, H, D, generator=g) * 3, kp, vp, read, mask


@pytest.mark.parametrize(
    "P,Q,L,H,KVH,D",
    [
        (6, 1, 77, 9, 3, 64),  # SmolLM2's heads, one query per row, a partial key tile
        (3, 8, 200, 4, 2, 24),  # packed rows (a group's samples), the tiny test models' heads
        (2, 3, 33, 8, 8, 128),  # no grouped heads
        (1, 1, 1, 2, 1, 16),  # one key
        (2, 7, 300, 9, 3, 64),  # 21 query heads a tile: scored as a GEMM, the last block partial
        (2, 4, 90, 16, 2, 128),  # the GEMM path at head size 128
    ],
)
def test_equals_sdpa_over_a_gathered_copy(P, Q, L, H, KVH, D):
    q, kp, vp, read, mask = case(P, Q, L, H, KVH, D)
    got = paged_attention.paged_attention(q, kp, vp, read, mask)
    assert_attends(got, q, kp, vp, read, mask)


@pytest.mark.parametrize(
    "P,Q,L,H,KVH,D",
    [(6, 1, 77, 9, 3, 64), (2, 7, 300, 9, 3, 64), (2, 4, 90, 16, 2, 128), (3, 8, 200, 4, 2, 24)],
)
def test_a_bf16_pool_is_read_as_its_exact_values(P, Q, L, H, KVH, D):
    """A bf16 engine's pool: its rows widened to fp32 as they are read (exact), the attention in
    fp32, the result rounded to bf16 once. Kind 2: within the fp32 attention bound of the exact
    attention over the same bf16 values, plus that one rounding (half a bf16 ulp: 2^-8 of it)."""
    q, kp, vp, read, mask = (
        x.to(torch.bfloat16) if x.is_floating_point() else x for x in case(P, Q, L, H, KVH, D)
    )
    assert paged_attention.suits(q, kp, mask[:, None], read)
    got = paged_attention.paged_attention(q, kp, vp, read, mask)
    assert got.dtype == torch.bfloat16
    kc = kp[read.reshape(-1)].view(P, L, KVH, D).transpose(1, 2).float()
    vc = vp[read.reshape(-1)].view(P, L, KVH, D).transpose(1, 2).float()
    exact, bound = attention_bound(q.float().transpose(1, 2), kc, vc, mask[:, None])
    exact, bound = exact.transpose(1, 2), bound.transpose(1, 2)
    assert_within_bound(got.float(), exact, bound * (1 + 2**-8) + 2**-8 * exact.abs(), "the bf16 kernel")
    assert not paged_attention.suits(q, kp.float(), mask[:, None], read)  # dtypes differ: gathered


def test_loading_it_keeps_the_process_subnormal_floats():
    """A library linked with -ffast-math sets flush-to-zero for every thread of the process."""
    code = (
        "import torch\nfrom trine.engine.model.kernels import paged_attention as p\nassert p.available()\n"
        "print(float(torch.tensor(1e-40) * 1.0) != 0.0, 1e-310 * 1.0 != 0.0)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "True True"


def test_masked_keys_do_not_count_even_when_huge():
    q, kp, vp, read, mask = case(2, 2, 64, 4, 2, 32)
    kp[read[:, 40:]] = 1e4  # keys no query sees; softmax must not touch them
    mask[:, :, 40:] = False
    got = paged_attention.paged_attention(q, kp, vp, read, mask)
    assert_attends(got, q, kp, vp, read, mask)
    assert got.isfinite().all()


@pytest.mark.parametrize("Q", [1, 8])  # key by key, and a group's queries through the GEMM path
def test_a_slot_no_query_sees_may_hold_anything(Q):
    """Padding reads any slot; one never written may hold NaN, and 0 * NaN is NaN."""
    q, kp, vp, _, mask = case(2, Q, 96, 9, 3, 64)
    read = torch.randperm(kp.shape[0], generator=torch.Generator().manual_seed(1))[: 2 * 96].view(2, 96)
    mask[:, :, 50:70] = False
    clean = paged_attention.paged_attention(q, kp, vp, read, mask)
    unseen = read[:, 50:70].reshape(-1)
    kp[unseen], vp[unseen] = float("nan"), float("inf")
    # kind 1: unseen slots take no part in the sums, so the same inputs give the same bits
    assert torch.equal(paged_attention.paged_attention(q, kp, vp, read, mask), clean)


def test_a_groups_samples_over_their_shared_prompt():
    """The GRPO layout: one packed row per prompt, its samples' queries all seeing the prompt's
    keys and each its own keys after them."""
    P, Q, prompt, own = 3, 8, 512, 20
    q, kp, vp, read, _ = case(P, Q, prompt + Q * own, 9, 3, 64)
    mask = torch.zeros(P, Q, prompt + Q * own, dtype=torch.bool)
    mask[..., :prompt] = True
    for j in range(Q):
        mask[:, j, prompt + j * own : prompt + j * own + 1 + j] = True
    got = paged_attention.paged_attention(q, kp, vp, read, mask)
    assert_attends(got, q, kp, vp, read, mask)


def test_a_rows_result_does_not_depend_on_the_other_rows():
    q, kp, vp, read, mask = case(5, 1, 150, 9, 3, 64)
    batch = paged_attention.paged_attention(q, kp, vp, read, mask)
    alone = paged_attention.paged_attention(q[2:3], kp, vp, read[2:3], mask[2:3])
    assert torch.equal(batch[2:3], alone)  # kind 1: the kernel's contract, a row's sums its own


def test_used_only_where_it_suits(monkeypatch):
    q, kp, _, read, mask = case(4, 1, 64, 9, 3, 64)
    mask4 = mask[:, None]
    suits = paged_attention.suits
    assert suits(q, kp, mask4, read)
    many = torch.ones(1, 1, paged_attention.MAX_QUERIES + 1, 64, dtype=torch.bool)  # a prefill chunk
    assert not suits(q, kp, many, read[:1])
    shared = torch.ones(1, 1, 8, 64, dtype=torch.bool)  # a group's 8 samples on every key
    assert suits(q, kp, shared, read[:1])
    assert not suits(q.double(), kp.double(), mask4, read)
    assert not suits(q.clone().requires_grad_(), kp, mask4, read)  # the trainer
    outside = read.clone()
    outside[1, 3] = kp.shape[0]  # a slot past the pool: SDPA's index_select raises, naming it
    assert not suits(q, kp, mask4, outside)
    monkeypatch.setattr(invariant, "_enabled", True)  # --batch-invariant has its own attention
    assert not suits(q, kp, mask4, read)


def test_switched_off_by_the_environment(tmp_path):
    code = "from trine.engine.model.kernels import paged_attention as p; print(p.available())"
    env = {"TRINE_PAGED_ATTENTION": "0", "TRINE_KERNEL_DIR": str(tmp_path), "PATH": "/usr/bin:/bin"}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False" and not list(tmp_path.iterdir())


def test_without_a_compiler_the_engine_gathers(tmp_path):
    code = (
        "import torch\nfrom trine.engine.model.kernels import paged_attention as p\n"
        "print(p.available(), p.suits(torch.zeros(1, 1, 2, 8), torch.zeros(4, 1, 8), "
        "torch.ones(1, 1, 1, 4, dtype=torch.bool), torch.zeros(1, 4, dtype=torch.long)))"
    )
    env = {"CC": str(tmp_path / "no-such-cc"), "TRINE_KERNEL_DIR": str(tmp_path), "PATH": "/usr/bin:/bin"}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False False"
    assert "gathering the KV instead" in out.stderr


def _decode(model_tok, requests):
    s = Sampler(*model_tok, SamplerConfig(kv_cache_bytes=16 * 2**20))
    return s.run(requests)


def _requests():
    rng = random.Random(0)
    prompts = [[rng.randrange(100, 40000) for _ in range(n)] for n in (40, 17, 70)]
    opts = SamplingOptions(max_tokens=12, temperature=0, stop_at_eos=False)
    w = WeightsIdentity("tiny")
    singles = [SampleRequest(f"s{i}", p, opts, w) for i, p in enumerate(prompts)]
    group = SampleRequest("g", prompts[0], SamplingOptions(max_tokens=12, seed=5, stop_at_eos=False), w, 4)
    return singles + [group]


def logprob_groups(results) -> tuple[dict, list]:
    """A run's logprobs, one list per sequence, as a kind 3 group, and its tokens."""
    seqs = [s for r in results for s in r.sequences]
    return {"logprobs": [s.logprobs for s in seqs]}, [s.tokens for s in seqs]


def test_the_sampler_decodes_the_same_with_and_without_it(tiny_model_dir, monkeypatch):
    """Kind 3, against fp64: decoding over a gathered copy is the reference, the kernel the path
    (the kernel is fp32 only, so the fp64 model gathers on both; its paths agree exactly)."""
    tok = Tokenizer(tiny_model_dir)
    real, in_place = attention.paged_attention, attention.KVContext.in_place

    def compute(m):
        calls = []
        monkeypatch.setattr(attention, "paged_attention", lambda *a: calls.append(1) or real(*a))
        monkeypatch.setattr(attention.KVContext, "in_place", in_place)
        with_kernel, tokens = logprob_groups(_decode((m, tok), _requests()))
        assert bool(calls) == (m.dtype == torch.float32)  # the decode steps read the pool in place
        monkeypatch.setattr(attention.KVContext, "in_place", lambda self, q: False)
        without, same = logprob_groups(_decode((m, tok), _requests()))
        assert same == tokens
        return without, with_kernel, tokens

    assert_same_samples(compute, load_model(tiny_model_dir, "cpu"), fp64_model(tiny_model_dir))


def test_a_causal_prefill_attends_by_query_blocks_that_skip_unseen_keys():
    def blocks(T, cached, rows=1):
        pos = cached + torch.arange(T)
        mask = (torch.arange(cached + T)[None] <= pos[:, None])[None, None].expand(rows, 1, -1, -1)
        kv = attention.KVContext(
            [], [], torch.zeros(rows, T, dtype=torch.long), torch.zeros(rows, cached + T), mask
        )
        return kv.query_blocks()

    assert blocks(200, 0) == [(0, 64, 64), (64, 128, 128), (128, 192, 192), (192, 200, 200)]
    assert blocks(200, 0, rows=3) == blocks(200, 0)
    assert blocks(80, 1136) == [(0, 80, 1216)]  # a chat turn: every block sees nearly every key
    assert blocks(64, 0) == [(0, 64, 64)]
    invariant.enable(True)
    try:
        assert blocks(200, 0) == [(0, 200, 200)]  # its attention tiles the keys itself
    finally:
        invariant.enable(False)


def test_prefill_by_query_blocks_samples_what_one_attention_call_does(tiny_model_dir, monkeypatch):
    """Kind 3, against fp64: one attention call over the chunk is the reference, query blocks the
    path; in fp64 the two agree to FP64_SAME_MATH (a block that missed a key would not)."""
    tok = Tokenizer(tiny_model_dir)
    rng = random.Random(3)
    prompts = [[rng.randrange(100, 40000) for _ in range(n)] for n in (150, 90, 201)]
    opts = SamplingOptions(max_tokens=6, temperature=0, stop_at_eos=False)
    reqs = [SampleRequest(f"r{i}", p, opts, WeightsIdentity("t")) for i, p in enumerate(prompts)]
    split, real, block = [], attention.KVContext.query_blocks, attention.QUERY_BLOCK
    monkeypatch.setattr(
        attention.KVContext, "query_blocks", lambda kv: split.append(len(real(kv)) > 1) or real(kv)
    )

    def compute(m):
        monkeypatch.setattr(attention, "QUERY_BLOCK", block)
        split.clear()
        blocked, tokens = logprob_groups(_decode((m, tok), reqs))
        assert any(split)
        monkeypatch.setattr(attention, "QUERY_BLOCK", 10**6)
        split.clear()
        whole, same = logprob_groups(_decode((m, tok), reqs))
        assert not any(split)
        assert same == tokens
        return whole, blocked, tokens

    assert_same_samples(compute, load_model(tiny_model_dir, "cpu"), fp64_model(tiny_model_dir))
