"""LoRA: low-rank adapters on a model's linear layers, many of them mixed in one batch.

`LoRALinear` is the model's linear layer: `nn.Linear` whose output adds `scale * B(A(x))` for the
rows of each adapter in the batch. An `Adapter` holds one adapter's A and B matrices for every
targeted layer; an `AdapterBatch` says which batch rows use which adapter.

Invariants
- Adapters are *not* submodules of the model: each forward receives an `AdapterBatch`. Rows in no
  group run the plain base model. The base weights are never modified, so many adapters can be
  resident and mixed in one batch.
- Target names are PEFT's (`q_proj`, ..., `lm_head`), so adapters export and load as PEFT's.
- A new adapter is the identity on the base model (B starts at zero); its parameters are fp32
  (fp64 on an fp64 model, the tests' rounding reference: `invariant.wide_dtype`).
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass, field

import torch
from torch import nn

from ..api import LoRAConfig
from . import invariant
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


def linear_shapes(model: nn.Module) -> list[tuple[int, int]]:
    """The base-weight shapes (out, in) the model's inference forward multiplies, for the GEMM choice
    (kernels/gemm.py): each FusedLinears group's as one (its members' outputs stacked: inference
    weights are always fused), and each other LoRALinear's."""
    return sorted(linear_shape_counts(model))


def linear_shape_counts(model: nn.Module) -> dict[tuple[int, int], int]:
    """`linear_shapes`, each with how many GEMMs of that shape one forward runs (one per layer for
    a layer's projections, one for the LM head): the weights of a whole forward's GEMM time."""
    counts: dict[tuple[int, int], int] = {}
    members = set()
    for mod in model.modules():
        for group in vars(mod).values():
            if isinstance(group, FusedLinears):
                fused = [getattr(mod, n) for n in group.names]
                members.update(map(id, fused))
                shape = (sum(m.out_features for m in fused), fused[0].in_features)
                counts[shape] = counts.get(shape, 0) + 1
    for mod in model.modules():
        if isinstance(mod, LoRALinear) and id(mod) not in members:
            shape = (mod.out_features, mod.in_features)
            counts[shape] = counts.get(shape, 0) + 1
    return counts


