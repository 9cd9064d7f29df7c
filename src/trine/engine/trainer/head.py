"""The trainer's LM head, a chunk of scored positions at a time: each position's loss and its
gradient with respect to the target logprob, and the adapters of a chunk's positions.

Every loss is elementwise in the target logprob (gspo's sequence term is a constant here), so the
gradient of a chunk's logits is known as soon as its logprobs are: the trainer and the shared-prefix
path both push it back through the head at once and never hold the full logits.
"""

from __future__ import annotations

import torch

from ..api import Loss
from ..model.lora import Adapter, AdapterBatch
from .losses import LossInputs, loss_values


def token_spans(adapters: AdapterBatch, counts: list[int]) -> list[tuple[Adapter, int, int]] | None:
    """Row spans of a micro-batch -> spans of its active positions (row r has counts[r] of them).
    None when one adapter (or none) covers every row: then the row-level batch applies as is."""
    if adapters.spans is None:
        assert all(rows is None for _, rows in adapters.groups), "micro-batch rows must be grouped by adapter"
        return None
    starts = [0]
    for c in counts:
        starts.append(starts[-1] + c)
    return [(a, starts[s], starts[e]) for a, s, e in adapters.spans]


def chunk_adapters(spans: list[tuple[Adapter, int, int]], i: int, j: int, device) -> AdapterBatch:
    """The adapter spans of positions [i, j), renumbered from 0."""
    cut = [(a, max(s, i) - i, min(e, j) - i) for a, s, e in spans if s < j and e > i]
    return AdapterBatch([(a, torch.arange(s, e, device=device)) for a, s, e in cut], cut)


def losses_and_grads(
    losses: list[Loss], loss_of: torch.Tensor, logp: torch.Tensor, inputs: LossInputs, need_grad: bool
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Per-token losses and dloss/dlogp for positions whose loss is losses[loss_of[k]]."""
    with torch.enable_grad():
        x = logp.detach().requires_grad_(need_grad)
        if len(losses) == 1:
            out = loss_values(losses[0], x, inputs)
        else:
            out = torch.zeros_like(x)
            for k, loss in enumerate(losses):
                idx = (loss_of == k).nonzero().squeeze(1)
                if idx.numel():
                    out = out.index_put((idx,), loss_values(loss, x[idx], inputs.select(idx)))
        grad = torch.autograd.grad(out.sum(), x)[0] if need_grad else None
    return out.detach(), grad
