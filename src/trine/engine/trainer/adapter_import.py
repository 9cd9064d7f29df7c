"""Importing a PEFT LoRA adapter trained elsewhere as an ordinary trine checkpoint.

`import_adapter(src, dst, model)` checks a PEFT directory (`adapter_config.json` and
`adapter_model.safetensors`) against the served base model before anything is written, then writes
trine's checkpoint: the same PEFT keys in fp32, PEFT's config, and `trine_checkpoint.json` with the
served model's name and where the adapter came from (`source`). The result loads, trains, samples and
exports like a checkpoint trine saved (checkpoint.py).

What is checked, each failure a ValueError naming the tensor or the field and what the model needs:
- the files (safetensors only: pickled `adapter_model.bin` is never loaded);
- PEFT's config: a plain LoRA (`peft_type` LORA; no DoRA, bias, `modules_to_save`, per-module ranks
  or alphas, `fan_in_fan_out`, embedding LoRA);
- the base model it names (`base_model_name_or_path`, compared by its last path component, case
  insensitively, with the served model's name and directory; an adapter that names none passes);
- every tensor: its module is one of the model's LoRA targets (`adapter_targets`), its shape the one
  the model needs (A [r, in], B [out, r]), its dtype a float (fp32, fp16, bf16), every A with its B,
  its values finite (checked as it is read for writing, still before anything is written);
- the rank: the config's `r`, the same for every module, within `limits.check_lora_rank`; the
  scale finite (rsLoRA's lora_alpha times sqrt(r) can overflow).

An adapter on some modules of a group (q_proj and v_proj only, some layers only) is imported as it
is: the group's other modules hold B = 0, adding nothing (checkpoint.load_peft_adapter), and train
from there when a run continues it.
"""

from __future__ import annotations

import hashlib
import json
import math
from pathlib import Path

import torch
from safetensors import safe_open

from ...limits import check_lora_rank
from ..api import LORA_ATTN, LORA_LINEAR_ATTN, LORA_MLP, LORA_UNEMBED, LoRAConfig
from ..model.lora import LoRALinear
from .checkpoint import ADAPTER_CONFIG, ADAPTER_WEIGHTS, peft_key, save_peft_tensors

