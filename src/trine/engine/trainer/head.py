"""The trainer's LM head, a chunk of scored positions at a time: each position's loss and its
gradient with respect to the target logprob, and the adapters of a chunk's positions.

Every loss is elementwise in the target logprob (gspo's sequence term is a constant here), so the
gradient of a chunk's logits is known as soon as its logprobs are: the trainer and the shared-prefix
path both push it back through the head at once and never hold the full logits.
"""

from __future__ import annotations

from typing import Callable

import torch

from ..api import Loss
from ..model import invariant
from ..model.invariant import log_probs
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


def position_scales(
    grad_scales: list[float], of_position: torch.Tensor, dtype: torch.dtype, device
) -> torch.Tensor | None:
    """Each scored position's gradient scale (1 / its entry's denominator), `of_position` naming its
    row; None when every scale is 1. In the logits' `dtype`, so an fp64 model's are not fp32's."""
    if all(s == 1.0 for s in grad_scales):
        return None
    return torch.tensor(grad_scales, dtype=dtype)[of_position].to(device)


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


class LogitsWorkspace:
    """Two [rows, vocab] fp32 buffers the head reuses across chunks, micro-batches and calls.

    A chunk's logits and their log-softmax are the largest tensors a step makes (200 MB each for a
    49K vocabulary at 1024 rows). Allocated fresh, the OS maps their pages anew each time (glibc
    serves blocks this large with mmap and unmaps them on free): about 100K page faults a chunk,
    a tenth of a step on a CPU. Kept, they stay resident between steps.
    """

    def __init__(self):
        self._buffers: list[torch.Tensor | None] = [None, None]

    def take(self, slot: int, rows: int, cols: int, device: torch.device) -> torch.Tensor:
        buf = self._buffers[slot]
        if buf is None or buf.device != device or buf.shape[1] != cols or buf.shape[0] < rows:
            self._buffers[slot] = buf = None  # freed before its successor is made
            buf = self._buffers[slot] = torch.empty(rows, cols, device=device)
        return buf[:rows]


def chunk_log_probs(
    model, hs: torch.Tensor, adapters: AdapterBatch, workspace: LogitsWorkspace, grad: bool
) -> tuple[torch.Tensor, Callable[[torch.Tensor], None] | None]:
    """log-softmax [rows, vocab] of the LM head's logits for hidden states `hs` (a leaf), and when
    `grad` asks for it and anything upstream trains, `push(d)`: dLoss/dlogits `d` back into
    `hs.grad` and the head's adapters. The result may live in `workspace` until the next call.

    Plain case (fp32 head without adapters, kernels not batch-invariant): the logits and their
    log-softmax go into the workspace, and `push` is the head's one input-gradient GEMM. Otherwise
    autograd through `lm_head` (its row-tiled GEMM under `--batch-invariant`, its adapters)."""
    head = model.lm_head
    plain = (
        not invariant.enabled()
        and head.weight.dtype == torch.float32
        and head.bias is None
        and not any(a.pair(head.lora_name) is not None for a, _ in adapters.groups)
    )
    if not plain:
        with torch.set_grad_enabled(grad):
            logits = invariant.widened(head(hs, adapters))
        z = log_probs(logits.detach())
        return z, (logits.backward if grad and logits.requires_grad else None)
    rows, device = hs.shape[0], hs.device
    logits = torch.mm(hs.detach(), head.weight.t(), out=workspace.take(0, rows, head.out_features, device))
    z = log_probs(logits, out=workspace.take(1, rows, head.out_features, device))
    if not (grad and hs.requires_grad):
        return z, None

    def push(d: torch.Tensor) -> None:
        hs.grad = d.mm(head.weight)  # what autograd's linear backward computes for the input

    return z, push
