"""LoRA: low-rank adapters on a model's linear layers, many of them mixed in one batch.

`LoRALinear` is the model's linear layer: `nn.Linear` whose output adds `scale * B(A(x))` for the
rows of each adapter in the batch. An `Adapter` holds one adapter's A and B matrices for every
targeted layer; an `AdapterBatch` says which batch rows use which adapter.

Invariants
- Adapters are *not* submodules of the model: each forward receives an `AdapterBatch`. Rows in no
  group run the plain base model. The base weights are never modified, so many adapters can be
  resident and mixed in one batch.
- Target names are PEFT's (`q_proj`, ..., `lm_head`), so adapters export and load as PEFT's.
- A new adapter is the identity on the base model (B starts at zero); its parameters are fp32.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
from torch import nn

from ..api import LoRAConfig
from .invariant import linear


def lora_features(model: nn.Module) -> dict[str, int]:
    """Per LoRA target name, in + out features summed over the layers: a rank-r adapter on targets
    T holds r x sum(features[t] for t in T) fp32 parameters."""
    out: dict[str, int] = {}
    for name, mod in model.named_modules():
        if isinstance(mod, LoRALinear):
            target = name.rsplit(".", 1)[-1]
            out[target] = out.get(target, 0) + mod.in_features + mod.out_features
    return out


class Adapter(nn.Module):
    """One LoRA adapter: for each targeted linear (by its full module name), A [r, in] and B [out, r].

    B starts at zero, so a new adapter is the identity on the base model. Parameters are fp32.
    """

    def __init__(self, model: nn.Module, config: LoRAConfig, device=None):
        super().__init__()
        self.config = config
        self.scale = config.scale
        gen = torch.Generator().manual_seed(config.seed or 0)
        self.A = nn.ParameterDict()
        self.B = nn.ParameterDict()
        targets = set(config.target_names())
        for name, mod in model.named_modules():
            if isinstance(mod, LoRALinear) and name.rsplit(".", 1)[-1] in targets:
                a = torch.empty(config.rank, mod.in_features)
                nn.init.kaiming_uniform_(a, a=math.sqrt(5), generator=gen)  # PEFT's init for A
                key = name.replace(".", "__")
                self.A[key] = nn.Parameter(a.to(device))
                self.B[key] = nn.Parameter(torch.zeros(mod.out_features, config.rank, device=device))

    def pair(self, name: str):
        key = name.replace(".", "__")
        if key in self.A:
            return self.A[key], self.B[key]
        return None

    def module_names(self) -> list[str]:
        return [k.replace("__", ".") for k in self.A.keys()]


@dataclass
class AdapterBatch:
    """Which batch rows (dim 0) use which adapter. Rows in no group use the base model alone."""

    groups: list[tuple[Adapter, torch.Tensor | None]] = field(default_factory=list)  # None = all rows
    # Optional, same information: when each group's rows are one contiguous range [start, stop),
    # LoRALinear works on views of those rows instead of gathering and scattering them.
    spans: list[tuple[Adapter, int, int]] | None = None

    @classmethod
    def single(cls, adapter: Adapter | None) -> "AdapterBatch":
        return cls([(adapter, None)] if adapter is not None else [])

    @classmethod
    def from_rows(cls, row_adapters: list[Adapter | None], device=None) -> "AdapterBatch":
        """Group rows by adapter; put rows of one adapter next to each other to get `spans`."""
        if all(a is row_adapters[0] for a in row_adapters):
            return cls.single(row_adapters[0])
        groups: dict[int, tuple[Adapter, list[int]]] = {}
        for i, a in enumerate(row_adapters):
            if a is not None:
                groups.setdefault(id(a), (a, []))[1].append(i)
        contiguous = all(rows[-1] - rows[0] + 1 == len(rows) for _, rows in groups.values())
        spans = [(a, rows[0], rows[-1] + 1) for a, rows in groups.values()] if contiguous else None
        return cls([(a, torch.tensor(rows, device=device)) for a, rows in groups.values()], spans)


class LoRALinear(nn.Linear):
    """nn.Linear whose output adds `scale * B(A(x))` for the rows of each adapter in the batch."""

    lora_name: str = ""  # its full module name in the model (set by the model), the adapters' key

    def forward(self, x: torch.Tensor, adapters: AdapterBatch | None = None) -> torch.Tensor:
        out = linear(x, self.weight, self.bias)
        if not adapters or not adapters.groups:
            return out
        # In place: `out` is fresh and linear's backward does not read it, so no copies of it are
        # made per adapter. The scale multiplies the rank-r intermediate, not the wide output.
        if adapters.spans is not None:
            return self._add_spans(x, out, adapters.spans)
        for adapter, rows in adapters.groups:
            pair = adapter.pair(self.lora_name)
            if pair is None:
                continue
            a, b = pair
            xs = x if rows is None else x.index_select(0, rows)
            delta = linear(linear(xs.to(a.dtype), a) * adapter.scale, b).to(out.dtype)
            out = out.add_(delta) if rows is None else out.index_add_(0, rows, delta)
        return out

    def _add_spans(self, x: torch.Tensor, out: torch.Tensor, spans) -> torch.Tensor:
        """Contiguous row ranges: split x, one delta per piece, one cat. Backward is one split and one
        cat too (narrowing or in-place adds on views would copy the full gradient once per adapter)."""
        sizes, owners, pos = [], [], 0
        for adapter, start, stop in sorted(spans, key=lambda s: s[1]):
            if start > pos:
                sizes.append(start - pos)
                owners.append(None)
            sizes.append(stop - start)
            owners.append(adapter if adapter.pair(self.lora_name) is not None else None)
            pos = stop
        if pos < x.shape[0]:
            sizes.append(x.shape[0] - pos)
            owners.append(None)
        if all(o is None for o in owners):
            return out
        deltas = []
        for xs, adapter in zip(x.split(sizes), owners):
            if adapter is None:
                deltas.append(out.new_zeros(xs.shape[:-1] + out.shape[-1:]))
                continue
            a, b = adapter.pair(self.lora_name)
            deltas.append(linear(linear(xs.to(a.dtype), a) * adapter.scale, b).to(out.dtype))
        return out.add_(torch.cat(deltas))
