"""LoRA checkpoints on disk: PEFT-format adapters, plus optimizer state for training checkpoints.

A checkpoint is a directory:
- `adapter_model.safetensors`: PEFT keys (`base_model.model.<module>.lora_A.weight`, A [r, in],
  B [out, r]); its safetensors metadata also records trine's full `LoRAConfig` (seed included).
- `adapter_config.json`: PEFT's LoraConfig and only PEFT's keys, so `peft.PeftModel.from_pretrained`
  loads it (`base_model_name_or_path` is the base model's directory when known).
- `trine_checkpoint.json`: what trine adds: the served model's name (`base_model`), its directory.
- `optimizer.safetensors` (training checkpoints only): the optimizer's state per parameter under
  the same PEFT keys (AdamW: `exp_avg`, `exp_avg_sq`, `step`; Dimuon: `momentum`, `step`), the
  family in its metadata (`trine_optimizer`; absent in older files, which hold AdamW state).

Invariants
- Every file is written with `atomic_write` (temp file in the same directory, fsync, rename, fsync
  of the directory): a crash mid-write leaves the previous file intact and no partial file behind.
- `adapter_config.json` is written last, so a directory that has one also has its weights.
- A whole checkpoint directory is written with `save_dir` (a sibling temp directory, then moved
  into place): the old one stays complete until the new one replaces it.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import uuid
from dataclasses import asdict
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import load_file, save

from ..api import ADAMW, DIMUON, LORA_ATTN, LORA_LINEAR_ATTN, LORA_MLP, LORA_UNEMBED, LoRAConfig
from ..model.lora import Adapter
from ..model.model import Transformer

ADAPTER_WEIGHTS = "adapter_model.safetensors"
ADAPTER_CONFIG = "adapter_config.json"
OPTIMIZER_STATE = "optimizer.safetensors"
OPTIMIZER_META = "trine_optimizer"  # the family of the state in optimizer.safetensors
_STATE_NAMES = {ADAMW: ("exp_avg", "exp_avg_sq"), DIMUON: ("momentum",)}  # besides `step`
_PREFIX = "base_model.model."
TRINE_FACTS = "trine_checkpoint.json"  # trine's own facts, kept out of PEFT's config
BASE_MODEL_NAME = "trine_base_model"  # where checkpoints before trine_checkpoint.json kept the model's name


def atomic_write(path: str | Path, data: bytes) -> int:
    """Write `data` to `path` so readers see the old file or the new one, never a mix. Returns bytes."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp-{uuid.uuid4().hex}")
    try:
        with open(tmp, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    dir_fd = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(dir_fd)
    finally:
        os.close(dir_fd)
    return len(data)


def replace_dir(tmp: Path, final: Path) -> None:
    """Move the fully written directory `tmp` to `final`, replacing any old one (crash-safe: the
    old directory stays complete until the new one is in place)."""
    trash = None
    if final.exists():
        trash = final.with_name(f".{final.name}.old-{uuid.uuid4().hex}")
        os.replace(final, trash)
    os.replace(tmp, final)
    if trash is not None:
        shutil.rmtree(trash, ignore_errors=True)


def save_dir(final: Path, write) -> int:
    """Run `write(tmp_dir) -> bytes` into a sibling temp directory, then move it into place."""
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = final.with_name(f".{final.name}.tmp-{uuid.uuid4().hex}")
    try:
        size = write(tmp)
        replace_dir(tmp, final)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return size


def adapter_bytes(adapter: Adapter) -> int:
    return sum(p.numel() * p.element_size() for p in adapter.parameters())


def peft_key(module: str, which: str) -> str:
    """`model.layers.0.self_attn.q_proj`, "A" -> PEFT's saved key for that LoRA matrix."""
    return f"{_PREFIX}{module}.lora_{which}.weight"


def adapter_state(adapter: Adapter) -> dict[str, torch.Tensor]:
    """The adapter's tensors under PEFT keys, contiguous fp32 on CPU."""
    out = {}
    for module in adapter.module_names():
        a, b = adapter.pair(module)
        out[peft_key(module, "A")] = a.detach().float().cpu().contiguous()
        out[peft_key(module, "B")] = b.detach().float().cpu().contiguous()
    return out


def save_peft_adapter(
    adapter: Adapter,
    lora: LoRAConfig,
    path: str | Path,
    base_model: str,
    base_model_dir: str | Path | None = None,
) -> int:
    """Write `adapter` as a PEFT LoRA adapter directory at `path`. Returns the bytes written.

    `base_model_name_or_path` is the base model's directory when known (`base_model_dir`), so
    `AutoPeftModelForCausalLM.from_pretrained(path)` loads it on this machine without a hub;
    the served model's name is kept apart in `trine_checkpoint.json`."""
    return save_peft_tensors(adapter_state(adapter), lora, path, base_model, base_model_dir)


def save_peft_tensors(
    state: dict[str, torch.Tensor],
    lora: LoRAConfig,
    path: str | Path,
    base_model: str,
    base_model_dir: str | Path | None = None,
    source: str = "",
) -> int:
    """`save_peft_adapter` for tensors already under PEFT keys (fp32, contiguous, on the CPU);
    `source` (an imported adapter's origin) goes to trine_checkpoint.json."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    facts = {"base_model": base_model, "base_model_dir": str(base_model_dir) if base_model_dir else None}
    if source:
        facts["source"] = source
    config = {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": str(base_model_dir) if base_model_dir else base_model,
        "r": lora.rank,
        "lora_alpha": lora.alpha,
        "lora_dropout": 0.0,
        "bias": "none",
        # the modules the tensors adapt (a hybrid model's linear-attention projections too)
        "target_modules": sorted({k.split(".lora_")[0].rsplit(".", 1)[-1] for k in state}),
        "fan_in_fan_out": False,
        "use_rslora": False,
        "inference_mode": True,
        "init_lora_weights": True,
        "modules_to_save": None,
    }
    meta = {"trine_lora": json.dumps(asdict(lora))}
    written = atomic_write(path / ADAPTER_WEIGHTS, save(state, metadata=meta))
    written += atomic_write(path / TRINE_FACTS, json.dumps(facts, indent=2).encode())
    return written + atomic_write(path / ADAPTER_CONFIG, json.dumps(config, indent=2).encode())


def trine_facts(path: str | Path) -> dict:
    """What trine recorded beside a checkpoint's PEFT config: `base_model` (the served model's name)
    and `base_model_dir` (read from `adapter_config.json` for checkpoints written before the file)."""
    path = Path(path)
    if (path / TRINE_FACTS).is_file():
        return json.loads((path / TRINE_FACTS).read_text())
    cfg = json.loads((path / ADAPTER_CONFIG).read_text()) if (path / ADAPTER_CONFIG).is_file() else {}
    return {"base_model": cfg.get(BASE_MODEL_NAME), "base_model_dir": None}


def read_lora_config(path: str | Path) -> LoRAConfig:
    """The LoRAConfig of a checkpoint directory (trine's own record, else derived from PEFT's config)."""
    path = Path(path)
    cfg_file, weights = path / ADAPTER_CONFIG, path / ADAPTER_WEIGHTS
    if not cfg_file.is_file() or not weights.is_file():
        raise ValueError(f"{path} is not a LoRA checkpoint: it needs {ADAPTER_CONFIG} and {ADAPTER_WEIGHTS}")
    with safe_open(str(weights), "pt") as f:
        meta = f.metadata() or {}
    if "trine_lora" in meta:
        return LoRAConfig(**json.loads(meta["trine_lora"]))
    cfg = json.loads(cfg_file.read_text())
    if cfg.get("peft_type", "LORA") != "LORA":
        raise ValueError(f"{cfg_file}: peft_type {cfg.get('peft_type')!r} is not LORA")
    if cfg.get("bias", "none") != "none" or cfg.get("fan_in_fan_out") or cfg.get("modules_to_save"):
        raise ValueError(
            f"{cfg_file}: only plain LoRA is supported (bias 'none', no fan_in_fan_out, no modules_to_save)"
        )
    targets = cfg.get("target_modules") or []
    targets = [targets] if isinstance(targets, str) else list(targets)
    names = {t.rsplit(".", 1)[-1] for t in targets}
    attn = LORA_ATTN + LORA_LINEAR_ATTN  # a hybrid model's two kinds of attention
    unsupported = sorted(names - set(attn + LORA_MLP + LORA_UNEMBED))
    if unsupported:
        raise ValueError(
            f"{cfg_file}: target_modules {unsupported} are not supported "
            f"(LoRA targets: {', '.join(attn + LORA_MLP + LORA_UNEMBED)})"
        )
    rank, alpha = int(cfg["r"]), float(cfg["lora_alpha"])
    if cfg.get("use_rslora"):
        alpha = alpha * math.sqrt(rank)  # rsLoRA scales by alpha / sqrt(r); ours by alpha / r
    return LoRAConfig(
        rank=rank,
        alpha=alpha,
        train_attn=bool(names & set(attn)),
        train_mlp=bool(names & set(LORA_MLP)),
        train_unembed=bool(names & set(LORA_UNEMBED)),
    )


def load_peft_adapter(model: Transformer, path: str | Path) -> tuple[Adapter, LoRAConfig]:
    """Load a PEFT LoRA adapter directory for `model`.

    An adapter that targets only some modules of a group (say q_proj and v_proj) loads exactly: the
    group's other modules get B = 0, which adds nothing.
    """
    path = Path(path)
    lora = read_lora_config(path)
    state = load_file(str(path / ADAPTER_WEIGHTS))
    adapter = Adapter(model, lora, device=model.device)
    expected = {peft_key(m, w) for m in adapter.module_names() for w in "AB"}
    unexpected = sorted(set(state) - expected)
    if unexpected:
        raise ValueError(
            f"{path / ADAPTER_WEIGHTS}: keys {unexpected[:3]} do not match this model's LoRA "
            f"modules (expected keys like {peft_key('model.layers.0.self_attn.q_proj', 'A')})"
        )
    with torch.no_grad():
        for module in adapter.module_names():
            a, b = adapter.pair(module)
            ka, kb = peft_key(module, "A"), peft_key(module, "B")
            if ka not in state or kb not in state:
                b.zero_()
                continue
            for param, key in ((a, ka), (b, kb)):
                if tuple(state[key].shape) != tuple(param.shape):
                    raise ValueError(
                        f"{path / ADAPTER_WEIGHTS}: {key} has shape {tuple(state[key].shape)}, "
                        f"this model needs {tuple(param.shape)}"
                    )
                param.copy_(state[key])
    return adapter, lora


def save_optimizer_state(
    adapter: Adapter, optimizer: torch.optim.Optimizer, path: str | Path, family: str = ADAMW
) -> int:
    """Write the optimizer state of `adapter`'s parameters to `path/optimizer.safetensors`: every tensor
    of each parameter's state (AdamW: `exp_avg`, `exp_avg_sq`, `step`; Dimuon: `momentum`, `step`)
    as `<name>/<PEFT key>`, and the optimizer family in the file's metadata."""
    tensors = {}
    for module in adapter.module_names():
        for which, param in zip("AB", adapter.pair(module)):
            state = optimizer.state.get(param)
            if not state:
                continue
            key = peft_key(module, which)
            for name, value in state.items():
                value = torch.as_tensor(value)
                if name == "step":
                    value = value.to(torch.float32).reshape(1)
                tensors[f"{name}/{key}"] = value.detach().float().cpu().contiguous()
    return atomic_write(Path(path) / OPTIMIZER_STATE, save(tensors, metadata={OPTIMIZER_META: family}))


