"""OLMo 3's text model: windowed and global attention layers (sliding_window.py) with post-norms.

Read top to bottom: config -> the q/k norm -> block -> model. OLMo 3 differs from model.py's Llama
stack in:
- no norm before a sublayer: each sublayer's output is normed (`post_attention_layernorm`,
  `post_feedforward_layernorm`) before the residual add;
- q and k normed over the whole projection (all heads together), before RoPE;
- windowed layers (`sliding_attention`, a window of `sliding_window` keys) and global ones (every
  fourth by default), each kind with its own RoPE (the global one YaRN-scaled in the long-context
  checkpoints).

Invariants: module names mirror transformers' `Olmo3ForCausalLM`, so its checkpoints load with
`load_state_dict` and LoRA targets have PEFT's names; the forward computes the reference's math
within fp32 rounding.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from .model import MLP, Attention, RMSNorm
from .sliding_window import WindowedConfig, WindowedTransformer

FAMILIES = ("olmo3",)


# ----------------------------------------------------------------------------- config
@dataclass(frozen=True)
class Olmo3Config(WindowedConfig):
    @classmethod
    def from_hf(cls, cfg: dict) -> Olmo3Config:
        act = cfg.get("hidden_act", "silu")
        if act != "silu":
            raise ValueError(f"hidden_act {act!r}: OLMo 3's is silu")
        fields = cls.hf_fields(
            cfg,
            pattern=4,
            local_theta=None,
            global_theta=500_000.0,
            max_positions=2048,
            eps=1e-5,
            tie=False,
        )
        return cls(**fields, model_type="olmo3")


# ----------------------------------------------------------------------------- layers
class ProjectionNorm(RMSNorm):
    """RMSNorm over all heads of a projection [B, T, heads, head_dim] together (weight: heads x
    head_dim), as OLMo's q/k norms run before the heads are split."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(x.flatten(-2)).view(x.shape)


def olmo_attention(cfg: Olmo3Config) -> Attention:
    """model.py's attention with OLMo's q/k norms over the whole projection."""
    attn = Attention(cfg)
    attn.q_norm = ProjectionNorm(cfg.num_heads * cfg.head_dim, cfg.rms_norm_eps)
    attn.k_norm = ProjectionNorm(cfg.num_kv_heads * cfg.head_dim, cfg.rms_norm_eps)
    return attn


class Olmo3Block(nn.Module):
    def __init__(self, cfg: Olmo3Config):
        super().__init__()
        self.self_attn = olmo_attention(cfg)
        self.mlp = MLP(cfg)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_feedforward_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, x, cos, sin, adapters, mask, kv, layer):
        x = x + self.post_attention_layernorm(self.self_attn(x, cos, sin, adapters, mask, kv, layer))
        return x + self.post_feedforward_layernorm(self.mlp(x, adapters))


class Olmo3Decoder(nn.Module):
    def __init__(self, cfg: Olmo3Config):
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(Olmo3Block(cfg) for _ in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


class Olmo3Transformer(WindowedTransformer):
    decoder = Olmo3Decoder
