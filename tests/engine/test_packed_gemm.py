"""Few-row inference GEMMs through MKL's packed weights (engine/model/packed.py): the same results as
F.linear, a weight changed in place or replaced is packed again, the memory budget is kept."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from trine.engine.model import packed
from trine.engine.model.invariant import linear
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
    torch.testing.assert_close(got, F.linear(x, m.weight, m.bias), rtol=1e-5, atol=1e-5)


def test_many_rows_and_gradients_stay_on_f_linear():
    m = layer()
    with torch.inference_mode():
        assert not packed.applies(torch.randn(packed.MAX_ROWS + 1, 96), m.weight)
    x = torch.randn(4, 96, requires_grad=True)
    assert not packed.applies(x, m.weight)  # autograd needs F.linear's backward
    m(x).sum().backward()
    torch.testing.assert_close(x.grad, m.weight.sum(0).expand(4, -1))


def test_a_weight_changed_in_place_or_replaced_is_packed_again():
    m = layer(bias=False)
    x = torch.randn(8, 96)
    with torch.no_grad():
        first = m(x)
        m.weight.mul_(2)  # in place: its version counter moves
        torch.testing.assert_close(m(x), 2 * first, rtol=1e-5, atol=1e-5)
        m.weight = torch.nn.Parameter(torch.zeros_like(m.weight), requires_grad=False)
        assert m(x).abs().max() == 0


def test_the_budget_bounds_what_is_packed(monkeypatch):
    monkeypatch.setenv("TRINE_PACKED_GEMM_BYTES", "0")
    m = layer()
    x = torch.randn(8, 96)
    with torch.no_grad():
        torch.testing.assert_close(linear(x, m.weight, m.bias, owner=m), F.linear(x, m.weight, m.bias))
    assert packed._packs[m][2] is None  # refused, and remembered: F.linear from now on


def test_copies_padded_past_max_inflation_are_dropped_and_others_still_packed(monkeypatch):
    monkeypatch.setattr(packed, "MAX_INFLATION", 0.0)
    narrow, wide = layer(), layer(n_out=192)
    x = torch.randn(8, 96)
    with torch.no_grad():
        torch.testing.assert_close(narrow(x), F.linear(x, narrow.weight, narrow.bias))
        assert packed._packs[narrow][2] is None
        monkeypatch.setattr(packed, "MAX_INFLATION", 1e4)
        torch.testing.assert_close(wide(x), F.linear(x, wide.weight, wide.bias), rtol=1e-5, atol=1e-5)
        assert packed._packs[wide][2] is not None  # a refused owner does not block the others


def test_the_sampler_on_packed_weights_samples_as_on_f_linear(tiny_model_dir, monkeypatch):
    from trine.engine.api import SampleRequest, SamplingOptions, WeightsIdentity
    from trine.engine.model.tokenizer import Tokenizer
    from trine.engine.model.weights import load_model
    from trine.engine.sampler.sampler import Sampler

    model, tok = load_model(tiny_model_dir, "cpu"), Tokenizer(tiny_model_dir)
    opts = SamplingOptions(max_tokens=12, temperature=1.0, seed=3, stop_at_eos=False)

    def sample(max_rows: int):
        monkeypatch.setattr(packed, "MAX_ROWS", max_rows)
        reqs = [
            SampleRequest(f"r{i}", list(range(100 + i, 140 + i)), opts, WeightsIdentity("t"), 4)
            for i in range(3)
        ]
        return Sampler(model, tok, kv_cache_bytes=16 << 20).run(reqs)

    rows = packed.MAX_ROWS
    plain, on_packed = sample(0), sample(rows)
    assert sum(p[2] is not None for p in packed._packs.values()) >= 4  # the model's linears took the path
    for a, b in zip(plain, on_packed):
        for sa, sb in zip(a.sequences, b.sequences):
            assert sa.tokens == sb.tokens
            torch.testing.assert_close(sa.logprobs, sb.logprobs, rtol=0, atol=1e-4)
