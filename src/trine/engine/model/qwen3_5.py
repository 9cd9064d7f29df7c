"""Qwen3.5's hybrid text model: Gated DeltaNet layers (gated_deltanet.py) and gated full attention.

Read top to bottom: config -> the zero-centred RMSNorm -> gated attention -> block -> model.
`layer_types` says each layer's kind: `linear_attention` (Gated DeltaNet, module `linear_attn`) or
`full_attention` (module `self_attn`: q/k norms, RoPE on the first `partial_rotary_factor` of each
head's dims, the attention output times sigmoid of a gate that `q_proj` computes beside the
queries). Both kinds share model.py's MLP, embedding, LM head and `attend`.

Invariants
- Module names mirror Hugging Face's `Qwen3_5ForCausalLM`, so its checkpoint loads with
  `load_state_dict` and LoRA targets have PEFT's names (model.py's contract).
- The forward computes the reference's math within fp32 rounding; an fp64 model stays fp64.
- State: with a `KVContext`, the attention layers use the pools of their ordinal among attention
  layers (`HybridConfig.attention_layers`), and the linear layers read and replace
  `state.layers[j]` (j their ordinal among linear layers): a `HybridState` holds every sequence's
  recurrent state. Without one the forward is the training path: each row from the zero state.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn

from . import invariant
from .attention import KVContext, attend
from .gated_deltanet import Cuts, GatedDeltaNet, LinearAttentionShape, LinearState
from .kernels import fused, fused_train
from .lora import AdapterBatch, FusedLinears, LoRALinear
from .model import MLP, ModelConfig, Transformer, apply_rope, hf_eos_ids, padding_mask, rope_tables

FAMILIES = ("qwen3_5_text", "qwen3_5")  # a `qwen3_5` checkpoint: its `text_config`, no vision tower
LINEAR, FULL = "linear_attention", "full_attention"
MROPE_SECTION = (11, 11, 10)  # transformers' default when rope_parameters names none


# ----------------------------------------------------------------------------- config
@dataclass(frozen=True)
class HybridConfig(ModelConfig):
    layer_types: tuple[str, ...] = ()
    linear: LinearAttentionShape | None = None
    partial_rotary_factor: float = 0.25
    mrope_section: tuple[int, ...] = MROPE_SECTION  # multimodal RoPE: rotary frequencies per t, h, w

    @property
    def rotary_dim(self) -> int:
        return int(self.head_dim * self.partial_rotary_factor)

    @property
    def attention_layers(self) -> tuple[int, ...]:
        return tuple(i for i, t in enumerate(self.layer_types) if t == FULL)

    @property
    def linear_layers(self) -> tuple[int, ...]:
        return tuple(i for i, t in enumerate(self.layer_types) if t == LINEAR)

    @classmethod
    def from_hf(cls, cfg: dict) -> HybridConfig:
        if cfg.get("model_type") == "qwen3_5":
            cfg = {"tie_word_embeddings": cfg.get("tie_word_embeddings", False), **cfg["text_config"]}
        layers = cfg["num_hidden_layers"]
        types = cfg.get("layer_types") or [
            FULL if (i + 1) % cfg.get("full_attention_interval", 4) == 0 else LINEAR for i in range(layers)
        ]
        unknown = sorted(set(types) - {LINEAR, FULL})
        if unknown or len(types) != layers:
            raise ValueError(f"layer_types {unknown or types!r}: need {layers} of {LINEAR}, {FULL}")
        rope = cfg.get("rope_parameters") or {}
        return cls(
            vocab_size=cfg["vocab_size"],
            hidden_size=cfg["hidden_size"],
            intermediate_size=cfg["intermediate_size"],
            num_layers=layers,
            num_heads=cfg["num_attention_heads"],
            num_kv_heads=cfg["num_key_value_heads"],
            head_dim=cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"],
            rms_norm_eps=cfg.get("rms_norm_eps", 1e-6),
            rope_theta=float(rope.get("rope_theta", cfg.get("rope_theta", 10000.0))),
            tie_word_embeddings=cfg.get("tie_word_embeddings", False),
            attention_bias=cfg.get("attention_bias", False),
            qk_norm=True,
            max_position_embeddings=cfg.get("max_position_embeddings", 32768),
            model_type="qwen3_5_text",
            eos_token_ids=hf_eos_ids(cfg),
            layer_types=tuple(types),
            linear=LinearAttentionShape(
                num_key_heads=cfg["linear_num_key_heads"],
                num_value_heads=cfg["linear_num_value_heads"],
                key_head_dim=cfg["linear_key_head_dim"],
                value_head_dim=cfg["linear_value_head_dim"],
                conv_kernel=cfg.get("linear_conv_kernel_dim", 4),
            ),
            partial_rotary_factor=rope.get("partial_rotary_factor", cfg.get("partial_rotary_factor", 0.25)),
            mrope_section=tuple(rope.get("mrope_section", MROPE_SECTION)),
        )


@dataclass
class HybridState:
    """Every linear layer's `LinearState` for a batch of sequences, by linear-layer ordinal. A
    forward given one reads each layer's entry (`read`; None: zeros) and replaces it by the state
    after the rows' real tokens (`write`: with the states at `cuts` as its `snapshots`, when set).
    A subclass may keep the rows elsewhere (the sampler's state pool: sampler/state_cache.py)."""

    layers: list[LinearState | None] = field(default_factory=list)
    cuts: Cuts | None = None  # (row, t): also take each layer's state after row's first t tokens

    def read(self, j: int) -> LinearState | None:
        return self.layers[j]

    def write(self, j: int, state: LinearState) -> None:
        self.layers[j] = state

    @classmethod
    def zeros(cls, cfg: HybridConfig, batch: int, device=None, dtype=torch.float32) -> HybridState:
        """The state before any token, for `batch` rows (`dtype`: the model's)."""
        return cls([LinearState.zeros(cfg.linear, batch, device, dtype) for _ in cfg.linear_layers])

    @classmethod
    def cat(cls, states: list[HybridState]) -> HybridState:
        """Rows of several states (no None entries) as one batch, in order."""
        return cls([LinearState.cat(list(layer)) for layer in zip(*(s.layers for s in states))])

    def rows(self, index: torch.Tensor | slice) -> HybridState:
        return HybridState([s.rows(index) for s in self.layers])

    def clone(self) -> HybridState:
        """A snapshot (what a prefix cache keeps): later forwards from `self` do not change it."""
        return HybridState([None if s is None else s.clone() for s in self.layers])

    @property
    def nbytes(self) -> int:
        return sum(s.nbytes for s in self.layers if s is not None)


# ----------------------------------------------------------------------------- layers
class ZeroCenteredRMSNorm(nn.Module):
    """RMSNorm scaled by 1 + weight (weights stored centred on 0), in the wide dtype, then rounded:
    Qwen3.5's order."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        w = 1 + invariant.widened(self.weight)
        if x.dtype == torch.float32 and fused.suits(x, w):  # inference: one C pass, not aten's six ops
            return fused.rms_norm(x, w, self.eps)
        if fused_train.suits(x, w):  # training: one C pass forward and one backward (fused_train.py)
            return fused_train.rms_norm(x, w, self.eps, round_first=False)
        return F.rms_norm(invariant.widened(x), w.shape, w, self.eps).to(x.dtype)


def partial_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """`apply_rope` on the first cos.shape[-1] dims of x [B, H, T, D]; the rest pass through."""
    rot = cos.shape[-1]
    return torch.cat([apply_rope(x[..., :rot], cos, sin), x[..., rot:]], -1)


class GatedAttention(nn.Module):
    """Full attention with q/k norms, partial RoPE and an output gate: `q_proj` gives each head's
    queries and then its gate ([H, 2 D]); the heads' output is multiplied by sigmoid(gate)."""

    def __init__(self, cfg: HybridConfig):
        super().__init__()
        self.cfg = cfg
        h, kvh, d = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.q_proj = LoRALinear(cfg.hidden_size, 2 * h * d, bias=cfg.attention_bias)
        self.k_proj = LoRALinear(cfg.hidden_size, kvh * d, bias=cfg.attention_bias)
        self.v_proj = LoRALinear(cfg.hidden_size, kvh * d, bias=cfg.attention_bias)
        self.o_proj = LoRALinear(h * d, cfg.hidden_size, bias=cfg.attention_bias)
        self.q_norm = ZeroCenteredRMSNorm(d, cfg.rms_norm_eps)
        self.k_norm = ZeroCenteredRMSNorm(d, cfg.rms_norm_eps)
        self.qkv = FusedLinears("q_proj", "k_proj", "v_proj")

    def forward(self, x, cos, sin, adapters, mask, kv: KVContext | None, layer: int):
        B, T, _ = x.shape
        cfg = self.cfg
        qg, k, v = self.qkv(self, x, adapters)
        q, gate = qg.view(B, T, cfg.num_heads, 2 * cfg.head_dim).chunk(2, dim=-1)
        q = self.q_norm(q).transpose(1, 2)
        k = self.k_norm(k.view(B, T, cfg.num_kv_heads, cfg.head_dim)).transpose(1, 2)
        v = v.view(B, T, cfg.num_kv_heads, cfg.head_dim).transpose(1, 2)
        q, k = partial_rope(q, cos, sin), partial_rope(k, cos, sin)
        out = attend(q, k, v, mask, kv, layer).transpose(1, 2).reshape(B, T, -1)
        return self.o_proj(out * invariant.sigmoid(gate.reshape(B, T, -1)), adapters)


class HybridBlock(nn.Module):
    """One layer: `linear_attn` or `self_attn`, then the MLP, each after a zero-centred RMSNorm.
    `index` is the layer's ordinal among the layers of its kind (its KV pools or its state)."""

    def __init__(self, cfg: HybridConfig, kind: str, index: int):
        super().__init__()
        self.kind, self.index = kind, index
        if kind == LINEAR:
            self.linear_attn = GatedDeltaNet(cfg.hidden_size, cfg.linear, cfg.rms_norm_eps)
        else:
            self.self_attn = GatedAttention(cfg)
        self.mlp = MLP(cfg)
        self.input_layernorm = ZeroCenteredRMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = ZeroCenteredRMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, x, cos, sin, adapters, mask, kv, real, state: HybridState | None):
        h = self.input_layernorm(x)
        if self.kind == LINEAR:
            if state is None:
                h, _ = self.linear_attn(h, adapters, real)
            else:
                h, after = self.linear_attn(h, adapters, real, state.read(self.index), state.cuts)
                state.write(self.index, after)
        else:
            h = self.self_attn(h, cos, sin, adapters, mask, kv, self.index)
        x = x + h
        return x + self.mlp(self.post_attention_layernorm(x), adapters)


