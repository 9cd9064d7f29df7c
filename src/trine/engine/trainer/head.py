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
from .losses import LossInputs, loss_values, sequence_log_ratios


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


class HeadChunks:
    """The LM head over a micro-batch's scored rows, `chunk` rows at a time: the one loop the plain
    and the shared-prefix paths both run. Entry e (a datum's scored position) reads head row
    `at[e]` with target `tgt[e]`; entries are sorted by row, and several may read one row (a shared
    prefix's position scored by each datum that holds it). `adapters_for(i, j)` is rows [i, j)'s
    adapter batch."""

    def __init__(
        self, model, at: torch.Tensor, tgt: torch.Tensor, rows: int, chunk: int, adapters_for, workspace
    ):
        self.model, self.at, self.tgt, self.chunk = model, at, tgt, chunk
        self.adapters_for, self.workspace = adapters_for, workspace
        cuts = torch.arange(0, rows + chunk, chunk, device=at.device)
        self.bounds = torch.searchsorted(at, cuts).tolist()  # piece k's entries: bounds[k]:bounds[k + 1]

    def score(
        self,
        sel: torch.Tensor,
        losses: list[Loss],
        loss_of,
        inputs: LossInputs,
        scales,
        backward: bool,
        datum_of: torch.Tensor,
        datums: int,
        custom_grad: Callable[[torch.Tensor], torch.Tensor] | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The LM-head loop over `sel` (the scored rows' hidden states): each entry's logprob and
        loss; with `backward`, the gradient gathered for `sel` flows back into it (its graph: the
        body). Each chunk reads its own leaf, so its gradient is exactly that chunk's rows.

        A sequence-level loss (gspo, custom) first needs every entry's logprob (values only):
        `datum_of[e]` (on any device) is entry e's datum among `datums`; `custom_grad(logprobs)`
        gives a custom loss's dC/dlogp from them."""
        train = backward and sel.requires_grad
        pieces = [p.requires_grad_(train) for p in sel.detach().split(self.chunk)] if sel.shape[0] else []
        if pieces and any(loss.sequence_level for loss in losses):
            values = self.target_logprobs(pieces)
            inputs.seq_log_ratio = sequence_log_ratios(values, inputs, datum_of.to(self.at.device), datums)
            if custom_grad is not None and any(loss.custom is not None for loss in losses):
                inputs.custom_grad = custom_grad(values)
        logp_all, loss_all = self.losses(pieces, losses, loss_of, inputs, scales, backward)
        if train and pieces:  # no pieces when no position has a target
            sel.backward(torch.cat([p.grad for p in pieces]))
        return logp_all, loss_all

    def _pieces(self, pieces: list[torch.Tensor], grad: bool):
        for k, hs in enumerate(pieces):
            i, a, b = k * self.chunk, self.bounds[k], self.bounds[k + 1]
            z, push = chunk_log_probs(
                self.model, hs, self.adapters_for(i, i + hs.shape[0]), self.workspace, grad
            )
            loc = self.at[a:b] - i
            yield a, b, loc, z, push

    def target_logprobs(self, pieces: list[torch.Tensor]) -> torch.Tensor:
        """Each entry's log p(target), values only (gspo's and custom losses' first pass)."""
        with torch.no_grad():
            return torch.cat([z[loc, self.tgt[a:b]] for a, b, loc, z, _ in self._pieces(pieces, False)])

    def losses(
        self, pieces, losses: list[Loss], loss_of, inputs: LossInputs, scales, backward: bool
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Each entry's logprob and loss; with `backward`, dLoss/dlogits (summed over the entries of
        a row, scaled by `scales`) pushed into each piece's grad and the head's adapters."""
        n, device = self.at.numel(), self.at.device
        logp_all = torch.empty(n, device=device)
        loss_all = torch.empty(n, device=device)
        for a, b, loc, z, push in self._pieces(pieces, backward):
            tgt = self.tgt[a:b]
            logp = z[loc, tgt]
            loss_t, g = losses_and_grads(
                losses, loss_of[a:b], logp, inputs.select(slice(a, b)), need_grad=backward
            )
            logp_all[a:b], loss_all[a:b] = logp, loss_t
            if push is not None:
                if scales is not None:
                    g = g * scales[a:b]
                total = torch.zeros(z.shape[0], dtype=g.dtype, device=device).index_add_(0, loc, g)
                grad = z.exp_().mul_(-total[:, None])  # in place: z becomes dLoss/dlogits
                grad.index_put_((loc, tgt), g, accumulate=True)
                push(grad)
            del z, push
        return logp_all, loss_all


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

    Plain case (a frozen fp32 head without adapters, kernels not batch-invariant): the logits and
    their log-softmax go into the workspace, and `push` is the head's one input-gradient GEMM.
    Otherwise autograd through `lm_head` (its row-tiled GEMM under `--batch-invariant`, its adapters,
    the gradient of a head a full fine-tuning run trains)."""
    head = model.lm_head
    plain = (
        not invariant.enabled()
        and head.weight.dtype == torch.float32
        and not head.weight.requires_grad
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
