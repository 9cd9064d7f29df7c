"""Exporting a LoRA checkpoint for use elsewhere: a PEFT adapter directory, or a merged model.

`export_adapter`: the checkpoint's adapter files only (no optimizer state), with
`base_model_name_or_path` pointing at the base model's directory, so `peft` loads it offline;
`adapter_config.json` holds PEFT's keys only, trine's facts go to `trine_checkpoint.json`.

`export_merged`: a full Hugging Face model directory with W' = W + (alpha / r) · B·A folded into
every targeted linear, plus the base model's config, tokenizer, chat template and generation
config, which `transformers` (and vLLM) load like any checkpoint. A multimodal base (a `qwen3_5`
checkpoint, whose language model trine trains) is written whole, vision tower included, with the
deltas folded into its language model's weights (`model.language_model.X` for the adapter's
`model.X`).

Invariants
- The merged model computes trine's adapter logits (fp32: within 1e-4).
- Tied embeddings are untied when the unembedding (`lm_head`) is adapted: the merged `lm_head`
  gets its own weight (embedding + delta) and the config says `tie_word_embeddings: false`, so
  the input embeddings stay the base model's. (Merging into a tied weight would change the
  embeddings too; PEFT's `merge_and_unload` does that.)
- The base directory is read shard by shard and written with the same shard names and index, so
  memory holds one shard at a time; the merge runs in fp32 and is stored in each weight's dtype.
- Every file is written under a temporary name and renamed; OUT must not exist yet or be empty.
- Every file written is mode 0644 (readable by all, writable by the owner), whatever mode the
  writer (safetensors writes 0600) or the base model's own files had.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from ..model.weights import text_name
from .checkpoint import (
    ADAPTER_CONFIG,
    ADAPTER_WEIGHTS,
    BASE_MODEL_NAME,
    TRINE_FACTS,
    read_lora_config,
    trine_facts,
)

_PEFT_PREFIX = "base_model.model."
SHARD_INDEX = "model.safetensors.index.json"
FILE_MODE = 0o644


def base_model_dir(adapter_dir: str | Path) -> Path | None:
    """The base model directory an adapter records (trine writes it), or None if it names none here."""
    cfg = json.loads((Path(adapter_dir) / ADAPTER_CONFIG).read_text())
    p = Path(str(cfg.get("base_model_name_or_path") or "")).expanduser()
    return p if (p / "config.json").is_file() else None


def model_files(base: Path) -> list[Path]:
    """The files of a model directory beside its weights and config: tokenizer, chat template,
    generation config, licence, ... (what a merged or fully trained model copies)."""
    skip = ("config.json", SHARD_INDEX, TRINE_FACTS)
    return sorted(
        f
        for f in base.iterdir()
        if f.is_file() and not f.name.endswith(".safetensors") and f.name not in skip
    )


def _prepare_out(out: Path) -> None:
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise ValueError(f"{out} already exists and is not an empty directory; choose a new OUT")
    out.mkdir(parents=True, exist_ok=True)


def _place(tmp: Path, dst: Path) -> None:
    """Give a fully written temporary file its mode and its name."""
    os.chmod(tmp, FILE_MODE)
    tmp.replace(dst)


def _copy(src: Path, dst: Path) -> None:
    tmp = dst.with_name(f".{dst.name}.tmp")
    shutil.copyfile(src, tmp)
    _place(tmp, dst)


def _write_json(path: Path, data: dict) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(json.dumps(data, indent=2) + "\n")
    _place(tmp, path)


def export_adapter(adapter_dir: str | Path, out: str | Path, base_dir: str | Path | None = None) -> Path:
    """Write the adapter of checkpoint `adapter_dir` as a PEFT adapter directory `out`."""
    adapter_dir, out = Path(adapter_dir), Path(out)
    read_lora_config(adapter_dir)  # refuses a directory that is not a LoRA checkpoint
    _prepare_out(out)
    _copy(adapter_dir / ADAPTER_WEIGHTS, out / ADAPTER_WEIGHTS)
    facts = trine_facts(adapter_dir)
    cfg = json.loads((adapter_dir / ADAPTER_CONFIG).read_text())
    cfg.pop(BASE_MODEL_NAME, None)  # older checkpoints kept the served model's name here
    if base_dir is not None:
        cfg["base_model_name_or_path"] = str(Path(base_dir).resolve())
    _write_json(out / TRINE_FACTS, {**facts, "exported_from": str(adapter_dir)})
    _write_json(out / ADAPTER_CONFIG, cfg)
    return out


def export_model_dir(src: str | Path, out: str | Path) -> Path:
    """Copy a model directory trine wrote (a full fine-tuning run's weights: safetensors, config,
    tokenizer, chat template) to `out`, its optimizer state (a subfolder) left behind."""
    src, out = Path(src), Path(out)
    _prepare_out(out)
    for f in sorted(src.iterdir()):
        if f.is_file():
            _copy(f, out / f.name)
    return out


def lora_deltas(adapter_dir: str | Path) -> dict[str, torch.Tensor]:
    """Base weight name (`model.layers.0.self_attn.q_proj.weight`) -> (alpha / r) · B·A, fp32."""
    adapter_dir = Path(adapter_dir)
    lora = read_lora_config(adapter_dir)
    pairs: dict[str, dict[str, torch.Tensor]] = {}
    with safe_open(str(adapter_dir / ADAPTER_WEIGHTS), "pt") as f:
        for key in f.keys():
            module, _, which = key.removeprefix(_PEFT_PREFIX).rpartition(".lora_")
            pairs.setdefault(module + ".weight", {})[which.split(".")[0]] = f.get_tensor(key).float()
    return {name: lora.scale * (p["B"] @ p["A"]) for name, p in pairs.items() if "A" in p and "B" in p}


def export_merged(adapter_dir: str | Path, out: str | Path, base_dir: str | Path | None = None) -> Path:
    """Write base model + adapter merged as a Hugging Face model directory `out`."""
    adapter_dir, out = Path(adapter_dir), Path(out)
    base = Path(base_dir) if base_dir is not None else base_model_dir(adapter_dir)
    if base is None or not (base / "config.json").is_file():
        raise ValueError(f"{adapter_dir}: the base model's directory is unknown here; pass it (--base DIR)")
    deltas = lora_deltas(adapter_dir)
    config = json.loads((base / "config.json").read_text())
    tied = bool(config.get("tie_word_embeddings", True))  # transformers' default for these families
    untie = tied and "lm_head.weight" in deltas
    shards = sorted(base.glob("*.safetensors"))
    if not shards:
        raise ValueError(f"{base} holds no *.safetensors weights")
    _prepare_out(out)
    weight_map: dict[str, str] = {}
    merged = set()
    for shard in shards:
        tensors = {}
        with safe_open(str(shard), "pt") as f:
            metadata = f.metadata() or {}
            for name in f.keys():
                tensors[name] = f.get_tensor(name)
        stored = {text_name(n): n for n in tensors}  # the adapter's names -> this checkpoint's
        if untie and "model.embed_tokens.weight" in stored:
            tensors["lm_head.weight"] = tensors[stored["model.embed_tokens.weight"]].clone()
            stored["lm_head.weight"] = "lm_head.weight"
        for name, delta in deltas.items():
            if name in stored:
                w = tensors[stored[name]]
                if tuple(w.shape) != tuple(delta.shape):
                    raise ValueError(
                        f"{adapter_dir}: the adapter for {name} has shape {tuple(delta.shape)}, "
                        f"the base model's weight is {tuple(w.shape)}"
                    )
                tensors[stored[name]] = (w.float() + delta).to(w.dtype).contiguous()
                merged.add(name)
        tmp = out / f".{shard.name}.tmp"
        save_file(tensors, str(tmp), metadata={**metadata, "format": "pt"})
        _place(tmp, out / shard.name)
        weight_map.update(dict.fromkeys(tensors, shard.name))
    missing = sorted(set(deltas) - merged)
    if missing:
        raise ValueError(
            f"{adapter_dir}: adapted weights {missing[:3]} are not in {base}: "
            "is it the base model this adapter was trained on?"
        )
    if (base / SHARD_INDEX).is_file():
        index = json.loads((base / SHARD_INDEX).read_text())
        _write_json(out / SHARD_INDEX, {**index, "weight_map": weight_map})
    for f in model_files(base):
        _copy(f, out / f.name)
    if untie:
        config["tie_word_embeddings"] = False
        if isinstance(config.get("text_config"), dict):  # a multimodal config says it twice
            config["text_config"]["tie_word_embeddings"] = False
    _write_json(
        out / TRINE_FACTS,
        {
            "base_model": trine_facts(adapter_dir).get("base_model") or base.name,
            "base_model_dir": str(base.resolve()),
            "merged_from": str(adapter_dir),
        },
    )
    _write_json(out / "config.json", config)
    return out
