"""Dense (Llama-style) checkpoints whose config asks for a sliding window: Mistral with a
`sliding_window` (Mistral 7B v0.1: every layer reads only its last 4,096 keys) and Qwen2 with
`use_sliding_window` (the layers from `max_window_layers` on). model.py's layers over
sliding_window.py's stack; a Mistral or Qwen2 config without a window is model.py's plain model.
A model whose every layer is windowed (Mistral's) frees the KV that slides out (sampler/window.py).
"""

from __future__ import annotations

from dataclasses import dataclass

from .model import Decoder
from .sliding_window import FULL, SLIDING, RopeSpec, WindowedConfig, WindowedTransformer


def has_windows(cfg: dict) -> bool:
    """Whether a `mistral` or `qwen2` config.json has windowed layers (as transformers reads it)."""
    kind = cfg.get("model_type")
    if kind == "mistral":
        return cfg.get("sliding_window") is not None
    if kind == "qwen2":
        return bool(cfg.get("use_sliding_window")) and cfg.get("sliding_window") is not None
    return False


@dataclass(frozen=True)
class DenseWindowedConfig(WindowedConfig):
    @classmethod
    def from_hf(cls, cfg: dict) -> DenseWindowedConfig:
        kind, layers = cfg["model_type"], cfg["num_hidden_layers"]
        types = cfg.get("layer_types")
        if not types:  # Mistral: every layer; Qwen2: those from max_window_layers on
            start = 0 if kind == "mistral" else cfg.get("max_window_layers", 28)
            types = [SLIDING if i >= start else FULL for i in range(layers)]
        fields = cls.hf_fields(
            {**cfg, "layer_types": types},
            pattern=1,
            local_theta=None,
            global_theta=10_000.0,
            max_positions=4096,
            eps=1e-6,
            tie=False,
        )
        rope = dict(cfg.get("rope_parameters") or cfg.get("rope_scaling") or {})  # every layer's
        rope.setdefault("rope_theta", cfg.get("rope_theta", 10_000.0))
        spec = RopeSpec.from_hf(rope, fields["max_position_embeddings"])
        fields.update(
            qk_norm=False,
            attention_bias=kind == "qwen2" or cfg.get("attention_bias", False),
            rope=((FULL, spec), (SLIDING, spec)),
            rope_theta=spec.theta,
        )
        return cls(**fields, model_type=kind)


class DenseWindowedTransformer(WindowedTransformer):
    decoder = Decoder