class HybridDecoder(nn.Module):
    def __init__(self, cfg: HybridConfig):
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        ordinal = {LINEAR: 0, FULL: 0}
        blocks = []
        for kind in cfg.layer_types:
            blocks.append(HybridBlock(cfg, kind, ordinal[kind]))
            ordinal[kind] += 1
        self.layers = nn.ModuleList(blocks)
        self.norm = ZeroCenteredRMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


class HybridTransformer(Transformer):
    """`Transformer`'s interface (logits, LM head, LoRA names) over the hybrid stack, and a
    recurrent `state` beside the `KVContext`."""

    decoder = HybridDecoder

    def hidden_states(
        self,
        tokens: torch.Tensor,
        positions: torch.Tensor,
        adapters: AdapterBatch | None = None,
        pad_mask: torch.Tensor | None = None,
        kv: KVContext | None = None,
        state: HybridState | None = None,
        embeds: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """`Transformer.hidden_states`, plus `state`: the rows' recurrent state, read and replaced
        (needed with `kv`: a KV cache without the linear layers' state would be half a cache).
        Real tokens come first in each row: `pad_mask`, or with `kv` its non-negative write slots.
        Images (model/multimodal.py): `positions` [3, B, T] are multimodal RoPE's (t, h, w), and
        `embeds` [B, T, hidden] replaces the token embeddings (its image rows the tower's features)."""
        if kv is not None and state is None:
            raise ValueError("a hybrid model's forward over a KV cache needs the rows' recurrent state")
        x = self.model.embed_tokens(tokens) if embeds is None else embeds
        if positions.dim() == 3:
            angles = self.mrope_angles(positions, x.dtype)
        else:
            angles = positions[..., None].to(invariant.wide_dtype(x.dtype)) * self.inv_freq
        cos, sin = rope_tables(angles, x.dtype)  # [B, 1, T, rotary_dim]
        real = pad_mask if pad_mask is not None or kv is None else kv.write_slots >= 0
        if real is not None and bool(real.all()):
            real = None
        mask = padding_mask(pad_mask) if kv is None else None
        for layer in self.model.layers:
            x = layer(x, cos, sin, adapters, mask, kv, real, state)
        return self.model.norm(x)

    # ------------------------------------------------------------------------- multimodal RoPE
    def mrope_angles(self, positions: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """RoPE angles [B, T, rotary_dim / 2] of multimodal positions [3, B, T] (t, h, w):
        frequency i turns by the position of its axis (`mrope_axes`). Equal axes (text) give the
        angles of the plain positions exactly."""
        angles = positions[..., None].to(invariant.wide_dtype(dtype)) * self.inv_freq  # [3, B, T, F]
        axis = mrope_axes(self.cfg, positions.device).expand(1, *angles.shape[1:])
        return angles.gather(0, axis)[0]


def mrope_axes(cfg: HybridConfig, device=None) -> torch.Tensor:
    """The axis (0 t, 1 h, 2 w) whose position each rotary frequency turns by: interleaved, as
    transformers' Qwen3.5 (frequency 3j + 1 is h's and 3j + 2 is w's while j < mrope_section[1]
    resp. [2]; the rest t's)."""
    axis = torch.zeros(cfg.rotary_dim // 2, dtype=torch.long, device=device)
    for dim in (1, 2):
        axis[dim : 3 * cfg.mrope_section[dim] : 3] = dim
    return axis
