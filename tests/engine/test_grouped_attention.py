"""A prefill's attention over gathered keys with each KV head's query heads stacked as one head
(`attention._grouped_sdpa`): the attention SDPA's `enable_gqa` computes, its masks kept for a forward's
layers only while they are small."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from tolerance import assert_within_bound, attention_bound

from trine.engine.model import attention


def context(P, Q, L, H, KVH, D, slots=4000):
    """Q new queries per row after L - Q cached keys, each row's keys at scattered pool slots."""
    g = torch.Generator().manual_seed(0)
    kp, vp = torch.randn(slots, KVH, D, generator=g), torch.randn(slots, KVH, D, generator=g)
    read = torch.randperm(slots, generator=g)[: P * L].view(P, L)
    pos = (L - Q) + torch.arange(Q)
    mask = (torch.arange(L)[None] <= pos[:, None])[None, None].expand(P, 1, Q, L)
    kv = attention.KVContext([kp], [vp], torch.zeros(P, Q, dtype=torch.long), read, mask)
    return torch.randn(P, H, Q, D, generator=g) * 3, kp, vp, kv


@pytest.mark.parametrize("keep_bytes", [attention.GROUPED_MASK_BYTES, 0])
@pytest.mark.parametrize(
    "P,Q,L,H,KVH,D",
    [
        (1, 65, 1120, 9, 3, 64),  # a chat turn: SmolLM2's heads over a long cached context
        (3, 200, 200, 4, 2, 24),  # a causal chunk of three prompts, by query blocks
        (2, 5, 40, 14, 2, 64),  # seven query heads a KV head (Qwen2's 14 / 2)
    ],
)
def test_stacked_query_heads_attend_as_enable_gqa_does(P, Q, L, H, KVH, D, keep_bytes, monkeypatch):
    monkeypatch.setattr(attention, "GROUPED_MASK_BYTES", keep_bytes)
    q, kp, vp, kv = context(P, Q, L, H, KVH, D)
    with torch.inference_mode():
        got = attention._attend_gathered(q, kp, vp, kv)
        again = attention._attend_gathered(q, kp, vp, kv)  # the next layer: masks kept or built again
    kc = kp[kv.read_slots.reshape(-1)].view(P, L, KVH, D).transpose(1, 2)
    vc = vp[kv.read_slots.reshape(-1)].view(P, L, KVH, D).transpose(1, 2)
    want = F.scaled_dot_product_attention(q, kc, vc, attn_mask=kv.attn_mask, enable_gqa=True)
    # kind 2, a priori: stacking the heads and SDPA's enable_gqa are fp32 attentions summed in
    # orders of their own; each is within `attention_bound` (the scores' gamma_D through the
    # softmax and the V sum, any order) of the exact fp64 attention
    exact, bound = attention_bound(q, kc, vc, kv.attn_mask)
    assert_within_bound(got, exact, bound, "stacked query heads")
    assert_within_bound(want, exact, bound, "enable_gqa")
    assert torch.equal(got, again)  # kind 1: the same call repeated, kept or rebuilt masks alike
    assert bool(kv._grouped_masks) == (keep_bytes > 0)
