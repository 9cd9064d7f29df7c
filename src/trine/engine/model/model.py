"""Decoder-only transformers of the Llama / Qwen2 / Qwen3 families, with per-row LoRA (Qwen3.5's
hybrid stack builds on them: qwen3_5.py).

Read top to bottom: config -> RMSNorm -> RoPE -> attention -> MLP -> block -> model. Every linear
layer is a `LoRALinear` (lora.py); each forward takes the `AdapterBatch` of its rows. Attention's
computation, and which of its paths runs, is attention.py's (`attend`); the CPU kernels RMSNorm and
RoPE take in inference are kernels/fused.py's, those RMSNorm and SwiGLU take in training
kernels/fused_train.py's.

Invariants
- Module names mirror Hugging Face's (`model.layers.N.self_attn.q_proj`, `lm_head`, ...), so a
  checkpoint's state dict loads with `load_state_dict` and LoRA targets have PEFT's names.
- One attention interface, `attention.attend`: with a `KVContext` over the paged KV pool, without
  one over the batch itself (causal + padding mask) — the training path. Every reduction goes
  through invariant.py, so a token's hidden state, logits and logprobs
  are bit for bit the same in a decode step, a prefill chunk (cached prefix or not) and the
  training forward, whatever else is in the batch.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from . import invariant
from .attention import KVContext, attend
from .invariant import silu
from .kernels import fused, fused_train
from .lora import AdapterBatch, FusedLinears, LoRALinear


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

    @property
    def rotary_dim(self) -> int:
        """The leading dims of each head RoPE rotates: all of them here (qwen3_5.py: a part)."""
        return self.head_dim

    @property
    def attention_layers(self) -> tuple[int, ...]:
        """The layers that attend over keys and values (each has K/V pools of its own, indexed by
        its ordinal here): all of them (qwen3_5.py: some)."""
        return tuple(range(self.num_layers))

    @classmethod
    def from_hf(cls, cfg: dict) -> "ModelConfig":
        model_type = cfg.get("model_type", "llama")
        if model_type not in ("llama", "qwen2", "qwen3", "mistral"):
            raise ValueError(
                f"model_type {model_type!r} is not supported (llama, qwen2, qwen3, mistral, "
                "gemma3_text, gemma3, olmo3, qwen3_5_text, qwen3_5)"
            )
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
            eos_token_ids=hf_eos_ids(cfg),
        )


def hf_eos_ids(cfg: dict) -> tuple[int, ...]:
    """A config.json's `eos_token_id` (one id, a list, or none) as a tuple."""
    eos = cfg.get("eos_token_id")
    return tuple(eos) if isinstance(eos, list) else ((eos,) if eos is not None else ())


# ----------------------------------------------------------------------------- layers
class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if fused.suits(x, self.weight):  # inference, fp32 or bf16: one pass over the rows (fused.py)
            return fused.rms_norm(x, self.weight, self.eps)
        if x.dtype == self.weight.dtype and fused_train.suits(x, self.weight):  # training: fused_train.py
            return fused_train.rms_norm(x, self.weight, self.eps)
        if x.dtype == self.weight.dtype == torch.float32:
            return F.rms_norm(x, self.weight.shape, self.weight, self.eps)  # bit for bit the steps below
        dtype = x.dtype  # Hugging Face's order: normalise in fp32, round, then scale
        x = invariant.widened(x)
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)


def rope_inv_freq(cfg: ModelConfig) -> torch.Tensor:
    dim = cfg.rotary_dim
    inv = 1.0 / (cfg.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim))
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
        out = attend(q, k, v.transpose(1, 2), mask, kv, layer)
        return self.o_proj(out.transpose(1, 2).reshape(B, T, -1), adapters)


class MLP(nn.Module):
    act = staticmethod(silu)  # the gate's activation (Gemma's: gemma3.py)

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.gate_proj = LoRALinear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.up_proj = LoRALinear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.down_proj = LoRALinear(cfg.intermediate_size, cfg.hidden_size, bias=False)
        self.gate_up = FusedLinears("gate_proj", "up_proj")  # one GEMM for the two

    def forward(self, x, adapters):
        gate, up = self.gate_up(self, x, adapters)
        if self.act is silu and gate.dtype == up.dtype and fused_train.suits(gate, up):  # training
            return self.down_proj(fused_train.swiglu(gate, up), adapters)
        return self.down_proj(self.act(gate) * up, adapters)


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


def padding_mask(pad_mask: torch.Tensor | None) -> torch.Tensor | None:
    """The training forward's attention mask [B, 1, T, T] from `pad_mask` [B, T] (True = real token,
    right padding): causal, padded keys hidden; None when nothing is padded (plain causal)."""
    if pad_mask is None or bool(pad_mask.all()):
        return None
    T = pad_mask.shape[1]
    causal = torch.ones(T, T, dtype=torch.bool, device=pad_mask.device).tril()
    # Padded keys are hidden; padded queries still see key 0 so no row is all -inf.
    return (causal[None] & pad_mask[:, None, :])[:, None]


class Transformer(nn.Module):
    decoder = Decoder  # the layer stack a subclass builds instead (qwen3_5.py)

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.cfg = cfg
        self.source_dir: Path | None = None  # the checkpoint directory load_model read, if any
        self.model = self.decoder(cfg)
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
        mask = padding_mask(pad_mask) if kv is None else None
        for i, layer in enumerate(self.model.layers):
            x = layer(x, cos, sin, adapters, mask, kv, i)
        return self.model.norm(x)

    def logits(self, hidden: torch.Tensor, adapters: AdapterBatch | None = None) -> torch.Tensor:
        return invariant.widened(self.lm_head(hidden, adapters))  # fp32, or an fp64 model's fp64

    def forward(self, tokens, positions=None, adapters=None, pad_mask=None, kv=None, **inputs):
        """Logits [B, T, vocab]; `inputs`: a subclass's own (HybridTransformer's recurrent `state`)."""
        if positions is None:
            positions = torch.arange(tokens.shape[1], device=tokens.device).expand_as(tokens)
        return self.logits(self.hidden_states(tokens, positions, adapters, pad_mask, kv, **inputs), adapters)
