"""Full-parameter fine-tuning: a training run that owns a copy of the model and trains its weights.

A LoRA run is an adapter on the shared, frozen base model. A full run (`LoRAConfig.rank` 0) is a
`FullWeights`: its own `Transformer` instance (a copy of the base, or a checkpoint's weights), whose
chosen parameters train. The trainer runs a full run's rows on that instance, alone in their
micro-batches (trainer.py); its sampler snapshots are frozen copies of it (`snapshot`), which the
worker samples with a sampler of their own (runtime/weights_samplers.py).

What trains (`param_group`, by the parameter's Hugging Face name): the attention layers
(`train_attn`), the MLPs (`train_mlp`), the embedding and an untied head (`train_unembed`), the norms
always. `trainable_token_indices` trains the embedding and head at those rows only (for added
tokens): every other row keeps its bits.

Precision: AdamW steps fp32 masters (the wide dtype: fp64 on an fp64 model). A parameter in the wide
dtype that trains whole is its own master. Any other (bf16 weights; the rows of a token-restricted
embedding or head) keeps a master copy: a hook adds each backward's gradient into the master's
fp32 gradient and frees the model-dtype one, and after each step the weight is the master rounded
to the model's dtype (`apply`), so updates below a bf16 ulp accumulate in the master.

On disk (`save`): a Hugging Face model directory (model.safetensors, or shards with their index, in
the model's dtype; config.json, tokenizer and chat template copied from the base model's directory),
which transformers loads as is; `trine_checkpoint.json` records the run's shape. A training state
adds `optimizer/optimizer.safetensors` (AdamW's `exp_avg`, `exp_avg_sq`, `step` and the separate
masters, by parameter name), in a folder so that loaders globbing `*.safetensors` never read it.

Memory: `FullTuningShape.run_bytes` (engine/api.py) counts what a run holds before it starts;
`tuning_shape` measures a model's groups, `available_memory` what the device has free.
"""

from __future__ import annotations

import copy
import functools
import json
import os
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import load_file, save
from torch import nn

from ..api import ADAMW, FullTuningShape, LoRAConfig
from ..model import invariant
from ..model.model import Transformer
from ..model.weights import load_model
from .checkpoint import OPTIMIZER_META, TRINE_FACTS, atomic_write
from .export import SHARD_INDEX, model_files

GROUPS = ("attn", "mlp", "norms", "embed", "head")
UNEMBED = ("embed", "head")
FULL_OPTIMIZER_STATE = "optimizer/optimizer.safetensors"
FULL_FACTS_KEY = "full"  # in trine_checkpoint.json: the run's LoRAConfig (rank 0)
SHARD_BYTES = 5 << 30  # Hugging Face's default shard size
_MASTER = "master"  # optimizer file entries of a separate master copy


def param_group(name: str) -> str:
    """The group a parameter trains with, by its Hugging Face name (see the module docstring)."""
    if "embed_tokens" in name:
        return "embed"
    if name.startswith("lm_head"):
        return "head"
    if ".self_attn." in name or ".linear_attn." in name:
        return "attn"
    if ".mlp." in name:
        return "mlp"
    return "norms"


def trains(group: str, shape: LoRAConfig) -> bool:
    if group in UNEMBED:
        return shape.train_unembed or bool(shape.trainable_token_indices)
    return {"attn": shape.train_attn, "mlp": shape.train_mlp}.get(group, True)


def available_memory(device: torch.device) -> int:
    """Bytes the device has free now: a GPU's free memory, or the host's MemAvailable."""
    if device.type == "cuda":
        return int(torch.cuda.mem_get_info(device)[0])
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def tuning_shape(model: Transformer, budget_bytes: int, snapshot_kv_bytes: int = 0) -> FullTuningShape:
    """`model`'s parameters by group (a tied head is the embedding, counted once) and the budget."""
    counts = dict.fromkeys(GROUPS, 0)
    for name, p in model.named_parameters():
        counts[param_group(name)] += p.numel()
    return FullTuningShape(
        **counts,
        hidden_size=model.cfg.hidden_size,
        dtype_bytes=model.dtype.itemsize,
        budget_bytes=budget_bytes,
        snapshot_kv_bytes=snapshot_kv_bytes,
    )


@dataclass
class Slot:
    """One trained parameter: the model's tensor, what AdamW steps for it, and its rows (None: all)."""

    name: str
    param: nn.Parameter
    master: torch.Tensor  # `param` itself, or its fp32 (wide) copy
    rows: torch.Tensor | None = None