class Adapter(nn.Module):
    """One LoRA adapter: for each targeted linear (by its full module name), A [r, in] and B [out, r].

    B starts at zero, so a new adapter is the identity on the base model. Parameters are fp32, or
    fp64 on an fp64 model.
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
                dtype = invariant.wide_dtype(mod.weight.dtype)
                a = torch.empty(config.rank, mod.in_features)
                nn.init.kaiming_uniform_(a, a=math.sqrt(5), generator=gen)  # PEFT's init for A
                key = name.replace(".", "__")
                self.A[key] = nn.Parameter(a.to(device, dtype))
                b = torch.zeros(mod.out_features, config.rank, device=device, dtype=dtype)
                self.B[key] = nn.Parameter(b)

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

    _flat: dict = field(default_factory=dict, repr=False, compare=False)  # flat(), per row count

    def flat(self, per_row: int) -> "AdapterBatch":
        """The same adapters for the batch with each row flattened into `per_row` consecutive rows
        (a [B, T, ...] batch seen as [B * T, ...])."""
        if per_row == 1 or not self.groups:
            return self
        got = self._flat.get(per_row)
        if got is None:

            def expand(rows):
                return (rows[:, None] * per_row + torch.arange(per_row, device=rows.device)).reshape(-1)

            groups = [(a, None if rows is None else expand(rows)) for a, rows in self.groups]
            spans = None if self.spans is None else [(a, s * per_row, e * per_row) for a, s, e in self.spans]
            got = self._flat[per_row] = AdapterBatch(groups, spans)
        return got

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
        rows = x.reshape(-1, x.shape[-1])  # 2-D, so a delta can be added by the GEMM itself (addmm_)
        out = linear(rows, self.weight, self.bias, owner=self)
        if adapters:
            out = self.add_adapters(rows, out, adapters.flat(_per_row(x)))
        return out.view(*x.shape[:-1], out.shape[-1])

    def add_adapters(
        self, x: torch.Tensor, out: torch.Tensor, adapters: AdapterBatch | None, inplace: bool = True
    ) -> torch.Tensor:
        """`out` [rows, out] (this layer's base output for `x` [rows, in]) plus the adapters'
        deltas: added in place when `out` is fresh (linear's backward does not read it, so no
        copies of it are made per adapter), out of place when it is a slice autograd may not
        modify (`FusedLinears`). One adapter on every row is added by one `addmm_`, unless the
        kernels are batch-invariant (their row-tiled GEMMs then compute the delta)."""
        if not adapters or not adapters.groups:
            return out
        # The scale multiplies the rank-r intermediate, not the wide output.
        if adapters.spans is not None:
            return self._add_spans(x, out, adapters.spans, inplace)
        for adapter, rows in adapters.groups:
            pair = adapter.pair(self.lora_name)
            if pair is None:
                continue
            a, b = pair
            if rows is None and inplace and _folds(out, a):
                out.addmm_(linear(x, a) * adapter.scale, b.t())
                continue
            xs = x if rows is None else x.index_select(0, rows)
            delta = linear(linear(xs.to(a.dtype), a) * adapter.scale, b).to(out.dtype)
            if rows is None:
                out = out.add_(delta) if inplace else out + delta
            else:
                out = out.index_add_(0, rows, delta) if inplace else out.index_add(0, rows, delta)
        return out

    def _add_spans(self, x: torch.Tensor, out: torch.Tensor, spans, inplace: bool) -> torch.Tensor:
        delta = span_deltas(x, out, spans, self._pair)
        if delta is None:
            return out
        return out.add_(delta) if inplace else out + delta

    def _pair(self, adapter: Adapter) -> tuple[torch.Tensor, torch.Tensor, float] | None:
        pair = adapter.pair(self.lora_name)
        return None if pair is None else (*pair, adapter.scale)


def span_deltas(x: torch.Tensor, out: torch.Tensor, spans, pair_of) -> torch.Tensor | None:
    """The deltas of adapters on contiguous row ranges of `x` [rows, in], as one [rows, out] tensor
    (zeros on rows no adapter covers), or None when no span has a pair: split x, one delta per
    piece, one cat. Backward is one split and one cat too (narrowing or in-place adds on views
    would copy the full gradient once per adapter). `pair_of(adapter)` gives (A, B, scale) or None."""
    sizes, pairs, pos = [], [], 0
    for adapter, start, stop in sorted(spans, key=lambda s: s[1]):
        if start > pos:
            sizes.append(start - pos)
            pairs.append(None)
        sizes.append(stop - start)
        pairs.append(pair_of(adapter))
        pos = stop
    if pos < x.shape[0]:
        sizes.append(x.shape[0] - pos)
        pairs.append(None)
    if all(p is None for p in pairs):
        return None
    deltas = []
    for xs, pair in zip(x.split(sizes), pairs):
        if pair is None:
            deltas.append(out.new_zeros(xs.shape[:-1] + out.shape[-1:]))
            continue
        a, b, scale = pair
        deltas.append(linear(linear(xs.to(a.dtype), a) * scale, b).to(out.dtype))
    return torch.cat(deltas)


class FusedLinears:
    """LoRALinear layers that read the same input (q/k/v, gate/up), computed with one GEMM.

    Fewer, wider GEMMs: on a CPU a decode step's linear layers have a few dozen rows, where a call's
    fixed cost and a narrow weight's poor blocking dominate. With one adapter on every row, the
    members' deltas are one more GEMM added in place (`_stacked`: their A matrices stacked, their
    B matrices block-diagonal); otherwise each member adds its own adapters' deltas to its slice
    of the output. Either way LoRA targets keep PEFT's per-layer names.

    Invariants
    - The members stay ordinary `LoRALinear` modules with their own parameters (state dicts, LoRA
      targets and exports are unchanged). Fusing makes their weights (and biases) consecutive row
      ranges of one tensor, in place of their own storage, so the model holds each weight once.
    - Fused or not, each member's output is `linear(x, W_i, b_i)` plus its adapters' deltas. A
      member whose storage was replaced (`.to()`, assigning a weight; `load_state_dict` copies into
      the views and keeps them) is re-fused at the next call. Base weights that require grad (a
      caller training them) are never fused: the plain per-member path keeps their gradients.
    - The group holds the members' names, not the modules, so deep copies and device moves of the
      owner never leave it pointing at stale modules.
    """

    def __init__(self, *names: str):
        self.names = names

    def __call__(
        self, owner: nn.Module, x: torch.Tensor, adapters: AdapterBatch | None
    ) -> list[torch.Tensor]:
        members = [getattr(owner, n) for n in self.names]
        fused = _fused(members)
        if fused is None:
            return [m(x, adapters) for m in members]
        weight, bias = fused
        if adapters:
            adapters = adapters.flat(_per_row(x))
        lead, x = x.shape[:-1], x.reshape(-1, x.shape[-1])
        out = linear(x, weight, bias, owner=self)
        sizes = [m.out_features for m in members]
        outs = None
        if adapters and adapters.groups and not invariant.enabled():  # the members' deltas at once
            stacked = functools.partial(_stacked, members, out)
            if adapters.spans is not None:  # one adapter per contiguous row range
                delta = span_deltas(x, out, adapters.spans, stacked)
                outs = (out if delta is None else out.add_(delta)).split(sizes, dim=-1)
            elif adapters.groups[0][1] is None and (one := stacked(adapters.groups[0][0])) is not None:
                a, b, scale = one  # one adapter on every row: one addmm_ (when dtypes agree)
                if _folds(out, a):
                    outs = out.addmm_(linear(x, a) * scale, b.t()).split(sizes, dim=-1)
        if outs is None:
            # autograd forbids in-place changes to the views `split` returns: training adds out of place
            inplace = not torch.is_grad_enabled()
            parts = out.split(sizes, dim=-1)
            outs = [m.add_adapters(x, o, adapters, inplace) for m, o in zip(members, parts)]
        return [o.view(*lead, o.shape[-1]) for o in outs]


def _per_row(x: torch.Tensor) -> int:
    """Rows of the flattened [-1, in] view per row of x's first dim."""
    return x[0].numel() // x.shape[-1] if x.dim() > 2 and x.shape[0] else 1


