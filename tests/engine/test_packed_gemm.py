"""Few-row inference GEMMs through MKL's packed weights (engine/model/kernels/packed.py): the same results as
F.linear, a weight changed in place or replaced is packed again, the memory budget is kept."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from tolerance import (
    assert_bitwise,
    assert_same_samples,
    assert_within_bound,
    dot_bound,
    fp64_model,
    linear_bound,
)

from trine.engine.config import SamplerConfig
from trine.engine.model.invariant import linear
from trine.engine.model.kernels import packed
from trine.engine.model.lora import LoRALinear

pytestmark = pytest.mark.skipif(not packed.available(), reason="this torch has no MKL packed linear")


@pytest.fixture(autouse=True)
def pack_small_weights(monkeypatch):
    """MKL pads a small weight's copy to megabytes (over 100x), which the engine drops: pack them here."""
    monkeypatch.setattr(packed, "MAX_INFLATION", 1e4)


def layer(n_in=96, n_out=160, bias=True) -> LoRALinear:
    torch.manual_seed(0)
    return LoRALinear(n_in, n_out, bias=bias).requires_grad_(False)


@pytest.mark.parametrize("rows", [1, 5, 64, packed.MAX_ROWS])
def test_few_rows_take_the_packed_path_and_equal_f_linear(rows):
    m = layer()
    x = torch.randn(2, rows, 96)[:1]  # a batch dim, as the model calls it
    with torch.inference_mode():
        assert packed.applies(x, m.weight)
        got = m(x)
    assert packed._packs[m][2] is not None  # packed for this module
    # kind 2, a priori: MKL's packed kernel and F.linear's sgemm sum each 97-term dot product
    # (the bias one more term) in orders of their own: within 2 gamma_97 sum|x w| of each other
    want = F.linear(x, m.weight, m.bias)
    assert_within_bound(got, want, linear_bound(x, m.weight, m.bias), "packed against F.linear")


def test_many_rows_and_gradients_stay_on_f_linear():
    m = layer()
    with torch.inference_mode():
        assert not packed.applies(torch.randn(packed.MAX_ROWS + 1, 96), m.weight)
    x = torch.randn(4, 96, requires_grad=True)
    assert not packed.applies(x, m.weight)  # autograd needs F.linear's backward
    m(x).sum().backward()
    # kind 2: the gradient of a sum is ones @ W, a 160-term reduction autograd and sum(0) order
    # each their own way: within 2 gamma_160 sum|w| of each other
    want = m.weight.sum(0).expand(4, -1)
    assert_within_bound(x.grad, want, dot_bound(torch.ones(4, 160), m.weight), "F.linear's backward")


def test_a_weight_changed_in_place_or_replaced_is_packed_again():
    m = layer(bias=False)
    x = torch.randn(8, 96)
    with torch.no_grad():
        first = m(x)
        m.weight.mul_(2)  # in place: its version counter moves
        # kind 1: doubling is exact in every product and every partial sum, so the same kernel
        # over the weight packed again gives twice the first result bit for bit (a stale packed
        # copy would give `first` itself)
        assert_bitwise(m(x), 2 * first)
        m.weight = torch.nn.Parameter(torch.zeros_like(m.weight), requires_grad=False)
        assert m(x).abs().max() == 0


def test_the_budget_bounds_what_is_packed(monkeypatch):
    monkeypatch.setenv("TRINE_PACKED_GEMM_BYTES", "0")
    m = layer()
    x = torch.randn(8, 96)
    with torch.no_grad():
        # kind 1: refused, the call is F.linear itself, bit for bit
        assert_bitwise(linear(x, m.weight, m.bias, owner=m), F.linear(x, m.weight, m.bias))
    assert packed._packs[m][2] is None  # refused, and remembered: F.linear from now on


def test_copies_padded_past_max_inflation_are_dropped_and_others_still_packed(monkeypatch):
    monkeypatch.setattr(packed, "MAX_INFLATION", 0.0)
    narrow, wide = layer(), layer(n_out=192)
    x = torch.randn(8, 96)
    with torch.no_grad():
        assert_bitwise(narrow(x), F.linear(x, narrow.weight, narrow.bias))  # kind 1: F.linear itself
        assert packed._packs[narrow][2] is None
        monkeypatch.setattr(packed, "MAX_INFLATION", 1e4)
        want = F.linear(x, wide.weight, wide.bias)  # kind 2: two kernels, each within gamma_97
        assert_within_bound(wide(x), want, linear_bound(x, wide.weight, wide.bias), "packed")
        assert packed._packs[wide][2] is not None  # a refused owner does not block the others


def test_the_sampler_on_packed_weights_samples_as_on_f_linear(tiny_model_dir, monkeypatch):
    """Kind 3, against fp64: the samples drawn over F.linear (the reference) and over packed weights
    (the path) are the same tokens, and the path's logprobs lie within MARGIN x the reference's own
    fp32 rounding of the fp64 model's (where both run F.linear: the packed path is fp32 only)."""
    from trine.engine.api import SampleRequest, SamplingOptions, WeightsIdentity
    from trine.engine.model.tokenizer import Tokenizer
    from trine.engine.model.weights import load_model
    from trine.engine.sampler.sampler import Sampler

    tok = Tokenizer(tiny_model_dir)
    opts = SamplingOptions(max_tokens=12, temperature=1.0, seed=3, stop_at_eos=False)

    def sample(model, max_rows: int):
        monkeypatch.setattr(packed, "MAX_ROWS", max_rows)
        reqs = [
            SampleRequest(f"r{i}", list(range(100 + i, 140 + i)), opts, WeightsIdentity("t"), 4)
            for i in range(3)
        ]
        return [
            s
            for r in Sampler(model, tok, SamplerConfig(kv_cache_bytes=16 << 20)).run(reqs)
            for s in r.sequences
        ]

    rows = packed.MAX_ROWS

    def compute(model):
        plain, on_packed = sample(model, 0), sample(model, rows)
        if model.dtype == torch.float32:  # the model's linears took the path
            assert sum(p[2] is not None for p in packed._packs.values()) >= 4
        assert [s.tokens for s in plain] == [s.tokens for s in on_packed]
        lps = lambda seqs: {"logprobs": [s.logprobs for s in seqs]}  # noqa: E731
        return lps(plain), lps(on_packed), [s.tokens for s in plain]

    assert_same_samples(compute, load_model(tiny_model_dir, "cpu"), fp64_model(tiny_model_dir))