class FullWeights:
    """A full run's own model and the tensors AdamW steps (`masters`). Build it with `fresh` (a copy of
    the base model) or `restore` (a checkpoint's weights, with its masters when it has them)."""

    def __init__(self, model: Transformer, shape: LoRAConfig):
        if not shape.full:
            raise ValueError(f"full fine-tuning needs rank 0, got rank {shape.rank}")
        self.model, self.shape = model, shape
        model.requires_grad_(False)
        rows = None
        if shape.trainable_token_indices:
            rows = torch.tensor(shape.trainable_token_indices, dtype=torch.long, device=model.device)
        self.slots: list[Slot] = []
        for name, p in model.named_parameters():
            group = param_group(name)
            if not trains(group, shape):
                continue
            slot_rows = rows if group in UNEMBED else None
            p.requires_grad_(True)
            wide = invariant.wide_dtype(p.dtype)
            if slot_rows is None and p.dtype == wide:
                master = p
            else:
                src = p.detach() if slot_rows is None else p.detach().index_select(0, slot_rows)
                master = src.to(wide, copy=True).requires_grad_(True)
                p.register_post_accumulate_grad_hook(functools.partial(_into_master, master, slot_rows))
            self.slots.append(Slot(name, p, master, slot_rows))

    @classmethod
    def fresh(cls, base: Transformer, shape: LoRAConfig) -> FullWeights:
        return cls(own_copy(base), shape)

    @classmethod
    def restore(cls, base: Transformer, path: str | Path, shape: LoRAConfig) -> FullWeights:
        """The weights saved at `path` (a full run's checkpoint), checked against `base`'s config;
        its fp32 masters too where it saved separate ones."""
        model = load_model(path, device=base.device, dtype=base.dtype)
        if model.cfg != base.cfg:
            raise ValueError(f"{path}: its config.json describes another model than the base model")
        model.source_dir = base.source_dir
        full = cls(model, shape)
        file = Path(path) / FULL_OPTIMIZER_STATE
        if file.is_file():
            with safe_open(str(file), "pt") as f:
                keys = set(f.keys())
                with torch.no_grad():
                    for s in full.slots:
                        if s.master is not s.param and f"{_MASTER}/{s.name}" in keys:
                            s.master.copy_(f.get_tensor(f"{_MASTER}/{s.name}"))
        return full

    @property
    def masters(self) -> list[torch.Tensor]:
        return [s.master for s in self.slots]

    def new_optimizer(self) -> torch.optim.Optimizer:
        """AdamW over the masters; hyperparameters come with each step. The fused kernel steps each
        tensor in one pass, with no temporaries the size of the weights (the foreach form makes
        several)."""
        return torch.optim.AdamW(self.masters, lr=0.0, fused=True)

    def fill_grads(self) -> None:
        """Before a step: a zero gradient for each master that has none (none is held between a step
        and the next backward, so a step's peak is not the gradients' bytes above the activations),
        so a step without a preceding forward_backward still decays and applies momentum."""
        for s in self.slots:
            if s.master.grad is None:
                s.master.grad = torch.zeros_like(s.master)

    def apply(self) -> None:
        """After a step: each weight with a separate master becomes that master in its dtype."""
        with torch.no_grad():
            for s in self.slots:
                if s.master is s.param:
                    continue
                if s.rows is None:
                    s.param.copy_(s.master)
                else:
                    s.param.index_copy_(0, s.rows, s.master.to(s.param.dtype))

    def snapshot(self) -> Transformer:
        """A frozen copy of the weights now (model dtype), which the trainer never changes."""
        snap = copy.deepcopy(self.model)  # Parameter deepcopy clones the data, not .grad or hooks
        snap.requires_grad_(False)
        return snap

    # ------------------------------------------------------------------ checkpoints
    def save_weights(self, path: str | Path, base_model: str) -> int:
        """The weights as a Hugging Face model directory at `path`; bytes written."""
        facts = full_facts(base_model, self.model.source_dir, self.shape)
        return write_weights(self.model, Path(path), facts)

    def save_state(self, path: str | Path, base_model: str, optimizer: torch.optim.Optimizer) -> int:
        """The weights, then AdamW's state and the separate masters; bytes written."""
        path = Path(path)
        written = self.save_weights(path, base_model)
        tensors = {}
        for s in self.slots:
            for name, value in optimizer.state.get(s.master, {}).items():
                value = torch.as_tensor(value)
                if name == "step":
                    value = value.to(torch.float32).reshape(1)
                tensors[f"{name}/{s.name}"] = value.detach().cpu().contiguous()
            if s.master is not s.param:
                tensors[f"{_MASTER}/{s.name}"] = s.master.detach().cpu().contiguous()
        (path / FULL_OPTIMIZER_STATE).parent.mkdir(parents=True, exist_ok=True)
        data = save(tensors, metadata={OPTIMIZER_META: ADAMW})
        return written + atomic_write(path / FULL_OPTIMIZER_STATE, data)

    def load_optimizer(self, optimizer: torch.optim.Optimizer, path: str | Path) -> None:
        """AdamW's state saved by `save_state` into `optimizer` (over this run's masters)."""
        file = Path(path) / FULL_OPTIMIZER_STATE
        if not file.is_file():
            raise ValueError(
                f"{path} holds no optimizer state ({FULL_OPTIMIZER_STATE}); it is a sampler "
                "checkpoint: load it without the optimizer"
            )
        tensors = load_file(str(file))
        for s in self.slots:
            if f"step/{s.name}" not in tensors:
                continue
            state = {"step": tensors[f"step/{s.name}"].reshape(()).clone()}
            for name in ("exp_avg", "exp_avg_sq"):
                value = tensors.get(f"{name}/{s.name}")
                if value is None or value.shape != s.master.shape:
                    got = None if value is None else tuple(value.shape)
                    raise ValueError(
                        f"{file}: optimizer state {name} for {s.name} has shape {got}, "
                        f"the run needs {tuple(s.master.shape)}"
                    )
                state[name] = value.to(s.master.device, s.master.dtype)
            optimizer.state[s.master] = state


