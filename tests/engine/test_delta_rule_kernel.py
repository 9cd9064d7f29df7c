"""The gated delta rule's decode step in C (kernels/delta_rule.py) against torch's form of the same
step (gated_deltanet._step) and their fp64 twin (kind 3, tests/tolerance.py); the state is updated
where it lies, or left alone when the caller keeps it."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from tolerance import Rounding

from trine.engine.model import gated_deltanet as gdn
from trine.engine.model.kernels import delta_rule

pytestmark = pytest.mark.skipif(not delta_rule.built(), reason="no C compiler with OpenMP here")


def inputs(B=3, H=4, dk=16, dv=24, seed=0, dtype=torch.float64):
    """A state and one token's q, k, v, decay, beta, as _prepare and the layer make them."""
    g = torch.Generator().manual_seed(seed)
    s = torch.randn(B, H, dk, dv, generator=g, dtype=dtype)
    q = F.normalize(torch.randn(B, H, dk, generator=g, dtype=dtype), dim=-1) * dk**-0.5
    k = F.normalize(torch.randn(B, H, dk, generator=g, dtype=dtype), dim=-1)
    v = torch.randn(B, H, dv, generator=g, dtype=dtype)
    decay = torch.rand(B, H, generator=g, dtype=dtype)
    beta = torch.rand(B, H, generator=g, dtype=dtype)
    return s, q, k, v, decay, beta


def torch_step(s, *rest):
    """torch's form of the step (the kernel switched off for this call)."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(delta_rule, "suits", lambda s: False)
        return gdn._step(s.clone(), *rest)


@pytest.mark.parametrize("shape", [(3, 4, 16, 24), (2, 16, 128, 128), (1, 1, 7, 5)])
def test_the_kernel_computes_torchs_step_within_fp32_rounding(shape):
    B, H, dk, dv = shape
    x64 = inputs(B, H, dk, dv)
    x32 = [t.float() for t in x64]
    with torch.inference_mode():
        o64, s64 = torch_step(*x64)
        o_ref, s_ref = torch_step(*x32)
        assert delta_rule.suits(x32[0])
        o, s = gdn._step(x32[0].clone(), *x32[1:])
    Rounding({"o": o_ref, "s": s_ref}, {"o": o64, "s": s64}).assert_within({"o": o, "s": s})


def test_in_place_writes_the_new_state_over_the_callers_and_else_leaves_it():
    s, *rest = [t.float() for t in inputs()]
    kept = s.clone()
    with torch.inference_mode():
        _, new = gdn._step(s, *rest)  # the caller keeps s
        assert torch.equal(s, kept) and new.data_ptr() != s.data_ptr()
        _, again = gdn._step(s, *rest, in_place=True)  # the caller gives s up: no copy
        assert again.data_ptr() == s.data_ptr() and torch.equal(again, new)


def test_torchs_form_stays_where_the_kernel_does_not_apply():
    s, *_ = [t.float() for t in inputs()]
    assert not delta_rule.suits(s.double())  # another dtype
    assert not delta_rule.suits(s.transpose(-1, -2))  # not laid out as the kernel reads it
    with torch.enable_grad():
        assert not delta_rule.suits(s)  # training: torch's form, differentiable
    from trine.engine.model import invariant

    invariant.enable(True)
    try:
        assert not delta_rule.suits(s)  # batch-invariant kernels: torch's form
    finally:
        invariant.enable(False)


# ----------------------------------------------------------------------------- the whole layer's step
def layer(hk=2, hv=4, dk=16, dv=24, hidden=40, seed=0):
    """A GatedDeltaNet with every parameter random (A_log and dt_bias too, so the gates vary)."""
    torch.manual_seed(seed)
    shape = gdn.LinearAttentionShape(hk, hv, dk, dv, conv_kernel=4)
    m = gdn.GatedDeltaNet(hidden, shape, eps=1e-6)
    with torch.no_grad():
        for p in m.parameters():
            p.copy_(torch.randn_like(p) * 0.3)
    return m.double()


def layer_inputs(m, B=3, seed=1):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(B, 1, m.in_proj_qkv.in_features, generator=g, dtype=torch.float64)
    state = gdn.LinearState.zeros(m.shape, B, dtype=torch.float64)
    state.conv.normal_(generator=g)
    state.recurrent.normal_(generator=g)
    return x, state


def torch_layer(m, x, state):
    """The layer's torch form (both kernels switched off for this call)."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(delta_rule, "suits", lambda s: False)
        mp.setattr(delta_rule, "layer_suits", lambda *a: False)
        return m(x, None, None, state)


def as32(m, x, state):
    return copy.deepcopy(m).float(), x.float(), gdn.LinearState(state.conv.float(), state.recurrent.float())


@pytest.mark.parametrize("dims", [(2, 4, 16, 24), (1, 1, 7, 5), (4, 4, 32, 32)])
def test_the_layers_step_in_c_computes_its_torch_form_within_fp32_rounding(dims):
    m64 = layer(*dims)
    x64, s64 = layer_inputs(m64)
    m, x, s = as32(m64, x64, s64)
    with torch.inference_mode():
        assert delta_rule.layer_suits(x, s, m)
        want64 = torch_layer(m64, x64, s64)
        want = torch_layer(m, x, s)
        got = m(x, None, None, s)
    names = ("out", "conv", "recurrent")
    pick = lambda r: dict(zip(names, (r[0], r[1].conv, r[1].recurrent)))  # noqa: E731
    Rounding(pick(want), pick(want64)).assert_within(pick(got))


def test_the_layers_step_updates_a_donated_state_in_place_and_else_leaves_it():
    m, x, s = as32(*((lambda m: (m, *layer_inputs(m)))(layer())))
    kept = s.clone()
    with torch.inference_mode():
        out, new = m(x, None, None, s)  # the caller keeps s
        assert torch.equal(s.conv, kept.conv) and torch.equal(s.recurrent, kept.recurrent)
        given = gdn.LinearState(s.conv, s.recurrent, donated=True)
        again, after = m(x, None, None, given)  # the caller gives s up: no copy
    assert after.conv is s.conv and after.recurrent is s.recurrent
    assert torch.equal(again, out)
    assert torch.equal(after.conv, new.conv) and torch.equal(after.recurrent, new.recurrent)


def test_the_layers_step_is_left_to_torch_where_it_does_not_apply():
    m, x, s = as32(*((lambda m: (m, *layer_inputs(m)))(layer())))
    calls = []
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(delta_rule, "layer_step", lambda *a: calls.append(1))
        with torch.inference_mode():
            m(torch.cat([x, x], 1), None, None, s)  # two tokens a row: the chunked rule
            m(x, None, torch.tensor([[True], [False], [True]]), s)  # a padded row
            m(x, None, None, s, cuts=[(0, 1)])  # a snapshot to take
            m.double()(x.double(), None, None, gdn.LinearState(s.conv.double(), s.recurrent.double()))
    assert calls == []