FLOAT_DTYPES = {"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16}
_PREFIX = "base_model.model."
# PEFT config keys whose non-default value changes what the adapter computes, with that default
_PLAIN = {
    "use_dora": False,
    "bias": "none",
    "fan_in_fan_out": False,
    "modules_to_save": None,
    "rank_pattern": {},
    "alpha_pattern": {},
    "layers_pattern": None,
    "lora_bias": False,
    "trainable_token_indices": None,
}


def adapter_targets(model: torch.nn.Module) -> dict[str, tuple[int, int]]:
    """(out, in) features of every linear layer an adapter may target, by module name."""
    return {
        name: (m.out_features, m.in_features)
        for name, m in model.named_modules()
        if isinstance(m, LoRALinear)
    }


def check_adapter(
    src: str | Path, targets: dict[str, tuple[int, int]], model_names: tuple[str, ...]
) -> tuple[LoRAConfig, dict[str, str]]:
    """The LoRAConfig of the PEFT adapter at `src` if it fits a model with `targets` (its
    `adapter_targets`) named `model_names`, and each tensor key's module; ValueError otherwise."""
    src = Path(src)
    cfg_file, weights = src / ADAPTER_CONFIG, src / ADAPTER_WEIGHTS
    if not weights.is_file():
        bin_hint = " (adapter_model.bin holds pickles, which trine never loads: save with safetensors)"
        raise ValueError(
            f"{ADAPTER_WEIGHTS} is missing{bin_hint if (src / 'adapter_model.bin').is_file() else ''}"
        )
    if not cfg_file.is_file():
        raise ValueError(f"{ADAPTER_CONFIG} is missing: a PEFT adapter directory has both files")
    try:
        cfg = json.loads(cfg_file.read_text())
    except (ValueError, UnicodeDecodeError) as e:
        raise ValueError(f"{ADAPTER_CONFIG} is not JSON: {e}") from None
    except RecursionError:
        raise ValueError(
            f"{ADAPTER_CONFIG} is nested too deeply to parse (PEFT writes a flat JSON object)"
        ) from None
    if not isinstance(cfg, dict):
        raise ValueError(f"{ADAPTER_CONFIG} must hold a JSON object")
    if cfg.get("peft_type", "LORA") != "LORA":
        raise ValueError(f"{ADAPTER_CONFIG}: peft_type {cfg.get('peft_type')!r} is not LORA")
    for key, plain in _PLAIN.items():
        if cfg.get(key, plain) not in (plain, None, {}, [], False, "none"):
            raise ValueError(
                f"{ADAPTER_CONFIG}: {key} = {cfg[key]!r}; trine imports plain LoRA adapters ({key} {plain!r})"
            )
    _check_base(cfg.get("base_model_name_or_path"), model_names)
    rank = cfg.get("r")
    check_lora_rank(rank, f"{ADAPTER_CONFIG}: r")
    alpha = cfg.get("lora_alpha", rank)
    if (
        isinstance(alpha, bool)
        or not isinstance(alpha, (int, float))
        or not math.isfinite(alpha)
        or alpha <= 0
    ):
        raise ValueError(f"{ADAPTER_CONFIG}: lora_alpha {alpha!r} must be a positive number")
    if cfg.get("use_rslora"):
        alpha = alpha * math.sqrt(rank)  # rsLoRA scales by alpha / sqrt(r); trine by alpha / r
        if not math.isfinite(alpha):
            raise ValueError(
                f"{ADAPTER_CONFIG}: lora_alpha makes the scale {alpha} (rsLoRA multiplies it by "
                "sqrt(r)); use a finite lora_alpha"
            )
    modules = _check_tensors(weights, targets, rank)
    names = {m.rsplit(".", 1)[-1] for m in modules.values()}
    lora = LoRAConfig(
        rank=rank,
        alpha=float(alpha),
        train_attn=bool(names & set(LORA_ATTN + LORA_LINEAR_ATTN)),
        train_mlp=bool(names & set(LORA_MLP)),
        train_unembed=bool(names & set(LORA_UNEMBED)),
    )
    return lora, modules


def import_adapter(
    src: str | Path,
    dst: str | Path,
    targets: dict[str, tuple[int, int]],
    model_names: tuple[str, ...],
    base_model: str,
    base_model_dir: str | Path | None = None,
    origin: str = "",
) -> tuple[LoRAConfig, str, int]:
    """Check the adapter at `src` (`check_adapter`), then write it as a trine checkpoint at `dst`
    (a directory not yet there). Returns its LoRAConfig, its `source` (`origin`, the base model its
    config names and the digest of its weights) and the bytes written."""
    lora, modules = check_adapter(src, targets, model_names)
    weights = Path(src) / ADAPTER_WEIGHTS
    state = {}
    with safe_open(str(weights), "pt") as f:
        for key, module in modules.items():
            which = "A" if ".lora_A." in key else "B"
            tensor = f.get_tensor(key).to(torch.float32).contiguous()
            if not bool(torch.isfinite(tensor).all()):
                raise ValueError(f"{ADAPTER_WEIGHTS}: tensor {key} holds NaN or infinite values")
            state[peft_key(module, which)] = tensor
    named = json.loads((Path(src) / ADAPTER_CONFIG).read_text()).get("base_model_name_or_path")
    digest = hashlib.sha256(weights.read_bytes()).hexdigest()[:16]
    source = "; ".join(x for x in (origin, f"trained on {named}" if named else "", f"sha256 {digest}") if x)
    size = save_peft_tensors(state, lora, dst, base_model, base_model_dir, source=source)
    return lora, source, size


def _check_base(named, model_names: tuple[str, ...]) -> None:
    if not named:
        return
    last = str(named).rstrip("/").replace("\\", "/").rsplit("/", 1)[-1].lower()
    if last not in {n.rstrip("/").rsplit("/", 1)[-1].lower() for n in model_names}:
        raise ValueError(
            f"{ADAPTER_CONFIG}: base_model_name_or_path {named!r} is not the base model "
            f"{model_names[0]!r}: import the adapter on the model it was trained on"
        )


def _check_tensors(weights: Path, targets: dict[str, tuple[int, int]], rank: int) -> dict[str, str]:
    """Each tensor key's module, every key checked (see the module docstring)."""
    try:
        f = safe_open(str(weights), "pt")
    except Exception as e:  # a truncated or foreign file: safetensors' own reason
        raise ValueError(f"{ADAPTER_WEIGHTS} is not a safetensors file: {e}") from None
    supported = ", ".join(sorted({t.rsplit(".", 1)[-1] for t in targets}))
    modules: dict[str, str] = {}
    pairs: dict[str, set[str]] = {}
    with f:
        for key in f.keys():
            module, which = _parse_key(key)
            if module not in targets:
                raise ValueError(
                    f"{ADAPTER_WEIGHTS}: tensor {key} adapts {module}, which the base model does not "
                    f"have (its LoRA targets: {supported}, e.g. {next(iter(targets), '')})"
                )
            out_f, in_f = targets[module]
            need = (rank, in_f) if which == "A" else (out_f, rank)
            sl = f.get_slice(key)
            shape, dtype = tuple(sl.get_shape()), sl.get_dtype()
            if shape != need:
                raise ValueError(
                    f"{ADAPTER_WEIGHTS}: tensor {key} has shape {shape}; the base model needs {need} "
                    f"(lora_{which} of {module} at rank {rank})"
                )
            if dtype not in FLOAT_DTYPES:
                raise ValueError(
                    f"{ADAPTER_WEIGHTS}: tensor {key} has dtype {dtype}; import a float adapter "
                    f"({', '.join(FLOAT_DTYPES)})"
                )
            modules[key] = module
            pairs.setdefault(module, set()).add(which)
    if not modules:
        raise ValueError(f"{ADAPTER_WEIGHTS} holds no LoRA tensors")
    for module, have in pairs.items():
        if have != {"A", "B"}:
            missing = peft_key(module, "B" if "A" in have else "A")
            raise ValueError(f"{ADAPTER_WEIGHTS}: {missing} is missing (every lora_A needs its lora_B)")
    return modules


def _parse_key(key: str) -> tuple[str, str]:
    """`base_model.model.<module>.lora_A[.<adapter name>].weight` -> (module, "A")."""
    body = key.removeprefix(_PREFIX)
    if body.endswith(".base_layer.weight") or "embed_tokens" in body:
        raise ValueError(
            f"{ADAPTER_WEIGHTS}: tensor {key} is a whole weight of the model, not a LoRA matrix "
            "(PEFT saves embedding layers for an adapted tied head or a resized vocabulary): trine "
            "imports LoRA matrices on the base model's own weights; save the adapter with "
            "save_embedding_layers=False, or fine-tune in full (rank 0) to train the embedding"
        )
    for which in ("A", "B"):
        marker = f".lora_{which}."
        if marker in body and body.endswith(".weight"):
            return body.split(marker, 1)[0], which
    raise ValueError(
        f"{ADAPTER_WEIGHTS}: tensor {key} is not a LoRA matrix (expected keys like "
        f"{peft_key('model.layers.0.self_attn.q_proj', 'A')}; embedding LoRA and extra modules are "
        "not imported)"
    )
