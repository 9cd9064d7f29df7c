"""RMSNorm and SwiGLU of training forwards with their backward in one pass each
(model/kernels/fused_train.py): torch's results up to rounding, gradients included, and taken only
by the trainer's forwards. Also: a bf16 trainer's attention runs in fp32 (invariant.attention)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from tolerance import assert_within_bound, gamma, rms_norm_bound

from trine.engine.model import invariant
from trine.engine.model.kernels import fused_train
from trine.engine.model.model import MLP, ModelConfig, RMSNorm
from trine.engine.model.qwen3_5 import ZeroCenteredRMSNorm

pytestmark = pytest.mark.skipif(not fused_train.built(), reason="no C compiler with OpenMP here")

U = gamma(1)  # fp32's unit roundoff
BF16_U = 2.0**-8


def _exact_rms_norm_grads(x, w, dy, eps):
    """fp64 autograd's dx and dw of w * x * rsqrt(mean(x^2) + eps)."""
    xd, wd = x.detach().double().requires_grad_(True), w.detach().double().requires_grad_(True)
    F.rms_norm(xd, w.shape, wd, eps).backward(dy.double())
    return xd.grad, wd.grad


def _rms_norm_grad_bounds(x, w, dy, eps):
    """A priori, kind 2: dx = r g - r^3 mean(g x) x with g = dy w. r carries `rms_norm_bound`'s
    relative error, the d-term dot gamma_{d+2}, the products and the subtraction gamma_6: so
    |dx - exact| <= c (r |g| + r^3 mean(|g x|) |x|) with c = 3 (gamma_{d+3} / 2 + gamma_5) +
    gamma_{d+8}. dw = sum over rows of dy x r: gamma_{n+3} of the sum of magnitudes, plus r's error."""
    d, xd, wd, dyd = x.shape[-1], x.double(), w.double(), dy.double()
    r = torch.rsqrt(xd.pow(2).mean(-1, keepdim=True) + eps)
    g = dyd * wd
    r_rel = gamma(d + 3) / 2 + gamma(5)
    c = 3 * r_rel + gamma(d + 8)
    dx = c * (r * g.abs() + r**3 * (g * xd).abs().mean(-1, keepdim=True) * xd.abs())
    rows = dyd.reshape(-1, d).shape[0]
    dw = (gamma(rows + 3) + r_rel) * (dyd * xd * r).abs().reshape(-1, d).sum(0)
    return dx, dw


@pytest.mark.parametrize("rows", [3, 1300])  # one thread, and a parallel loop with per-thread dw
@pytest.mark.parametrize("strided", [False, True])
def test_rms_norm_and_its_gradients_are_exact_up_to_rounding(rows, strided):
    gen = torch.Generator().manual_seed(rows)
    d, eps = 576, 1e-5
    base = torch.randn(rows, 2, d, generator=gen) * 3
    x = (base[:, 1] if strided else base[:, 1].contiguous()).requires_grad_(True)
    w = (torch.rand(d, generator=gen) + 0.5).requires_grad_(True)
    dy = torch.randn(rows, d, generator=gen)
    assert fused_train.suits(x, w)
    y = fused_train.rms_norm(x, w, eps)
    y.backward(dy)
    exact, bound = rms_norm_bound(x.detach(), w.detach(), eps)
    assert_within_bound(y.detach(), exact, bound, "forward")
    dx_exact, dw_exact = _exact_rms_norm_grads(x, w, dy, eps)
    dx_bound, dw_bound = _rms_norm_grad_bounds(x.detach(), w.detach(), dy, eps)
    assert_within_bound(x.grad, dx_exact, dx_bound, "dx")
    assert_within_bound(w.grad, dw_exact, dw_bound, "dw")
    # torch's autograd is within the same bounds (the bounds are not the kernel's alone)
    xt, wt = x.detach().clone().requires_grad_(True), w.detach().clone().requires_grad_(True)
    F.rms_norm(xt, (d,), wt, eps).backward(dy)
    assert_within_bound(xt.grad, dx_exact, dx_bound, "torch's dx")
    assert_within_bound(wt.grad, dw_exact, dw_bound, "torch's dw")


def test_a_frozen_weight_gets_no_gradient_and_x_still_does():
    x = torch.randn(40, 64).requires_grad_(True)
    w = torch.rand(64) + 0.5
    fused_train.rms_norm(x, w, 1e-6).sum().backward()
    assert w.grad is None and x.grad is not None and torch.isfinite(x.grad).all()


def _exact_swiglu(g, u, dh):
    gd, ud = g.detach().double().requires_grad_(True), u.detach().double().requires_grad_(True)
    h = F.silu(gd) * ud
    h.backward(dh.double())
    return h.detach(), gd.grad, ud.grad


def _swiglu_bounds(g, u, dh):
    """A priori, kind 2: exp within 2 ulp, so sigmoid s within 4u relative (and 1 - s within
    4u s + u absolute); h = g s u adds two products: |h - exact| <= 8u |h|. du = dh g s likewise.
    dg = dh u s (1 + g (1 - s)): the bracket within 6u (1 + |g| (1 - s) + |g|) absolute, then three
    products: |dg - exact| <= 16u |dh u| s (1 + |g| (1 - s) + |g|)."""
    gd, ud, dhd = g.double(), u.double(), dh.double()
    s = torch.sigmoid(gd)
    h = gd * s * ud
    dg = 16 * U * (dhd * ud).abs() * s * (1 + gd.abs() * (1 - s) + gd.abs())
    return 8 * U * h.abs(), dg, 8 * U * (dhd * gd * s).abs()


