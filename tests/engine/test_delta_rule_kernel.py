"""The gated delta rule's decode step in C (kernels/delta_rule.py) against torch's form of the same
step (gated_deltanet._step) and their fp64 twin (kind 3, tests/tolerance.py); the state is updated
where it lies, or left alone when the caller keeps it."""

from __future__ import annotations

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
