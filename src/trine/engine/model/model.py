"""Decoder-only transformers of the Llama / Qwen2 / Qwen3 families, with per-row LoRA.

Read top to bottom: config -> RMSNorm -> RoPE -> attention -> MLP -> block -> model. Every linear
layer is a `LoRALinear` (lora.py); each forward takes the `AdapterBatch` of its rows.

Invariants
- Module names mirror Hugging Face's (`model.layers.N.self_attn.q_proj`, `lm_head`, ...), so a
  checkpoint's state dict loads with `load_state_dict` and LoRA targets have PEFT's names.
- One attention interface, `attention()` (invariant.py, batch-invariant). With a `KVContext` the
  new keys/values are written into the paged KV pool first, then the whole context is gathered
  from it; without one, attention is over the batch itself (causal + padding mask) — the training
  path. Every reduction goes through invariant.py, so a token's hidden state, logits and logprobs
  are bit for bit the same in a decode step, a prefill chunk (cached prefix or not) and the
  training forward, whatever else is in the batch.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from . import fused, invariant
from .invariant import attention, silu
from .lora import AdapterBatch, FusedLinears, LoRALinear
from .paged_attention import paged_attention, suits

QUERY_BLOCK = 64  # queries per SDPA call over gathered keys when blocks skip keys (KVContext.query_blocks)
# A prefill forward's stacked-head attention masks kept for all its layers up to this size (a chat
# turn's: 0.9 MB); a long context's are built in each layer instead (2,048 queries over 32K keys
# with 3 query heads a KV head would be 0.8 GB).
GROUPED_MASK_BYTES = 64 << 20


# ----------------------------------------------------------------------------- config
@dataclass(frozen=True)
class ModelConfig:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: tuple | None = None  # llama3: (factor, low_freq_factor, high_freq_factor, original_max)
    tie_word_embeddings: bool = False
    attention_bias: bool = False  # Qwen2: bias on q/k/v
    qk_norm: bool = False  # Qwen3: RMSNorm on q and k per head
    max_position_embeddings: int = 4096
    model_type: str = "llama"
    eos_token_ids: tuple[int, ...] = ()

    @classmethod
    def from_hf(cls, cfg: dict) -> "ModelConfig":
        model_type = cfg.get("model_type", "llama")
        if model_type not in ("llama", "qwen2", "qwen3", "mistral"):
            raise ValueError(f"model_type {model_type!r} is not supported (llama, qwen2, qwen3)")
        heads = cfg["num_attention_heads"]
        head_dim = cfg.get("head_dim") or cfg["hidden_size"] // heads
        rope = cfg.get("rope_parameters") or cfg.get("rope_scaling") or {}
        theta = rope.get("rope_theta", cfg.get("rope_theta", 10000.0))
        scaling = None
        if rope.get("rope_type", rope.get("type")) == "llama3":
            scaling = (
                rope["factor"],
                rope["low_freq_factor"],
                rope["high_freq_factor"],
                rope["original_max_position_embeddings"],
            )
        eos = cfg.get("eos_token_id")
        eos = tuple(eos) if isinstance(eos, list) else ((eos,) if eos is not None else ())
        return cls(
            vocab_size=cfg["vocab_size"],
            hidden_size=cfg["hidden_size"],
            intermediate_size=cfg["intermediate_size"],
            num_layers=cfg["num_hidden_layers"],
            num_heads=heads,
            num_kv_heads=cfg.get("num_key_value_heads", heads),
            head_dim=head_dim,
            rms_norm_eps=cfg.get("rms_norm_eps", 1e-6),
            rope_theta=float(theta),
            rope_scaling=scaling,
            tie_word_embeddings=cfg.get("tie_word_embeddings", False),
            attention_bias=model_type == "qwen2" or cfg.get("attention_bias", False),
            qk_norm=model_type == "qwen3",
            max_position_embeddings=cfg.get("max_position_embeddings", 4096),
            model_type=model_type,
            eos_token_ids=eos,
        )


# ----------------------------------------------------------------------------- layers
class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype == self.weight.dtype == torch.float32:
            if fused.suits(x, self.weight):  # inference: one pass over the rows (fused.py)
                return fused.rms_norm(x, self.weight, self.eps)
            return F.rms_norm(x, self.weight.shape, self.weight, self.eps)  # bit for bit the steps below
        dtype = x.dtype  # Hugging Face's order: normalise in fp32, round, then scale
        x = invariant.widened(x)
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)


def rope_inv_freq(cfg: ModelConfig) -> torch.Tensor:
    inv = 1.0 / (cfg.rope_theta ** (torch.arange(0, cfg.head_dim, 2, dtype=torch.float64) / cfg.head_dim))
    if cfg.rope_scaling is not None:  # Llama 3.1 frequency-dependent scaling
        factor, low, high, old_ctx = cfg.rope_scaling
        wavelen = 2 * math.pi / inv
        smooth = (old_ctx / wavelen - low) / (high - low)
        scaled = torch.where(wavelen > old_ctx / low, inv / factor, inv)
        mid = (wavelen <= old_ctx / low) & (wavelen >= old_ctx / high)
        inv = torch.where(mid, (1 - smooth) * inv / factor + smooth * inv, scaled)
    return inv.float()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [B, H, T, D]; cos/sin [B, 1, T, D]. Rotate-half convention (Hugging Face's):
    x * cos + cat(-x2, x1) * sin, computed as x * cos + roll(x) * (sin with its first half negated),
    bit for bit the same (a negation is exact) with one op fewer; `rope_tables` negates it."""
    return x * cos + torch.roll(x, x.shape[-1] // 2, dims=-1) * sin


def rope_tables(freqs: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and signed sin [B, 1, T, D] for `apply_rope` from angles [B, T, D/2]."""
    emb = torch.cat((freqs, freqs), dim=-1)[:, None]
    sin = torch.cat((-freqs.sin(), freqs.sin()), dim=-1)[:, None]
    return emb.cos().to(dtype), sin.to(dtype)


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


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.cfg = cfg
        h, kvh, d = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.q_proj = LoRALinear(cfg.hidden_size, h * d, bias=cfg.attention_bias)
        self.k_proj = LoRALinear(cfg.hidden_size, kvh * d, bias=cfg.attention_bias)
        self.v_proj = LoRALinear(cfg.hidden_size, kvh * d, bias=cfg.attention_bias)
        self.o_proj = LoRALinear(h * d, cfg.hidden_size, bias=False)
        if cfg.qk_norm:
            self.q_norm = RMSNorm(d, cfg.rms_norm_eps)
            self.k_norm = RMSNorm(d, cfg.rms_norm_eps)
        self.qkv = FusedLinears("q_proj", "k_proj", "v_proj")  # one GEMM for the three

    def forward(self, x, cos, sin, adapters, mask, kv: KVContext | None, layer: int):
        B, T, _ = x.shape
        cfg = self.cfg
        q, k, v = self.qkv(self, x, adapters)
        q = q.view(B, T, cfg.num_heads, cfg.head_dim)
        k = k.view(B, T, cfg.num_kv_heads, cfg.head_dim)
        v = v.view(B, T, cfg.num_kv_heads, cfg.head_dim)
        if cfg.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        if fused.rope_suits(q, cos, sin) and fused.rope_suits(k, cos, sin):  # inference: in place
            q, k = fused.rope_(q, cos, sin).transpose(1, 2), fused.rope_(k, cos, sin).transpose(1, 2)
        else:
            q, k = apply_rope(q.transpose(1, 2), cos, sin), apply_rope(k.transpose(1, 2), cos, sin)
        v = v.transpose(1, 2)
        if kv is None:
            out = attention(q, k, v, mask, causal=True)
        else:
            kp, vp = kv.k_pool[layer], kv.v_pool[layer]
            kvh, d = cfg.num_kv_heads, cfg.head_dim
            written, slots = kv.writes()
            new_k = k.transpose(1, 2).reshape(B * T, kvh, d)
            new_v = v.transpose(1, 2).reshape(B * T, kvh, d)
            if written is not None:
                new_k, new_v = new_k.index_select(0, written), new_v.index_select(0, written)
            kp.index_copy_(0, slots, new_k.to(kp.dtype))
            vp.index_copy_(0, slots, new_v.to(vp.dtype))
            out = self._paged(q, kp, vp, kv)
        return self.o_proj(out.transpose(1, 2).reshape(B, T, -1), adapters)

    def _paged(self, q, kp, vp, kv: KVContext) -> torch.Tensor:
        """q [B, H, T, D] attends its context in the pools -> [B, H, T, D]; packed rows
        (`kv.query_index`) are gathered from the queries and scattered back."""
        attend = _attend_in_place if kv.in_place(q) else _attend_gathered
        if kv.query_index is None:
            return attend(q, kp, vp, kv)
        B, H, T, d = q.shape
        qi = kv.query_index.reshape(-1)
        real = qi >= 0
        qf = q.transpose(1, 2).reshape(B * T, H, d)
        qp = qf.index_select(0, qi.clamp(min=0)).view(kv.read_slots.shape[0], -1, H, d)
        op = attend(qp.transpose(1, 2), kp, vp, kv).transpose(1, 2)
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
    """`_attend_gathered`'s result, the pools read where they are (paged_attention.py)."""
    return paged_attention(q.transpose(1, 2), kp, vp, kv.read_slots, kv.attn_mask[:, 0]).transpose(1, 2)


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.gate_proj = LoRALinear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.up_proj = LoRALinear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.down_proj = LoRALinear(cfg.intermediate_size, cfg.hidden_size, bias=False)
        self.gate_up = FusedLinears("gate_proj", "up_proj")  # one GEMM for the two

    def forward(self, x, adapters):
        gate, up = self.gate_up(self, x, adapters)
        return self.down_proj(silu(gate) * up, adapters)


class Block(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.self_attn = Attention(cfg)
        self.mlp = MLP(cfg)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, x, cos, sin, adapters, mask, kv, layer):
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, adapters, mask, kv, layer)
        return x + self.mlp(self.post_attention_layernorm(x), adapters)


class Decoder(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(Block(cfg) for _ in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


class Transformer(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.cfg = cfg
        self.source_dir: Path | None = None  # the checkpoint directory load_model read, if any
        self.model = Decoder(cfg)
        self.lm_head = LoRALinear(cfg.hidden_size, cfg.vocab_size, bias=False)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        self.register_buffer("inv_freq", rope_inv_freq(cfg), persistent=False)
        for name, mod in self.named_modules():
            if isinstance(mod, LoRALinear):
                mod.lora_name = name

    @property
    def device(self) -> torch.device:
        return self.model.embed_tokens.weight.device

    @property
    def dtype(self) -> torch.dtype:
        return self.model.embed_tokens.weight.dtype

    def hidden_states(
        self,
        tokens: torch.Tensor,
        positions: torch.Tensor,
        adapters: AdapterBatch | None = None,
        pad_mask: torch.Tensor | None = None,
        kv: KVContext | None = None,
    ) -> torch.Tensor:
        """tokens, positions [B, T] -> final normed hidden states [B, T, hidden].

        Without `kv`: causal attention within each row; `pad_mask` [B, T] (True = real token,
        right padding) hides padded keys. With `kv`: attention over the paged context.
        """
        x = self.model.embed_tokens(tokens)
        angles = positions[..., None].to(invariant.wide_dtype(x.dtype)) * self.inv_freq  # fp32, as HF's
        cos, sin = rope_tables(angles, x.dtype)  # [B, 1, T, D]
        mask = None
        if kv is None and pad_mask is not None and not bool(pad_mask.all()):
            T = tokens.shape[1]
            causal = torch.ones(T, T, dtype=torch.bool, device=tokens.device).tril()
            # Padded keys are hidden; padded queries still see key 0 so no row is all -inf.
            mask = (causal[None] & pad_mask[:, None, :])[:, None]
        for i, layer in enumerate(self.model.layers):
            x = layer(x, cos, sin, adapters, mask, kv, i)
        return self.model.norm(x)

    def logits(self, hidden: torch.Tensor, adapters: AdapterBatch | None = None) -> torch.Tensor:
        return invariant.widened(self.lm_head(hidden, adapters))  # fp32, or an fp64 model's fp64

    def forward(self, tokens, positions=None, adapters=None, pad_mask=None, kv=None):
        if positions is None:
            positions = torch.arange(tokens.shape[1], device=tokens.device).expand_as(tokens)
        return self.logits(self.hidden_states(tokens, positions, adapters, pad_mask, kv), adapters)
