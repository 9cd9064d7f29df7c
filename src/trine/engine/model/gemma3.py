"""Gemma 3's text model: windowed (local) and global attention layers (sliding_window.py).

Read top to bottom: config -> the GELU-tanh MLP -> attention -> block -> model. Gemma 3 differs from
model.py's Llama stack in:
- the embedding's output times sqrt(hidden_size), rounded to the model's dtype (as transformers');
- RMSNorms scaled by 1 + weight (qwen3_5.py's `ZeroCenteredRMSNorm`), four per layer: before and
  after the attention, before and after the MLP, each after-norm applied to its sublayer's output
  before the residual add;
- q/k norms per head, and scores scaled by `query_pre_attn_scalar` ** -0.5 instead of
  head_dim ** -0.5 (folded into the query norm);
- a GELU (tanh approximation) gate;
- local layers (`sliding_attention`: a window of `sliding_window` keys, RoPE theta
  `rope_local_base_freq`) and global ones (every sixth by default, their own RoPE).

A `gemma3` (multimodal) checkpoint's language model loads too: its `text_config`, and its
`model.language_model.*` weights without the vision tower and projector (weights.py).

Invariants: module names mirror transformers' `Gemma3ForCausalLM`, so its checkpoints load with
`load_state_dict` and LoRA targets have PEFT's names; the forward computes the reference's math
within fp32 rounding.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from . import invariant
from .model import MLP, Attention
from .qwen3_5 import ZeroCenteredRMSNorm
from .sliding_window import WindowedConfig, WindowedTransformer

FAMILIES = ("gemma3_text", "gemma3")  # a `gemma3` checkpoint: its `text_config`, no vision tower


# ----------------------------------------------------------------------------- config
@dataclass(frozen=True)
class Gemma3Config(WindowedConfig):
    query_pre_attn_scalar: float = 256.0

    @classmethod
    def from_hf(cls, cfg: dict) -> Gemma3Config:
        if cfg.get("model_type") == "gemma3":
            cfg = {"tie_word_embeddings": cfg.get("tie_word_embeddings", True), **cfg["text_config"]}
        for field in ("attn_logit_softcapping", "final_logit_softcapping"):
            if cfg.get(field) is not None:
                raise ValueError(
                    f"{field} {cfg[field]!r}: Gemma 2's soft-capping is not supported (Gemma 3 has none)"
                )
        if cfg.get("use_bidirectional_attention"):
            raise ValueError("use_bidirectional_attention: only causal Gemma 3 models are supported")
        act = cfg.get("hidden_activation") or cfg.get("hidden_act") or "gelu_pytorch_tanh"
        if act != "gelu_pytorch_tanh":
            raise ValueError(f"hidden_activation {act!r}: Gemma 3's is gelu_pytorch_tanh")
        pattern = cfg.get("sliding_window_pattern", cfg.get("_sliding_window_pattern", 6))
        fields = cls.hf_fields(
            cfg,
            pattern=pattern,
            local_theta=10_000.0,
            global_theta=1_000_000.0,
            max_positions=131_072,
            eps=1e-6,
            tie=True,
        )
        return cls(
            **fields,
            model_type="gemma3_text",
            embed_scale=math.sqrt(cfg["hidden_size"]),
            query_pre_attn_scalar=float(cfg.get("query_pre_attn_scalar", 256)),
        )


# ----------------------------------------------------------------------------- layers
def gelu_tanh(x: torch.Tensor) -> torch.Tensor:
    """GELU, tanh approximation: 0.5 x (1 + tanh(u)) = x / (1 + exp(-2u)), u = sqrt(2/pi) (x +
    0.044715 x^3); the second form in batch-invariant mode (as invariant.py's `silu`: the fused
    kernel's scalar tail rounds its last bit by the element's offset)."""
    if not invariant.enabled():
        return F.gelu(x, approximate="tanh")
    u = math.sqrt(2 / math.pi) * (x + 0.044715 * x * x * x)
    return x / (1 + torch.exp(-2 * u))


class GeluMLP(MLP):
    act = staticmethod(gelu_tanh)


class QueryNorm(ZeroCenteredRMSNorm):
    """Gemma's q norm, its output times sqrt(head_dim / query_pre_attn_scalar): attention divides
    scores by sqrt(head_dim) (attention.py), Gemma by sqrt(query_pre_attn_scalar)."""

    def __init__(self, dim: int, eps: float, query_pre_attn_scalar: float):
        super().__init__(dim, eps)
        self.scale = math.sqrt(dim / query_pre_attn_scalar)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = super().forward(x)
        return out if self.scale == 1.0 else out * self.scale


def gemma_attention(cfg: Gemma3Config) -> Attention:
    """model.py's attention with Gemma's q/k norms (1 + weight; the q norm carries the scale)."""
    attn = Attention(cfg)
    attn.q_norm = QueryNorm(cfg.head_dim, cfg.rms_norm_eps, cfg.query_pre_attn_scalar)
    attn.k_norm = ZeroCenteredRMSNorm(cfg.head_dim, cfg.rms_norm_eps)
    return attn


class Gemma3Block(nn.Module):
    def __init__(self, cfg: Gemma3Config):
        super().__init__()
        self.self_attn = gemma_attention(cfg)
        self.mlp = GeluMLP(cfg)
        h, eps = cfg.hidden_size, cfg.rms_norm_eps
        self.input_layernorm = ZeroCenteredRMSNorm(h, eps)
        self.post_attention_layernorm = ZeroCenteredRMSNorm(h, eps)
        self.pre_feedforward_layernorm = ZeroCenteredRMSNorm(h, eps)
        self.post_feedforward_layernorm = ZeroCenteredRMSNorm(h, eps)

    def forward(self, x, cos, sin, adapters, mask, kv, layer):
        h = self.self_attn(self.input_layernorm(x), cos, sin, adapters, mask, kv, layer)
        x = x + self.post_attention_layernorm(h)
        h = self.mlp(self.pre_feedforward_layernorm(x), adapters)
        return x + self.post_feedforward_layernorm(h)


class Gemma3Decoder(nn.Module):
    def __init__(self, cfg: Gemma3Config):
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(Gemma3Block(cfg) for _ in range(cfg.num_layers))
        self.norm = ZeroCenteredRMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


class Gemma3Transformer(WindowedTransformer):
    decoder = Gemma3Decoder