def _folds(out: torch.Tensor, a: torch.Tensor) -> bool:
    """A delta may be added to `out` by addmm_: same dtype, and the kernels not batch-invariant."""
    return out.dtype == a.dtype and not invariant.enabled()


def _stacked(
    members: list[LoRALinear], out: torch.Tensor, adapter: Adapter
) -> tuple[torch.Tensor, torch.Tensor, float] | None:
    """An adapter's pairs on `members` as one: A stacked [sum(r), in] and B block-diagonal
    [sum(out), sum(r)] (a member without a pair gets a zero-width block), so x A^T B^T is every
    member's delta side by side. None when it has no pair on them."""
    pairs = [adapter.pair(m.lora_name) for m in members]
    present = [p for p in pairs if p is not None]
    if not present:
        return None
    a = torch.cat([p[0] for p in present]) if len(present) > 1 else present[0][0]
    blocks = [p[1] if p is not None else out.new_zeros(m.out_features, 0) for m, p in zip(members, pairs)]
    return a, torch.block_diag(*blocks), adapter.scale


def _fused(members: list[LoRALinear]) -> tuple[torch.Tensor, torch.Tensor | None] | None:
    """The members' weights and biases as one [sum(out), in] weight and [sum(out)] bias, sharing
    their storage (fused now if they are not yet); None if any of them requires grad."""
    weights = [m.weight for m in members]
    biases = [m.bias for m in members]
    if any(w.requires_grad for w in weights) or any(b is not None and b.requires_grad for b in biases):
        return None
    if not (_consecutive(weights) and (biases[0] is None or _consecutive(biases))):
        _fuse(members)
        weights, biases = [m.weight for m in members], [m.bias for m in members]
    rows = sum(w.shape[0] for w in weights)
    weight = weights[0].detach().as_strided((rows, weights[0].shape[1]), weights[0].stride())
    bias = None if biases[0] is None else biases[0].detach().as_strided((rows,), (1,))
    return weight, bias


def _consecutive(tensors: list[torch.Tensor]) -> bool:
    """Contiguous tensors laid out one after another in one storage."""
    first = tensors[0]
    ptr, at = first.untyped_storage().data_ptr(), first.storage_offset()
    for t in tensors:
        if not t.is_contiguous() or t.untyped_storage().data_ptr() != ptr or t.storage_offset() != at:
            return False
        at += t.numel()
    return True


def _fuse(members: list[LoRALinear]) -> None:
    """Copy the members' weights (and biases) into one tensor and make each member's a view of it.
    Outside inference mode, so the fused tensors serve training forwards too."""
    with torch.inference_mode(False), torch.no_grad():
        for attr in ("weight", "bias"):
            params = [getattr(m, attr) for m in members]
            if params[0] is None:
                continue
            whole = torch.cat([p.detach() for p in params])
            for p, view in zip(params, whole.split([p.shape[0] for p in params])):
                p.data = view
