"""A training run's optimizer: its construction, its family, and the checks on a step's settings.

A LoRA run is stepped by one of the families of `api.OPTIMIZERS`: `torch.optim.AdamW` (ADAMW) or
`Dimuon` (DIMUON, dimuon.py), chosen when the run is made and fixed for its life. A full
fine-tuning run's AdamW is built by its weights (`FullWeights.new_optimizer`, full.py).

Invariants
- The hyperparameters come with each step (`AdamConfig`, `DimuonConfig`), never from construction:
  AdamW is built with lr 0, Dimuon with only the LoRA rank its learning-rate correction needs.
- Every parameter `new_optimizer` hands its optimizer requires a gradient and starts with a zero
  one, so a step without a preceding forward_backward still decays and applies momentum.
- `optimizer_family` names the family an optimizer was built as: DIMUON for a `Dimuon`, else ADAMW.
"""

from __future__ import annotations

import torch

from ...limits import ADAM_BOUNDS, check_adam_value
from ..api import ADAMW, DIMUON, OPTIMIZERS, AdamConfig
from ..model.lora import Adapter
from .dimuon import Dimuon


def new_optimizer(adapter: Adapter, family: str, rank: int) -> torch.optim.Optimizer:
    """The `family` optimizer over the adapter; hyperparameters come with each step. Gradients start
    as zeros, so a step without a preceding forward_backward still decays and applies momentum."""
    if family not in OPTIMIZERS:
        raise ValueError(f"optimizer {family!r} is not supported; use one of {', '.join(OPTIMIZERS)}")
    params = list(adapter.parameters())
    for p in params:
        p.requires_grad_(True)
        p.grad = torch.zeros_like(p)
    if family == DIMUON:
        return Dimuon(params, rank)
    return torch.optim.AdamW(params, lr=0.0, foreach=True)


def optimizer_family(optimizer: torch.optim.Optimizer) -> str:
    return DIMUON if isinstance(optimizer, Dimuon) else ADAMW


def check_adam(adam: AdamConfig) -> None:
    """Raise ValueError unless every AdamW setting of a step is a finite number in its range."""
    for name in ADAM_BOUNDS:
        check_adam_value(name, getattr(adam, name))
