"""Sliding-window attention, and the layer stack of families that mix windowed and global layers
(Gemma 3: gemma3.py, OLMo 3: olmo3.py).

A windowed layer's query at position p reads only the keys at positions p - W + 1 .. p
(transformers' `sliding_window_overlay`: kv_idx > q_idx - W); a global layer reads every earlier key.
`layer_types` says each layer's kind, and each kind has its own RoPE (`RopeSpec`). Everything else
is model.py's: a windowed layer is model.py's `Attention` over a narrower context.

- Training (no `KVContext`): `window_mask`, the causal and padding mask with the keys older than
  W hidden (a query that would see none sees key 0: no row of attention is empty).
- Over a KV pool: `windowed(kv, W)`, a `KVContext` over the same pools that keeps each query's last
  W keys. Without `query_index` (a prefill chunk, an unpacked decode step, the trainer's shared
  prefixes) key column l holds position l, and the keys before the earliest window of a row are cut
  off, so a windowed layer gathers (or the C kernel walks) about W + T keys however long the
  context is. Packed decode rows (a request's samples, kv_layout.py) keep their columns; the mask
  alone hides what slid out (the C kernel skips a tile no query sees).

Invariants
- Every key a query attends lies within its window, in position order, tile aligned: cut columns
  start at a multiple of `KEY_TILE`, and fully masked tiles add exactly zero (invariant.py), so
  with batch-invariant kernels a windowed layer's result is bit for bit the training forward's.
- A windowed layer never reads a key older than its window: the sampler may free such keys' blocks
  (sampler/window.py) and point their slots anywhere.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from . import invariant
from .attention import KVContext
from .invariant import KEY_TILE
from .lora import AdapterBatch
from .model import ModelConfig, Transformer, hf_eos_ids, padding_mask, rope_tables

SLIDING, FULL = "sliding_attention", "full_attention"


# ----------------------------------------------------------------------------- config
@dataclass(frozen=True)
class RopeSpec:
    """One layer kind's rotary embedding: `default`, `linear` (positions divided by `factor`) or
    `yarn` (YaRN: frequencies blended between `factor`-interpolated and original, and cos/sin
    scaled by `attention_factor`)."""

    theta: float
    kind: str = "default"
    factor: float = 1.0
    original_max: int = 0
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    attention_factor: float = 1.0
    truncate: bool = True

    KINDS = ("default", "linear", "yarn")

    @classmethod
    def from_hf(cls, params: dict, max_positions: int) -> RopeSpec:
        kind = params.get("rope_type", params.get("type", "default"))
        if kind not in cls.KINDS:
            raise ValueError(f"rope_parameters: rope_type {kind!r} is not supported ({', '.join(cls.KINDS)})")
        theta = float(params["rope_theta"])
        if kind == "default":
            return cls(theta)
        factor = float(params.get("factor") or 1.0)
        if kind == "linear":
            return cls(theta, kind, factor)
        original = int(params["original_max_position_embeddings"])
        factor = float(params.get("factor") or max_positions / original)
        attention = params.get("attention_factor")
        if attention is None:  # transformers' yarn_get_mscale, with mscale / mscale_all_dim if given
            mscale, mscale_all = params.get("mscale"), params.get("mscale_all_dim")
            attention = (
                _yarn_mscale(factor, mscale) / _yarn_mscale(factor, mscale_all)
                if mscale and mscale_all
                else _yarn_mscale(factor, 1.0)
            )
        return cls(
            theta,
            kind,
            factor,
            original,
            float(params.get("beta_fast") or 32.0),
            float(params.get("beta_slow") or 1.0),
            float(attention),
            bool(params.get("truncate", True)),
        )

    def inv_freq(self, dim: int) -> torch.Tensor:
        """Per pair of rotated dims, fp32 (as model.py's `rope_inv_freq`)."""
        inv = 1.0 / (self.theta ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim))
        if self.kind == "linear":
            inv = inv / self.factor
        elif self.kind == "yarn":  # transformers' _compute_yarn_parameters
            low, high = (
                dim * math.log(self.original_max / (rot * 2 * math.pi)) / (2 * math.log(self.theta))
                for rot in (self.beta_fast, self.beta_slow)
            )
            if self.truncate:
                low, high = math.floor(low), math.ceil(high)
            low, high = max(low, 0), min(high, dim - 1)
            high = high + 0.001 if low == high else high
            ramp = ((torch.arange(dim // 2, dtype=torch.float64) - low) / (high - low)).clamp(0, 1)
            inv = inv / self.factor * ramp + inv * (1 - ramp)
        return inv.float()


def _yarn_mscale(scale: float, mscale: float) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


@dataclass(frozen=True)
class WindowedConfig(ModelConfig):
    """`ModelConfig` plus each layer's kind (`layer_types`), the window of the sliding ones and each
    kind's RoPE. `rope_theta` (model.py's) is the global layers' theta."""

    layer_types: tuple[str, ...] = ()
    sliding_window: int = 4096
    rope: tuple[tuple[str, RopeSpec], ...] = ()  # (kind, its RoPE) per layer kind
    embed_scale: float = 1.0  # the embedding's output is multiplied by it (Gemma: sqrt(hidden))

    def window(self, layer: int) -> int | None:
        """The window of layer `layer` (None: a global layer)."""
        return self.sliding_window if self.layer_types[layer] == SLIDING else None

    @property
    def all_windowed(self) -> bool:
        """Every layer is windowed: KV older than `sliding_window` is never read again."""
        return all(t == SLIDING for t in self.layer_types)

    @classmethod
    def hf_fields(
        cls,
        cfg: dict,
        *,
        pattern: int,
        local_theta: float | None,
        global_theta: float,
        max_positions: int,
        eps: float,
        tie: bool,
    ) -> dict:
        """The fields both families read from a config.json, with the family's defaults: every
        `pattern`-th layer is global when `layer_types` is not given; `local_theta` (None: the
        global one) and `global_theta` are the default thetas of each kind's RoPE."""
        layers = cfg["num_hidden_layers"]
        types = cfg.get("layer_types") or [FULL if (i + 1) % pattern == 0 else SLIDING for i in range(layers)]
        unknown = sorted(set(types) - {SLIDING, FULL})
        if unknown or len(types) != layers:
            raise ValueError(f"layer_types {unknown or types!r}: need {layers} of {SLIDING}, {FULL}")
        window = cfg.get("sliding_window")
        if SLIDING in types and (not isinstance(window, int) or window < 1):
            raise ValueError(f"sliding_window {window!r}: sliding_attention layers need a window >= 1")
        max_positions = cfg.get("max_position_embeddings", max_positions)
        heads = cfg["num_attention_heads"]
        rope = _rope_by_kind(cfg, local_theta, global_theta, max_positions)
        return dict(
            vocab_size=cfg["vocab_size"],
            hidden_size=cfg["hidden_size"],
            intermediate_size=cfg["intermediate_size"],
            num_layers=layers,
            num_heads=heads,
            num_kv_heads=cfg.get("num_key_value_heads") or heads,
            head_dim=cfg.get("head_dim") or cfg["hidden_size"] // heads,
            rms_norm_eps=cfg.get("rms_norm_eps", eps),
            rope_theta=rope[FULL].theta,
            tie_word_embeddings=cfg.get("tie_word_embeddings", tie),
            attention_bias=cfg.get("attention_bias", False),
            qk_norm=True,
            max_position_embeddings=max_positions,
            eos_token_ids=hf_eos_ids(cfg),
            layer_types=tuple(types),
            sliding_window=window if isinstance(window, int) else 0,
            rope=tuple(rope.items()),
        )


def _rope_by_kind(cfg: dict, local_theta: float | None, global_theta: float, max_positions: int) -> dict:
    """Each layer kind's `RopeSpec`: transformers 5 writes `rope_parameters` per kind; older
    configs a `rope_theta` (global), a `rope_local_base_freq` (Gemma's local theta) and a
    `rope_scaling` that applies to the global layers."""
    params = cfg.get("rope_parameters") or {}
    if FULL in params or SLIDING in params:
        per_kind = {k: dict(params.get(k) or {}) for k in (FULL, SLIDING)}
    else:
        scaling = dict(cfg.get("rope_scaling") or {})
        theta = params.get("rope_theta", cfg.get("rope_theta", global_theta))
        per_kind = {
            FULL: {**scaling, "rope_theta": theta},
            SLIDING: {"rope_theta": cfg.get("rope_local_base_freq", local_theta or theta)},
        }
    per_kind[FULL].setdefault("rope_theta", global_theta)
    per_kind[SLIDING].setdefault("rope_theta", local_theta or per_kind[FULL]["rope_theta"])
    return {k: RopeSpec.from_hf(v, max_positions) for k, v in per_kind.items()}


# ----------------------------------------------------------------------------- masks and contexts
def window_mask(pad_mask: torch.Tensor | None, T: int, window: int, device) -> torch.Tensor | None:
    """The training forward's mask [B or 1, 1, T, T] of a windowed layer over rows of positions
    0..T-1 (`pad_mask` [B, T], True = real token, right padding): causal, padded keys hidden, keys
    at least `window` before the query hidden. None when nothing is hidden but the future."""
    if T <= window:
        return padding_mask(pad_mask)
    i = torch.arange(T, device=device)
    mask = ((i[None, :] <= i[:, None]) & (i[None, :] > i[:, None] - window))[None]
    if pad_mask is not None and not bool(pad_mask.all()):
        mask = mask & pad_mask[:, None, :]
        mask = mask | (~mask.any(-1, keepdim=True) & (i == 0))  # a padded query sees key 0
    return mask[:, None]


def windowed(kv: KVContext, window: int) -> KVContext:
    """A context over `kv`'s pools and writes in which each query attends only its last `window`
    keys (the module docstring). Every query still sees at least one key."""
    m = kv.attn_mask  # [rows, 1, Q, L]
    L = m.shape[-1]
    if L <= window:
        return kv
    if kv.query_index is not None:  # packed rows: a key's position is its rank among the query's keys
        rank = m.cumsum(-1)
        mask = m & (rank > rank[..., -1:] - window)
        return KVContext(kv.k_pool, kv.v_pool, kv.write_slots, kv.read_slots, mask, kv.query_index)
    # key column l holds position l, and a query sees positions 0..p: p + 1 keys
    last = m.sum(-1, dtype=torch.int32)[:, 0] - 1  # [rows, Q]: each query's position (padding: its last key)
    first = ((last.amin(-1) - window + 1).clamp(min=0) // KEY_TILE) * KEY_TILE  # [rows]
    width = int((last.amax(-1) + 1 - first).max())
    cols = first[:, None] + torch.arange(width, device=m.device)  # [rows, width]: the kept columns
    read = kv.read_slots.gather(1, cols.clamp(max=L - 1))
    c, p = cols[:, None, :], last[:, :, None]
    mask = ((c <= p) & (c > p - window))[:, None]
    return KVContext(kv.k_pool, kv.v_pool, kv.write_slots, read, mask)


# ----------------------------------------------------------------------------- the stack
class WindowedTransformer(Transformer):
    """`Transformer`'s interface over a stack of windowed and global layers: each layer gets its
    kind's RoPE tables and its kind's mask (training) or context (over a KV pool). A subclass sets
    `decoder`; its blocks take model.py's `Block` arguments."""

    def rope(self, kind: str, positions: torch.Tensor, dtype: torch.dtype):
        """cos and signed sin [B, 1, T, D] of layer kind `kind` (model.py's `rope_tables`), in
        `dtype`; YaRN's attention factor scales them in the wide dtype first."""
        spec = dict(self.cfg.rope)[kind]
        key = (kind, positions.device)
        cache = self.__dict__.setdefault("_inv_freq", {})  # built on first use: no meta tensors
        if key not in cache:
            cache[key] = spec.inv_freq(self.cfg.rotary_dim).to(positions.device)
        wide = invariant.wide_dtype(dtype)
        angles = positions[..., None].to(wide) * cache[key]
        if spec.attention_factor == 1.0:
            return rope_tables(angles, dtype)
        cos, sin = rope_tables(angles, wide)
        return (cos * spec.attention_factor).to(dtype), (sin * spec.attention_factor).to(dtype)

    def embed(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.model.embed_tokens(tokens)
        scale = self.cfg.embed_scale
        return x if scale == 1.0 else x * torch.tensor(scale, dtype=x.dtype, device=x.device)

    def hidden_states(
        self,
        tokens: torch.Tensor,
        positions: torch.Tensor,
        adapters: AdapterBatch | None = None,
        pad_mask: torch.Tensor | None = None,
        kv: KVContext | None = None,
    ) -> torch.Tensor:
        """`Transformer.hidden_states`, each layer over its kind's window."""
        cfg = self.cfg
        x = self.embed(tokens)
        kinds = set(cfg.layer_types)
        tables = {kind: self.rope(kind, positions, x.dtype) for kind in kinds}
        W, T = cfg.sliding_window, tokens.shape[1]
        if kv is None:  # the training path: a mask per kind
            masks = {
                k: padding_mask(pad_mask) if k == FULL else window_mask(pad_mask, T, W, x.device)
                for k in kinds
            }
            contexts = dict.fromkeys(kinds)
        else:  # over the KV pool: a context per kind
            masks = dict.fromkeys(kinds)
            contexts = {k: kv if k == FULL else windowed(kv, W) for k in kinds}
        for i, (layer, kind) in enumerate(zip(self.model.layers, cfg.layer_types)):
            cos, sin = tables[kind]
            x = layer(x, cos, sin, adapters, masks[kind], contexts[kind], i)
        return self.model.norm(x)
