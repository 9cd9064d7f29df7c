"""Which kernels an engine's forwards take, decided and built once at the engine's start.

`active(device, dtype, shapes, gemm)` builds the C kernels (cbuild.py: compiled now, or loaded from
the cache, rather than at the first step that needs them) and chooses the GEMM kernels
(gemm_choice.py: measured now, or read from the cache), for the engine that will run on `device`
in `dtype` with base weights of `shapes`, and names the path each op takes:
- `fused_ops`: RMSNorm and RoPE of inference forwards, `C` (fused.py) or `torch`;
- `paged_attention`: decode attention, `C` reading the KV pool in place (paged_attention.py) or
  `gather` (SDPA over a copy);
- `gemm`: few-row base-weight GEMMs of inference forwards, `auto(packed 20, onednn 8, ...)` (how
  many shape and row-bucket pairs each candidate won in the engine's dtype, gemm.py), a forced
  candidate's name, or `F.linear` where no candidate applies;
- `delta_rule`: the decode step of a hybrid model's linear-attention layers, `C` (delta_rule.py:
  the layer after its input projections in one call, or the rule alone, updating the states in
  place) or `torch`;
- `fused_train`: RMSNorm and SwiGLU of the trainer's forwards with their backward, `C`
  (fused_train.py) or `torch`.

Invariants
- Each op's own check (`suits` / `few_rows`) still decides per call, on the same conditions, so
  building early changes no result: only when the build happens.
- The C kernels are built only where they can run: CPU fp32 or bf16 with torch's batch-invariant
  kernels off (`batch_invariant` names them all `invariant` otherwise). GEMMs are measured for CPU fp32
  and bf16 engines (gemm.DTYPES), with the same kernels off and `packed.budget_bytes()` above 0;
  each dtype's choice is installed for that dtype alone.
"""

from __future__ import annotations

import torch

from .. import invariant
from . import delta_rule, fused, fused_train, gemm_choice, packed, paged_attention
from .gemm import DTYPES as GEMM_DTYPES


def active(
    device: torch.device, dtype: torch.dtype, shapes: list[tuple[int, int]] = (), gemm: str = "auto"
) -> dict[str, str]:
    """Build what applies to an engine on `device` in `dtype` and name each op's path (above)."""
    if invariant.enabled():
        return dict(
            fused_ops="invariant",
            paged_attention="invariant",
            gemm="invariant",
            delta_rule="invariant",
            fused_train="invariant",
        )
    measured = device.type == "cpu" and dtype in GEMM_DTYPES and packed.budget_bytes() > 0
    return dict(
        fused_ops="C" if device.type == "cpu" and dtype in fused.DTYPES and fused.built() else "torch",
        paged_attention="C"
        if device.type == "cpu" and dtype in paged_attention.DTYPES and paged_attention.available()
        else "gather",
        gemm=gemm_choice.choose(list(shapes), gemm, dtype) if measured else "F.linear",
        delta_rule="C" if device.type == "cpu" and delta_rule.built() else "torch",
        fused_train="C"
        if device.type == "cpu" and dtype in fused_train.DTYPES and fused_train.built()
        else "torch",
    )


def startup_line(
    kernels: dict[str, str], device: torch.device, dtype: torch.dtype, dtype_note: str = ""
) -> str:
    """The engine's start log line: the active kernels (`active()`), then the dtype (with how it was
    chosen: `forced`, or `--dtype auto`'s reason, dtype_choice.py) and torch's threads."""
    named = " ".join(f"{k}={v}" for k, v in kernels.items())
    dtype_name = str(dtype).removeprefix("torch.") + (f" ({dtype_note})" if dtype_note else "")
    return f"kernels {named} device={device} dtype={dtype_name} threads={torch.get_num_threads()}"