@pytest.mark.parametrize("rows", [2, 700])
def test_swiglu_and_its_gradients_are_exact_up_to_rounding(rows):
    gen = torch.Generator().manual_seed(rows)
    I = 1536
    gate_up = (torch.randn(rows, 2 * I, generator=gen) * 4).requires_grad_(True)  # a fused GEMM's output
    g, u = gate_up.split([I, I], -1)
    g.retain_grad()
    dh = torch.randn(rows, I, generator=gen)
    assert fused_train.suits(g, u)
    h = fused_train.swiglu(g, u)
    h.backward(dh)
    h_exact, dg_exact, du_exact = _exact_swiglu(g, u, dh)
    h_bound, dg_bound, du_bound = _swiglu_bounds(g.detach(), u.detach(), dh)
    assert_within_bound(h.detach(), h_exact, h_bound, "h")
    assert_within_bound(gate_up.grad[:, :I], dg_exact, dg_bound, "dg")
    assert_within_bound(gate_up.grad[:, I:], du_exact, du_bound, "du")


def test_swiglu_saturates_without_nan():
    g = torch.tensor([[-1e4, -100.0, -88.5, 0.0, 88.5, 100.0, 1e4, float("inf"), -float("inf")]])
    g.requires_grad_(True)
    u = torch.ones_like(g).requires_grad_(True)
    h = fused_train.swiglu(g, u)
    h.backward(torch.ones_like(h))
    want = F.silu(g.detach().double())
    finite = torch.isfinite(want)
    assert torch.allclose(h.detach().double()[finite], want[finite], rtol=1e-6, atol=1e-30)
    assert h[0, -2] == float("inf") and not torch.isnan(h[0, :-1]).any()
    assert torch.isfinite(g.grad[0, :7]).all() and torch.isfinite(u.grad[0, :7]).all()


@pytest.mark.parametrize("round_first", [True, False])
def test_bf16_rounds_once_per_output(round_first):
    """bf16 in, bf16 out, fp32 inside: each output within the fp32 kernel's bound plus its bf16
    roundings (the normalised value, when rounded first, then the result) of the exact value on the
    same bf16 inputs; gradients within the fp32 bounds plus one rounding to bf16."""
    gen = torch.Generator().manual_seed(7)
    d = 576
    x = (torch.randn(300, d, generator=gen) * 3).bfloat16().requires_grad_(True)
    w = (torch.rand(d, generator=gen) + 0.5).bfloat16().requires_grad_(True)
    dy = torch.randn(300, d, generator=gen).bfloat16()
    y = fused_train.rms_norm(x, w, 1e-5, round_first)
    y.backward(dy)
    assert y.dtype == x.grad.dtype == w.grad.dtype == torch.bfloat16
    xf, wf, dyf = x.detach().float(), w.detach().float(), dy.float()
    exact, bound = rms_norm_bound(xf, wf, 1e-5)
    roundings = 2 if round_first else 1
    assert_within_bound(y.detach().float(), exact, bound + roundings * BF16_U * exact.abs() * 1.01, "forward")
    dx_exact, dw_exact = _exact_rms_norm_grads(xf, wf, dyf, 1e-5)
    dx_bound, dw_bound = _rms_norm_grad_bounds(xf, wf, dyf, 1e-5)
    assert_within_bound(x.grad.float(), dx_exact, dx_bound + BF16_U * dx_exact.abs() * 1.01, "dx")
    assert_within_bound(w.grad.float(), dw_exact, dw_bound + BF16_U * dw_exact.abs() * 1.01, "dw")


def test_the_models_training_forwards_take_them_and_the_sampler_does_not(monkeypatch):
    cfg = ModelConfig(
        vocab_size=64, hidden_size=32, intermediate_size=48, num_layers=1, num_heads=2,
        num_kv_heads=1, head_dim=16, rms_norm_eps=1e-6, rope_theta=1e4, tie_word_embeddings=True,
    )  # fmt: skip
    norm, zero, mlp = RMSNorm(32, 1e-6), ZeroCenteredRMSNorm(32, 1e-6), MLP(cfg)
    calls = []
    for name in ("rms_norm", "swiglu"):
        real = getattr(fused_train, name)
        monkeypatch.setattr(
            fused_train, name, lambda *a, real=real, name=name, **kw: calls.append(name) or real(*a, **kw)
        )
    x = torch.randn(2, 5, 32)
    norm(x).sum().backward()  # training
    with torch.no_grad():  # the trainer's forward-only passes: the same kernels, the same bits
        zero(x), mlp(x, None)
    assert calls == ["rms_norm", "rms_norm", "swiglu"]
    with torch.inference_mode():  # the sampler
        norm(x), zero(x), mlp(x, None)
    invariant.enable(True)
    try:
        norm(x), mlp(x, None)  # batch-invariant kernels keep their own ops
    finally:
        invariant.enable(False)
    norm.double()(x.double())  # fp64 twins keep torch's ops
    assert calls == ["rms_norm", "rms_norm", "swiglu"]


def test_a_bf16_trainer_attends_in_fp32_and_the_sampler_in_bf16():
    gen = torch.Generator().manual_seed(3)
    q = torch.randn(2, 4, 33, 16, generator=gen).bfloat16()
    k, v = (torch.randn(2, 2, 33, 16, generator=gen).bfloat16() for _ in range(2))
    wide = F.scaled_dot_product_attention(q.float(), k.float(), v.float(), is_causal=True, enable_gqa=True)
    got = invariant.attention(q, k, v, causal=True)
    assert got.dtype == torch.bfloat16 and torch.equal(got, wide.bfloat16())
    with torch.inference_mode():
        narrow = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        assert torch.equal(invariant.attention(q, k, v, causal=True), narrow)
