"""Attention of the transformer's layers, and the choice of its path: one call, `attend`.

Paths (the first that applies):
- Training (no `KVContext`): over the batch itself, causal, with the padding mask: invariant.py's
  `attention` (batch-invariant when enabled, else SDPA).
- Inference over the paged KV pool (a `KVContext`): the new keys/values are written into the pool
  first, then the queries attend their whole context:
  - in place, by the C kernel (kernels/paged_attention.py), for CPU fp32 decode-sized attention
    (`KVContext.in_place`, decided once per forward);
  - else over keys gathered out of the pool, by SDPA, in blocks of queries over the keys each block
    sees (`KVContext.query_blocks`), the query heads of a key/value head stacked as one on CPU
    (`_grouped_sdpa`) unless torch's batch-invariant mode is on.

Invariants
- Every path is softmax(q k^T / sqrt(D)) v over the keys the mask allows, up to float32 rounding
  (the paths sum in orders of their own, so the last bits may follow the path and the batch).
- With batch-invariant kernels (which turn the in-place kernel, the query blocks and the stacked
  heads off), a token's result is bit for bit the same in a decode step, a prefill chunk and the
  training forward, whatever else is in the batch.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from . import invariant
from .invariant import attention
from .kernels.paged_attention import paged_attention, suits

QUERY_BLOCK = 64  # queries per SDPA call over gathered keys when blocks skip keys (KVContext.query_blocks)
# A prefill forward's stacked-head attention masks kept for all its layers up to this size (a chat
# turn's: 0.9 MB); a long context's are built in each layer instead (2,048 queries over 32K keys
# with 3 query heads a KV head would be 0.8 GB).
GROUPED_MASK_BYTES = 64 << 20


@dataclass
class KVContext:
    """Paged KV for one forward. Slots index a flat pool of `num_blocks * block_size` positions.

    write_slots [B, T]: where each new token's K/V goes (-1: padding, not written).
    read_slots [B, L]: the slots of every key a row attends to, in position order (padding: any slot).
    attn_mask [B, 1, T, L] bool: True where query t may attend key l.

    Packed attention (optional): `query_index` [P, Q] holds flat query indices `b * T + t` (-1:
    padding); attention then runs over P packed rows of Q queries each, and `read_slots` [P, L] /
    `attn_mask` [P, 1, Q, L] describe those rows. Sequences sharing a prefix (samples of one prompt)
    go in one packed row, so the shared keys are gathered once, not once per sequence. Every
    query, padding included, must be allowed at least one key.
    """

    k_pool: list[torch.Tensor]  # per layer [slots, kv_heads, head_dim]
    v_pool: list[torch.Tensor]
    write_slots: torch.Tensor
    read_slots: torch.Tensor
    attn_mask: torch.Tensor
    query_index: torch.Tensor | None = None
    _writes: tuple | None = field(default=None, init=False, repr=False)
    _in_place: bool | None = field(default=None, init=False, repr=False)
    _query_blocks: list | None = field(default=None, init=False, repr=False)
    _grouped_masks: dict = field(default_factory=dict, init=False, repr=False)

    def writes(self) -> tuple[torch.Tensor | None, torch.Tensor]:
        """(flat token rows to write or None for all of them, their slots): found once per forward,
        not once per layer."""
        if self._writes is None:
            flat = self.write_slots.reshape(-1)
            valid = flat >= 0
            self._writes = (None, flat) if bool(valid.all()) else (valid.nonzero().squeeze(1), flat[valid])
        return self._writes

    def in_place(self, q: torch.Tensor) -> bool:
        """Whether attention reads the pools in place (`paged_attention.suits`), decided once per
        forward."""
        if self._in_place is None:
            self._in_place = suits(q, self.k_pool[0], self.attn_mask, self.read_slots)
        return self._in_place

    def query_blocks(self) -> list[tuple[int, int, int]]:
        """(first query, end, keys any of them sees) per block of `QUERY_BLOCK` queries, for
        attention over gathered keys: a causal prefill chunk's early queries see few keys, and
        SDPA over a mask computes every key of it (docs/serving.md, "Where the engine's constants
        come from"). One block of every query unless that saves a fifth of the scores, or with
        torch's batch-invariant mode (its attention tiles keys itself)."""
        if self._query_blocks is None:
            mask = self.attn_mask  # [rows, 1, T, L]
            T, L = mask.shape[2], mask.shape[3]
            self._query_blocks = [(0, T, L)]
            if T > QUERY_BLOCK and not invariant.enabled():
                seen = torch.arange(1, L + 1, device=mask.device) * mask.any(0)[0]
                reach = seen.amax(-1).tolist()  # per query: 1 + the last key any row lets it see
                blocks = [(a, min(a + QUERY_BLOCK, T)) for a in range(0, T, QUERY_BLOCK)]
                blocks = [(a, e, max(1, *reach[a:e])) for a, e in blocks]
                if sum((e - a) * keys for a, e, keys in blocks) <= 0.8 * T * L:
                    self._query_blocks = blocks
        return self._query_blocks

    def grouped_mask(self, block: int, groups: int, dtype: torch.dtype) -> torch.Tensor:
        """Query block `block`'s (`query_blocks`) mask for `_grouped_sdpa`: additive (0 or -inf, in
        `dtype`), each query's row repeated once per query head of a key/value head, [rows, 1,
        groups * queries, keys]. Kept for the forward's other layers (SDPA converts a boolean mask
        on every call) while all blocks' masks together take at most `GROUPED_MASK_BYTES`; a
        longer context's are built again in each layer."""
        key = (block, groups, dtype)
        if key in self._grouped_masks:
            return self._grouped_masks[key]
        m, blocks = self.attn_mask, self.query_blocks()
        a, e, n = blocks[block]
        out = torch.zeros(m[:, :, a:e, :n].shape, dtype=dtype, device=m.device)
        out = out.masked_fill_(~m[:, :, a:e, :n], float("-inf")).repeat(1, 1, groups, 1)
        size = m.shape[0] * groups * sum((e - a) * n for a, e, n in blocks) * out.element_size()
        if size <= GROUPED_MASK_BYTES:
            self._grouped_masks[key] = out
        return out


def attend(q, k, v, mask, kv: KVContext | None, layer: int) -> torch.Tensor:
    """q [B, H, T, D] and this layer's new k, v [B, KVH, T, D] -> [B, H, T, D]. Without `kv`: over
    the batch itself (causal; `mask` [B, 1, T, T] hides padded keys, or None). With `kv`: k and v
    are written into layer `layer`'s pools at `kv.write_slots`, then q attends its context there."""
    if kv is None:
        return attention(q, k, v, mask, causal=True)
    B, kvh, T, d = k.shape
    kp, vp = kv.k_pool[layer], kv.v_pool[layer]
    written, slots = kv.writes()
    new_k = k.transpose(1, 2).reshape(B * T, kvh, d)
    new_v = v.transpose(1, 2).reshape(B * T, kvh, d)
    if written is not None:
        new_k, new_v = new_k.index_select(0, written), new_v.index_select(0, written)
    kp.index_copy_(0, slots, new_k.to(kp.dtype))
    vp.index_copy_(0, slots, new_v.to(vp.dtype))
    return _paged(q, kp, vp, kv)


def _paged(q, kp, vp, kv: KVContext) -> torch.Tensor:
    """q [B, H, T, D] attends its context in the pools -> [B, H, T, D], by the path `kv.in_place`
    chose; packed rows (`kv.query_index`) are gathered from the queries and scattered back."""
    path = _attend_in_place if kv.in_place(q) else _attend_gathered
    if kv.query_index is None:
        return path(q, kp, vp, kv)
    B, H, T, d = q.shape
    qi = kv.query_index.reshape(-1)
    real = qi >= 0
    qf = q.transpose(1, 2).reshape(B * T, H, d)
    qp = qf.index_select(0, qi.clamp(min=0)).view(kv.read_slots.shape[0], -1, H, d)
    op = path(qp.transpose(1, 2), kp, vp, kv).transpose(1, 2)
    out = torch.zeros_like(qf).index_copy_(0, qi[real], op.reshape(-1, H, d)[real])
    return out.view(B, T, H, d).transpose(1, 2)


def _attend_gathered(q, kp, vp, kv: KVContext) -> torch.Tensor:
    """q [rows, H, Q, D] over its keys copied out of the pools, by SDPA -> [rows, H, Q, D]."""
    rows, L = kv.read_slots.shape
    kvh, d = kp.shape[1], kp.shape[2]
    read = kv.read_slots.reshape(-1)  # index_select copies whole [kvh, d] rows: fast
    kc = kp.index_select(0, read).view(rows, L, kvh, d).transpose(1, 2).to(q.dtype)
    vc = vp.index_select(0, read).view(rows, L, kvh, d).transpose(1, 2).to(q.dtype)
    m, blocks = kv.attn_mask, kv.query_blocks()
    groups = q.shape[1] // kvh
    if groups > 1 and q.device.type == "cpu" and not invariant.enabled():
        outs = [
            _grouped_sdpa(q[:, :, a:e], kc[:, :, :n], vc[:, :, :n], kv.grouped_mask(i, groups, q.dtype))
            for i, (a, e, n) in enumerate(blocks)
        ]
    else:
        outs = [attention(q[:, :, a:e], kc[:, :, :n], vc[:, :, :n], m[:, :, a:e, :n]) for a, e, n in blocks]
    return outs[0] if len(outs) == 1 else torch.cat(outs, 2)


def _grouped_sdpa(q, k, v, mask) -> torch.Tensor:
    """SDPA of q [rows, H, Q, D] over k/v [rows, KVH, L, D], the query heads that share a key/value
    head stacked as one head of `H // KVH * Q` queries (`mask` from `KVContext.grouped_mask`).
    The same attention as `enable_gqa`, in fewer, larger blocks: CPU flash attention splits work
    by (row, head, block of queries), so 9 heads of 65 chat-turn queries over 1,120 keys run as 27
    tasks with a one-query tail each; stacked as 3 heads of 195 queries they run as fewer, fuller
    tasks (docs/serving.md, "Where the engine's constants come from")."""
    rows, H, Q, D = q.shape
    out = F.scaled_dot_product_attention(q.reshape(rows, k.shape[1], -1, D), k, v, attn_mask=mask)
    return out.view(rows, H, Q, D)


def _attend_in_place(q, kp, vp, kv: KVContext) -> torch.Tensor:
    """`_attend_gathered`'s result, the pools read where they are (kernels/paged_attention.py)."""
    return paged_attention(q.transpose(1, 2), kp, vp, kv.read_slots, kv.attn_mask[:, 0]).transpose(1, 2)