def full_facts(base_model: str, base_dir: Path | None, shape: LoRAConfig) -> dict:
    """What trine_checkpoint.json records of a full run's checkpoint: the served model's name, its
    directory, and the run's shape (which marks the directory as a full run's)."""
    return {
        "base_model": base_model,
        "base_model_dir": str(base_dir) if base_dir else None,
        FULL_FACTS_KEY: asdict(shape),
    }


def _into_master(master: torch.Tensor, rows: torch.Tensor | None, param: torch.Tensor) -> None:
    """A post-accumulate-grad hook: the weight's gradient (its rows) into the master's, in fp32."""
    grad = param.grad if rows is None else param.grad.index_select(0, rows)
    if master.grad is None:
        master.grad = grad.to(master.dtype, copy=True)
    else:
        master.grad.add_(grad.to(master.dtype))
    param.grad = None


def own_copy(base: Transformer) -> Transformer:
    """A copy of `base` with weights of its own (tied weights stay tied, buffers are copied)."""
    model = copy.deepcopy(base)
    model.source_dir = base.source_dir
    return model


def is_full_checkpoint(path: str | Path) -> bool:
    """Whether `path` holds a full run's weights (a model directory trine wrote) rather than a LoRA
    adapter."""
    facts = Path(path) / TRINE_FACTS
    return facts.is_file() and FULL_FACTS_KEY in json.loads(facts.read_text())


def read_full_shape(path: str | Path) -> LoRAConfig:
    """The shape (rank 0 and its flags) a full run's checkpoint recorded."""
    facts = json.loads((Path(path) / TRINE_FACTS).read_text())
    shape = dict(facts[FULL_FACTS_KEY])
    shape["trainable_token_indices"] = tuple(shape.get("trainable_token_indices") or ())
    return LoRAConfig(**shape)


def hf_state(model: Transformer) -> dict[str, torch.Tensor]:
    """The model's tensors under Hugging Face's names (a tied head is not stored: the embedding is)."""
    state = model.state_dict()
    if model.cfg.tie_word_embeddings:
        state.pop("lm_head.weight", None)
    return state


def write_weights(model: Transformer, path: Path, facts: dict, shard_bytes: int = SHARD_BYTES) -> int:
    """`model` as a Hugging Face model directory at `path`: its weights in shards of at most
    `shard_bytes` (one file when they fit, else with an index), the base model's config, tokenizer
    and chat template (from `model.source_dir`), and `facts` as trine_checkpoint.json. Bytes written."""
    path.mkdir(parents=True, exist_ok=True)
    state = hf_state(model)
    shards: list[list[str]] = [[]]
    size = 0
    for name, t in state.items():
        nbytes = t.numel() * t.element_size()
        if shards[-1] and size + nbytes > shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append(name)
        size += nbytes
    names = (
        ["model.safetensors"]
        if len(shards) == 1
        else [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))]
    )
    written, weight_map = 0, {}
    for file, keys in zip(names, shards):
        # copies of their own: a snapshot a sampler fused holds views of one tensor, which
        # safetensors refuses; one shard at a time is held twice
        tensors = {k: state[k].detach().to("cpu", copy=True).contiguous() for k in keys}
        written += atomic_write(path / file, save(tensors, metadata={"format": "pt"}))
        weight_map.update(dict.fromkeys(keys, file))
        del tensors
    if len(shards) > 1:
        total = sum(t.numel() * t.element_size() for t in state.values())
        index = {"metadata": {"total_size": total}, "weight_map": weight_map}
        written += atomic_write(path / SHARD_INDEX, json.dumps(index, indent=2).encode())
    base = model.source_dir
    config = json.loads((Path(base) / "config.json").read_text()) if base else {}
    for key in ("torch_dtype", "dtype"):
        if key in config:
            config[key] = str(model.dtype).removeprefix("torch.")
    for f in model_files(Path(base)) if base else ():
        written += atomic_write(path / f.name, f.read_bytes())
    written += atomic_write(path / TRINE_FACTS, json.dumps(facts, indent=2).encode())
    return written + atomic_write(path / "config.json", json.dumps(config, indent=2).encode())