def optimizer_state_family(path: str | Path) -> str:
    """The optimizer family whose state a checkpoint holds (files written before Dimuon: AdamW)."""
    with safe_open(str(Path(path) / OPTIMIZER_STATE), "pt") as f:
        return (f.metadata() or {}).get(OPTIMIZER_META, ADAMW)


def load_optimizer_state(
    adapter: Adapter, optimizer: torch.optim.Optimizer, path: str | Path, family: str = ADAMW
) -> None:
    """Restore what `save_optimizer_state` wrote into a fresh `family` optimizer over `adapter`'s
    parameters; a state of another family is refused, naming both."""
    file = Path(path) / OPTIMIZER_STATE
    if not file.is_file():
        raise ValueError(
            f"{path} holds no optimizer state ({OPTIMIZER_STATE}); it is a sampler checkpoint: "
            "load it without the optimizer"
        )
    saved = optimizer_state_family(path)
    if saved != family:
        raise ValueError(
            f"{path} holds {saved} optimizer state and this run trains with {family}: load it "
            f"without the optimizer, or into a run made with the {saved} optimizer"
        )
    names = _STATE_NAMES[family]
    tensors = load_file(str(file))
    for module in adapter.module_names():
        for which, param in zip("AB", adapter.pair(module)):
            key = peft_key(module, which)
            if f"step/{key}" not in tensors:
                continue
            state = {"step": tensors[f"step/{key}"].reshape(()).clone()}
            for name in names:
                value = tensors.get(f"{name}/{key}")
                if value is None or value.shape != param.shape:
                    shape = None if value is None else tuple(value.shape)
                    raise ValueError(
                        f"{file}: optimizer state {name} for {key} has shape {shape}, "
                        f"the adapter needs {tuple(param.shape)}"
                    )
                state[name] = value.to(param.device, param.dtype)
            optimizer.state[param] = state


def by_uri(message: str, path, uri: str) -> str:
    """`message` with a checkpoint's server path replaced by its URI: clients never see paths."""
    return message.replace(str(path), uri) if path else message
