"""Loading a Hugging Face checkpoint directory into a `Transformer`.

A directory holds config.json, one or many *.safetensors (optionally with an index), and the
tokenizer files (tokenizer.json, tokenizer_config.json, chat_template.jinja). Nothing here ever
reaches a model hub.

Families: the dense `llama`, `qwen2`, `qwen3`, `mistral` (model.py; a Mistral with a
`sliding_window` or a Qwen2 with `use_sliding_window`: windowed_dense.py), the sliding-window
`gemma3_text` (gemma3.py) and `olmo3` (olmo3.py), and Qwen3.5's hybrid `qwen3_5_text`
(qwen3_5.py); a multimodal `qwen3_5` or `gemma3` checkpoint's language model (its
`model.language_model.*` weights; the vision tower, its projector and the multi-token-prediction
head are not loaded). The sampler keeps a hybrid model's recurrent state per sequence
(sampler/state_cache.py).
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import load_file

from ..config import DTYPE_NAMES
from . import gemma3, olmo3, qwen3_5, windowed_dense
from .kernels import dtype_choice
from .kernels.dtype_choice import DtypeChoice
from .lora import linear_shape_counts
from .model import ModelConfig, Transformer, rope_inv_freq

# A multimodal checkpoint's language model and the parts of it a text model does not load.
_LANGUAGE_MODEL = "model.language_model."
_NOT_TEXT = ("model.visual.", "mtp.", "model.vision_tower.", "model.multi_modal_projector.")
# model_type -> its config class; any other type is model.py's
_CONFIGS = {
    **dict.fromkeys(qwen3_5.FAMILIES, qwen3_5.HybridConfig),
    **dict.fromkeys(gemma3.FAMILIES, gemma3.Gemma3Config),
    **dict.fromkeys(olmo3.FAMILIES, olmo3.Olmo3Config),
}
# config class -> its model class
_MODELS = {
    qwen3_5.HybridConfig: qwen3_5.HybridTransformer,
    gemma3.Gemma3Config: gemma3.Gemma3Transformer,
    olmo3.Olmo3Config: olmo3.Olmo3Transformer,
    windowed_dense.DenseWindowedConfig: windowed_dense.DenseWindowedTransformer,
}


def default_device() -> torch.device:
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def default_dtype(device: torch.device) -> torch.dtype:
    """A model loaded without a dtype: fp32 on CPU, bf16 on CUDA. An engine's `--dtype auto` is
    `auto_dtype`'s measured choice instead."""
    return torch.bfloat16 if device.type == "cuda" else torch.float32


DTYPES = {name: getattr(torch, name) for name in DTYPE_NAMES}  # the names EngineConfig accepts


def parse_dtype(name: str | None) -> torch.dtype | None:
    """The model dtype a name asks for ("float32", "bfloat16"; None or "auto": the device's default).
    bfloat16 runs on CPU too, the way it runs on CUDA: bf16 weights, activations and KV cache; fp32
    norms, attention softmax, logits, log-softmax, LoRA weights and optimizer state."""
    if name is None or name == "auto":
        return None
    if name not in DTYPES:
        raise ValueError(f"dtype: {name!r} is not one of auto, {', '.join(DTYPES)}")
    return DTYPES[name]


def read_config(path: str | Path) -> ModelConfig:
    path = Path(path)
    cfg_file = path / "config.json"
    if not cfg_file.is_file():
        raise FileNotFoundError(f"{path} is not a model directory: it has no config.json")
    return config_from_hf(json.loads(cfg_file.read_text()))


def config_from_hf(cfg: dict) -> ModelConfig:
    """A config.json's model config, by its family (`model_type`)."""
    if windowed_dense.has_windows(cfg):  # Mistral 7B v0.1, a Qwen2 with use_sliding_window
        return windowed_dense.DenseWindowedConfig.from_hf(cfg)
    return _CONFIGS.get(cfg.get("model_type"), ModelConfig).from_hf(cfg)


def meta_model(cfg: ModelConfig) -> Transformer:
    """The model of `cfg`, its family's class, on the meta device: shapes without memory."""
    with torch.device("meta"):
        return _MODELS.get(type(cfg), Transformer)(cfg)


def auto_dtype(path: str | Path, device: torch.device) -> DtypeChoice:
    """What `--dtype auto` runs the model at `path` in on `device` (kernels/dtype_choice.py: bf16 on
    CUDA; on a CPU, bf16 only where this machine runs the model's GEMMs at least twice as fast)."""
    return dtype_choice.choose(linear_shape_counts(meta_model(read_config(path))), device)


def text_weights(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A checkpoint's weights under a text model's names (`text_name`): a multimodal checkpoint's
    language model without its vision tower or MTP head; others as they are."""
    if not any(k.startswith(_LANGUAGE_MODEL) for k in state):
        return state
    return {text_name(k): v for k, v in state.items() if not k.startswith(_NOT_TEXT)}


def text_name(name: str) -> str:
    """A checkpoint weight's name in a text model: a multimodal checkpoint's language model's
    `model.language_model.X` is `model.X`; other names are as they are."""
    return "model." + name[len(_LANGUAGE_MODEL) :] if name.startswith(_LANGUAGE_MODEL) else name


def load_model(
    path: str | Path, device: torch.device | str | None = None, dtype: torch.dtype | None = None
) -> Transformer:
    """Build the model from `path/config.json` and load every *.safetensors file into it."""
    path = Path(path)
    cfg = read_config(path)
    device = torch.device(device) if device is not None else default_device()
    dtype = dtype or default_dtype(device)
    model = meta_model(cfg)
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"{path} holds no *.safetensors weights")
    state: dict[str, torch.Tensor] = {}
    for f in files:
        state.update(load_file(str(f)))
    state = text_weights(state)
    if cfg.tie_word_embeddings:
        state.pop("lm_head.weight", None)
    model = model.to_empty(device=device)
    missing, unexpected = model.load_state_dict(state, strict=False)
    missing = [m for m in missing if not (cfg.tie_word_embeddings and m == "lm_head.weight")]
    if missing or unexpected:
        raise ValueError(
            f"{path}: weights do not match a {cfg.model_type} model: "
            f"missing {missing[:5]}, unexpected {unexpected[:5]}"
        )
    if cfg.tie_word_embeddings:
        model.lm_head.weight = model.model.embed_tokens.weight
    model = model.to(dtype)
    model.inv_freq = rope_inv_freq(cfg).to(device)  # a non-persistent buffer: rebuilt, kept fp32
    model.requires_grad_(False)
    model.eval()
    model.source_dir = path.resolve()
    return model
