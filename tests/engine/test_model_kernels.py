"""The model's fast paths compute what the plain ones do: fused q/k/v and gate/up GEMMs
(`FusedLinears`), the fused fp32 RMSNorm and the one-op-fewer RoPE."""

from __future__ import annotations

import pytest
import torch
from conftest import FAMILIES
from tolerance import assert_bitwise, assert_same_computation, fp64_model

from trine.engine.api import LoRAConfig
from trine.engine.model import lora as lora_mod
from trine.engine.model.kernels import fused_train
from trine.engine.model.lora import Adapter, AdapterBatch
from trine.engine.model.model import RMSNorm, apply_rope, rope_tables
from trine.engine.model.weights import load_model

FUSED_CALL = lora_mod.FusedLinears.__call__


def unfused(monkeypatch, on: bool = True):
    """Run FusedLinears member by member, as the model did before fusing (`on`; else fused again)."""

    def call(self, owner, x, adapters):
        return [getattr(owner, n)(x, adapters) for n in self.names]

    monkeypatch.setattr(lora_mod.FusedLinears, "__call__", call if on else FUSED_CALL)


def adapter_for(model) -> Adapter:
    a = Adapter(model, LoRAConfig(rank=4, train_mlp=True, train_attn=True))
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for p in a.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.05)
    return a


@pytest.mark.parametrize("family", FAMILIES)
def test_fused_projections_share_storage_and_give_the_unfused_logits(tiny_model_dirs, family, monkeypatch):
    """Kind 3, against fp64: the unfused GEMMs are the reference, the fused ones the path (the
    same dot products, in a wider GEMM's order)."""
    tokens = torch.randint(0, 1000, (3, 9), generator=torch.Generator().manual_seed(0))

    def compute(model):
        unfused(monkeypatch, False)
        attn = model.model.layers[0].self_attn
        adapter = adapter_for(model)
        rows = AdapterBatch.from_rows([adapter, None, adapter])
        with torch.no_grad():
            fused = model(tokens, adapters=rows)
        # one storage, laid out q, k, v: the model holds each weight once
        q, k, v = attn.q_proj.weight, attn.k_proj.weight, attn.v_proj.weight
        assert (
            q.untyped_storage().data_ptr() == k.untyped_storage().data_ptr() == v.untyped_storage().data_ptr()
        )
        assert k.storage_offset() == q.numel() and v.storage_offset() == q.numel() + k.numel()
        unfused(monkeypatch)
        with torch.no_grad():
            plain = model(tokens, adapters=rows)
        return {"logits": plain}, {"logits": fused}

    d = tiny_model_dirs[family]
    assert_same_computation(compute, load_model(d, device="cpu"), fp64_model(d))


def test_a_moved_model_is_fused_again_and_state_dict_loads_keep_the_views(tiny_model_dirs):
    model = load_model(tiny_model_dirs["llama"], device="cpu")
    tokens = torch.tensor([[5, 6, 7, 8]])
    with torch.no_grad():
        before = model(tokens)
    model = model.to(torch.float64).to(torch.float32)  # new storage per parameter
    attn = model.model.layers[0].self_attn
    assert attn.q_proj.weight.untyped_storage().data_ptr() != attn.k_proj.weight.untyped_storage().data_ptr()
    with torch.no_grad():
        assert_bitwise(model(tokens), before)  # kind 1: the same weights, fused the same way
    ptr = attn.q_proj.weight.untyped_storage().data_ptr()
    assert attn.k_proj.weight.untyped_storage().data_ptr() == ptr  # fused again by the forward
    model.load_state_dict(model.state_dict())  # copies into the views: still one storage
    assert attn.v_proj.weight.untyped_storage().data_ptr() == ptr


def test_training_through_fused_projections_gives_the_unfused_gradients(tiny_model_dirs, monkeypatch):
    """Kind 3, against fp64: the unfused model's LoRA gradients are the reference, the fused
    model's the path; a training step is many reductions deep, so no a priori bound."""
    d = tiny_model_dirs["qwen2"]  # biases on q/k/v
    tokens = torch.randint(0, 1000, (2, 7), generator=torch.Generator().manual_seed(2))

    def grads(model):
        adapter = adapter_for(model)
        model(tokens, adapters=AdapterBatch.single(adapter)).logsumexp(-1).sum().backward()
        return {n: p.grad.clone() for n, p in adapter.named_parameters()}

    def compute(model):
        unfused(monkeypatch, False)
        fused = grads(model)
        unfused(monkeypatch)
        plain = grads(model)
        assert fused.keys() == plain.keys()
        return {"grads": plain}, {"grads": fused}

    assert_same_computation(compute, load_model(d, device="cpu"), fp64_model(d))


def test_base_weights_that_require_grad_are_not_fused(tiny_model_dirs):
    model = load_model(tiny_model_dirs["llama"], device="cpu")
    model.model.layers[0].mlp.gate_proj.weight.requires_grad_(True)
    loss = model(torch.tensor([[5, 6, 7]])).sum()
    loss.backward()
    assert model.model.layers[0].mlp.gate_proj.weight.grad is not None


@pytest.mark.parametrize("dim", [7, 64, 576, 577])
def test_fp32_rms_norm_is_bit_for_bit_the_normalise_then_scale_steps(dim, monkeypatch):
    norm = RMSNorm(dim, 1e-5)
    with torch.no_grad():
        norm.weight.copy_(torch.randn(dim))
    x = torch.randn(5, 3, dim) * 3
    fused_rows = norm(x)  # the trainer's C kernel (fused_train.py), where it is built
    assert_bitwise(norm(x[:1]), fused_rows[:1])  # a row's result does not depend on the others
    monkeypatch.setattr(fused_train, "suits", lambda *t: False)  # torch's ops (CUDA, fp64, no compiler)
    steps = norm.weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-5))
    # kind 1: F.rms_norm's CPU kernel is these steps, op for op (the model relies on it: RMSNorm's
    # fp32 path calls F.rms_norm and the bf16 path these steps)
    assert_bitwise(norm(x), steps)
    assert_bitwise(norm(x[:1]), norm(x)[:1])


def test_rope_is_bit_for_bit_the_rotate_half_formula():
    x, freqs = torch.randn(2, 3, 5, 8), torch.randn(2, 5, 4)
    cos, sin = rope_tables(freqs, torch.float32)
    emb = torch.cat((freqs, freqs), -1)[:, None]
    rotate_half = torch.cat((-x[..., 4:], x[..., :4]), -1)
    # kind 1: a negation and a roll are exact, so the one-op-fewer formula rounds as rotate-half does
    assert_bitwise(apply_rope(x, cos, sin), x * emb.cos() + rotate_half * emb.sin())
