"""RMSNorm and RoPE of inference forwards in one pass over the rows (model/kernels/fused.py): the torch ops'
results, and used only where no gradient is needed."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F
from tolerance import assert_same_samples, assert_within_bound, fp64_model, rms_norm_bound

from trine.engine.api import SampleRequest, SamplingOptions, WeightsIdentity
from trine.engine.config import SamplerConfig
from trine.engine.model import invariant
from trine.engine.model.kernels import fused
from trine.engine.model.model import apply_rope, rope_tables
from trine.engine.model.tokenizer import Tokenizer
from trine.engine.model.weights import load_model
from trine.engine.sampler.sampler import Sampler

pytestmark = pytest.mark.skipif(not fused._kernel.available(), reason="no C compiler with OpenMP here")


@pytest.fixture
def inference():
    with torch.inference_mode():  # the sampler's forwards
        yield


@pytest.mark.usefixtures("inference")
@pytest.mark.parametrize("rows", [1, 7, 80, 1300])  # one thread, and a parallel loop
def test_rms_norm_is_torchs_up_to_rounding(rows):
    gen = torch.Generator().manual_seed(rows)
    x = torch.randn(rows, 576, generator=gen) * 3
    w = torch.rand(576, generator=gen) + 0.5
    strided = torch.randn(rows, 2, 576, generator=gen)[:, 1]  # rows 1152 floats apart
    for rows_x in (x, strided):
        # kind 2, a priori: the kernel and F.rms_norm sum the 576 squares in orders of their own;
        # each is within `rms_norm_bound` (gamma_579 / 2 + gamma_5, relative) of the exact norm
        exact, bound = rms_norm_bound(rows_x, w, 1e-5)
        assert_within_bound(fused.rms_norm(rows_x, w, 1e-5), exact, bound, "the fused kernel")
        assert_within_bound(F.rms_norm(rows_x, (576,), w, 1e-5), exact, bound, "F.rms_norm")


@pytest.mark.usefixtures("inference")
def test_qwen3_5s_zero_centred_norm_takes_the_kernel_in_fp32_inference(monkeypatch):
    from trine.engine.model.qwen3_5 import ZeroCenteredRMSNorm

    norm = ZeroCenteredRMSNorm(576, 1e-6)
    with torch.no_grad():
        norm.weight.normal_(0, 0.3)
    x = torch.randn(5, 3, 576) * 3
    calls = []
    real = fused.rms_norm
    monkeypatch.setattr(fused, "rms_norm", lambda *a: calls.append(1) or real(*a))
    got = norm(x)
    assert calls == [1] and got.shape == x.shape
    exact, bound = rms_norm_bound(x, 1 + norm.weight, 1e-6)  # kind 2: scaled by 1 + weight
    assert_within_bound(got, exact, bound, "the fused kernel")
    norm(x.double())  # the fp64 twin keeps torch's ops
    assert calls == [1]


@pytest.mark.usefixtures("inference")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("B,T", [(1, 1), (32, 1), (1, 80), (5, 256)])
def test_rope_in_place_is_torchs_bit_for_bit(B, T, dtype):
    H, KVH, D = 9, 3, 64
    gen = torch.Generator().manual_seed(B * T)
    qkv = torch.randn(B, T, (H + 2 * KVH) * D, generator=gen).to(dtype)  # a fused q/k/v GEMM's output
    q, k, _ = qkv.split([H * D, KVH * D, KVH * D], -1)
    q, k = q.view(B, T, H, D), k.view(B, T, KVH, D)
    positions = torch.randint(0, 4000, (B, T), generator=gen)
    inv_freq = 1.0 / (10000 ** (torch.arange(0, D, 2).float() / D))
    cos, sin = rope_tables(positions[..., None].float() * inv_freq, dtype)
    want_q, want_k = apply_rope(q.transpose(1, 2), cos, sin), apply_rope(k.transpose(1, 2), cos, sin)
    assert fused.rope_suits(q, cos, sin) and fused.rope_suits(k, cos, sin)
    # kind 1: the kernel's contract (no sums, no fused multiply-add: the same products and adds,
    # in bf16 each rounded to bf16 as torch's bf16 ops round them)
    assert torch.equal(fused.rope_(q, cos, sin).transpose(1, 2), want_q)
    assert torch.equal(fused.rope_(k, cos, sin).transpose(1, 2), want_k)


@pytest.mark.usefixtures("inference")
@pytest.mark.parametrize("rows", [1, 80, 1300])
def test_bf16_rms_norm_is_the_models_up_to_its_roundings(rows):
    """bf16: normalised in fp32, rounded to bf16, times the bf16 weight, rounded (model.RMSNorm's
    steps). Kind 2: each side's fp32 norm is within `rms_norm_bound` of the exact one, then rounded
    to bf16 twice (2^-8 of it each): the two sides are within twice the sum of those."""
    from trine.engine.model.model import RMSNorm

    gen = torch.Generator().manual_seed(rows)
    x = (torch.randn(rows, 576, generator=gen) * 3).to(torch.bfloat16)
    norm = RMSNorm(576, 1e-5).to(torch.bfloat16)
    with torch.no_grad():
        norm.weight.copy_(torch.rand(576, generator=gen) + 0.5)
    assert fused.suits(x, norm.weight)
    got = norm(x)  # the kernel (inference mode)
    with torch.inference_mode(False), torch.no_grad():
        want = norm(x)  # the torch steps
    exact, bound = rms_norm_bound(x.float(), norm.weight.float(), 1e-5)
    sides = 2 * (bound + 2 * 2**-8 * exact.abs()) * (1 + 2**-7)
    assert_within_bound(got.float(), want.float(), sides, "the bf16 kernel")


@pytest.mark.usefixtures("inference")
def test_the_trainer_and_fixed_numerics_keep_the_torch_ops():
    x = torch.randn(4, 8)
    assert fused.suits(x)
    with torch.inference_mode(False):
        assert not fused.suits(x)  # training, and the trainer's forward-only passes
        with torch.no_grad():
            assert not fused.suits(x)
    assert fused.suits(torch.randn(4, 8, dtype=torch.bfloat16))  # a bf16 engine's sampler
    assert not fused.suits(torch.randn(4, 8, dtype=torch.bfloat16), torch.randn(8))  # mixed dtypes
    assert not fused.suits(torch.randn(4, 8, dtype=torch.float64))
    invariant.enable(True)
    try:
        assert not fused.suits(torch.randn(4, 8))  # batch-invariant mode has its own kernels
    finally:
        invariant.enable(False)
    transposed = torch.randn(2, 9, 5, 64).transpose(1, 2)  # heads not contiguous within a token
    cos = torch.randn(2, 1, 5, 64)
    assert not fused.rope_suits(transposed, cos, cos)


def _run(model_tok) -> tuple[dict, list]:
    """Greedy samples of three prompts: their logprobs (one kind 3 group) and tokens."""
    rng = torch.Generator().manual_seed(0)
    prompts = [torch.randint(100, 4000, (n,), generator=rng).tolist() for n in (40, 17, 70)]
    opts = SamplingOptions(max_tokens=10, temperature=0, stop_at_eos=False)
    reqs = [SampleRequest(f"r{i}", p, opts, WeightsIdentity("t")) for i, p in enumerate(prompts)]
    seqs = [
        s
        for r in Sampler(*model_tok, SamplerConfig(kv_cache_bytes=16 * 2**20)).run(reqs)
        for s in r.sequences
    ]
    return {"logprobs": [s.logprobs for s in seqs]}, [s.tokens for s in seqs]


def test_the_sampler_decodes_the_same_with_and_without_them(tiny_model_dir, monkeypatch):
    """Kind 3, against fp64: the torch ops are the reference, the kernels the path (fp32 only: the
    fp64 model runs the torch ops on both, and its two runs agree exactly)."""
    tok = Tokenizer(tiny_model_dir)
    real, suits = fused.rms_norm, fused.suits

    def compute(model):
        calls = []
        monkeypatch.setattr(fused, "rms_norm", lambda *a: calls.append(1) or real(*a))
        monkeypatch.setattr(fused, "suits", suits)
        with_kernels, tokens = _run((model, tok))
        assert bool(calls) == (model.dtype == torch.float32)  # prefill and decode normed by the kernel
        monkeypatch.setattr(fused, "suits", lambda *t: False)
        without, same = _run((model, tok))
        assert same == tokens
        return without, with_kernels, tokens

    assert_same_samples(compute, load_model(tiny_model_dir, "cpu"), fp64_model(tiny_model_dir))


def test_without_a_compiler_the_torch_ops_run(tmp_path):
    code = "from trine.engine.model.kernels import fused\nprint(fused._kernel.available())"
    env = {"CC": str(tmp_path / "no-such-cc"), "TRINE_KERNEL_DIR": str(tmp_path), "PATH": "/usr/bin:/bin"}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"
    assert "fused_ops.c not built" in out.stderr
