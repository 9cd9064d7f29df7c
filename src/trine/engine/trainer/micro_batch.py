"""The trainer's rows and its plain micro-batches: how the datums that share no prefix are cut into
micro-batches and computed (shared prefixes: shared_prefix.py).

A `Row` is one datum of a forward_backward call, prepared (`losses.datum_tensors`) and tied to its
batch entry, its run's adapter (or a full run's model), its loss and its gradient scale (1 / the
entry's denominator, `grad_scale`).

How a micro-batch is computed
1. Rows are sorted by length and grouped so rows x longest row <= `micro_batch_tokens` (padding
   included); a longer sequence runs alone (`micro_batches`). Within a micro-batch the rows of one
   run are adjacent, so each LoRA layer handles a run's rows as one slice (`AdapterBatch.spans`).
2. The body runs once with autograd, giving final hidden states h.
3. Only positions with a target (not -100) go through the LM head, `logits_chunk_tokens` at a time.
   Because every loss is elementwise in the target logprob, dLoss/dlogits = g * (onehot - softmax)
   with g = dloss/dlogp is known right away: each chunk's softmax is computed in place, turned into
   that gradient and pushed back through the LM head at once. Two [chunk, vocab] fp32 buffers
   (the logits and their log-softmax, invariant.log_probs: the sampler's logprobs) hold a chunk;
   the full logits are never stored. Without an adapter on lm_head they are the trainer's kept
   workspace (head.LogitsWorkspace), reused by every chunk and call.
4. The gradient gathered for h flows back through the body in one backward call.

Custom losses (a client's graph, custom_graph.py) are not elementwise: the micro-batch computes its
datums' logprobs first (values only), runs each datum's graph on them for the loss and its gradient
dC/dlogp (`custom_grads`), and step 3 then uses that gradient, so the body runs forward and backward
once. Each graph is first run on all-zero logprobs with the datum's inputs (`custom_dry_run`, when
the rows are made), so a graph that cannot run fails before anything computes.

Invariants
- `run_micro_batch` fills logps[r] and losses[r] at row r's active positions only; with
  backward=False no gradient changes.
- A custom graph that passed its dry run but fails on the real logprobs gives its datum no
  gradient and records the error on its row; the other rows of the micro-batch are unaffected.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from ...tokens import TokenCounts
from ..api import Loss
from ..model import invariant
from ..model.lora import Adapter, AdapterBatch
from ..model.model import Transformer
from . import custom_graph, head
from .losses import LossInputs, PreparedDatum


@dataclass
class Row:
    entry: int  # index into the forward_backward batch
    datum: PreparedDatum
    counts: TokenCounts
    adapter: Adapter | None
    loss: Loss
    grad_scale: float = 1.0  # 1 / the entry's denominator
    custom: custom_graph.Result | None = None  # a custom loss's value and metrics on this datum
    error: str = ""  # why its custom loss failed on the real logprobs (the datum then adds no gradient)
    weights: Transformer | None = None  # a full run's model (None: the base model)


def grad_scale(denominator, where: str) -> float:
    """1 / an op's `denominator` (1.0 for None, the plain sum); ValueError unless it is a finite
    number >= 1."""
    if denominator is None:
        return 1.0
    if (
        isinstance(denominator, bool)
        or not isinstance(denominator, (int, float))
        or not math.isfinite(denominator)
        or denominator < 1
    ):
        raise ValueError(
            f"{where} denominator must be a finite number >= 1 (or None for the plain sum), "
            f"got {denominator!r}"
        )
    return 1.0 / float(denominator)


def custom_dry_run(loss: Loss, datum: PreparedDatum, where: str) -> custom_graph.Result:
    """The loss on all-zero logprobs: a graph that fails on this datum's inputs fails here, naming
    it, before any gradient moves. Its value is the datum's when no position has a target."""
    try:
        return custom_graph.loss_and_grad(loss.custom, torch.zeros(len(datum)), datum.custom)
    except ValueError as e:
        raise custom_graph.CustomLossError(f"{where}: {e}") from None


def custom_grads(rows: list[Row], logps: tuple[torch.Tensor, ...]) -> torch.Tensor:
    """dC/dlogp at each active position of `rows` (0 for rows of other losses); keeps each custom
    row's value and metrics on the row. A graph that passed its dry run but fails on the real
    logprobs (indices computed from them) gives its datum no gradient and an error that fails its
    entry; the other rows of the micro-batch, other runs' included, are unaffected."""
    out = []
    for row, logp in zip(rows, logps):
        if row.loss.custom is None:
            out.append(torch.zeros_like(logp))
            continue
        active = row.datum.active.to(logp.device)
        full = torch.zeros(len(row.datum), device=logp.device).index_put_((active,), logp.float())
        inputs = [t.to(logp.device) for t in row.datum.custom]
        try:
            row.custom = custom_graph.loss_and_grad(row.loss.custom, full, inputs)
        except ValueError as e:  # value-dependent (the dry run passed): fail this datum's entry only
            row.error = str(e)
            out.append(torch.zeros_like(logp))
            continue
        out.append(row.custom.grad[active])
    return torch.cat(out)


def micro_batches(rows: list[Row], micro_batch_tokens: int) -> list[list[int]]:
    """Rows by decreasing length, cut so rows x longest <= micro_batch_tokens; within a micro-batch
    the rows of one adapter are contiguous (so LoRA runs on views, see AdapterBatch.spans)."""
    order = sorted(range(len(rows)), key=lambda i: -len(rows[i].datum))
    batches: list[list[int]] = []
    for i in order:  # a micro-batch's first row is its longest
        if batches and (len(batches[-1]) + 1) * len(rows[batches[-1][0]].datum) <= micro_batch_tokens:
            batches[-1].append(i)
        else:
            batches.append([i])
    first_seen = {}
    for row in rows:
        first_seen.setdefault(id(row.adapter), len(first_seen))
    return [sorted(mb, key=lambda i: first_seen[id(rows[i].adapter)]) for mb in batches]


def run_micro_batch(
    trainer, rows: list[Row], logps: list[torch.Tensor], losses: list[torch.Tensor], backward: bool
) -> None:
    """Forward (and backward when `backward`) of one micro-batch of `rows` on `trainer.model`; fills
    logps[r] / losses[r] of each row r at its active positions."""
    model, device = trainer.model, trainer.model.device
    B, T = len(rows), max(len(row.datum) for row in rows)
    tokens = torch.zeros(B, T, dtype=torch.long)
    targets = torch.zeros(B, T, dtype=torch.long)
    pad_mask = torch.zeros(B, T, dtype=torch.bool)
    for r, row in enumerate(rows):
        n = len(row.datum)
        tokens[r, :n] = row.datum.tokens
        targets[r, :n] = row.datum.targets
        pad_mask[r, :n] = True
    # Active positions (a real target), row-major, with their row, loss and loss inputs.
    active = torch.cat([row.datum.active + r * T for r, row in enumerate(rows)])
    counts = [row.datum.active.numel() for row in rows]
    row_of = torch.repeat_interleave(torch.arange(B), torch.tensor(counts))
    losses_in_mb = list(dict.fromkeys(row.loss for row in rows))
    loss_of = torch.tensor([losses_in_mb.index(row.loss) for row in rows])[row_of].to(device)
    inputs = LossInputs.cat([row.datum.inputs.select(row.datum.active) for row in rows]).to(device)
    tgt = targets.reshape(-1)[active].to(device)
    scales = head.position_scales(
        [row.grad_scale for row in rows], row_of, invariant.wide_dtype(model.dtype), device
    )

    adapters = AdapterBatch.from_rows([row.adapter for row in rows], device=device)
    tokens = tokens.to(device)
    with torch.set_grad_enabled(backward):
        body = trainer.inputs(tokens, [row.datum.images for row in rows])
        h = model.hidden_states(tokens, adapters=adapters, pad_mask=pad_mask.to(device), **body)
        sel = h.reshape(B * T, -1).index_select(0, active.to(device))
    token_spans = head.token_spans(adapters, counts)
    chunks = head.HeadChunks(
        model,
        torch.arange(active.numel(), device=device),  # each scored position read once, in order
        tgt,
        active.numel(),
        trainer.logits_chunk_tokens,
        lambda i, j: adapters if token_spans is None else head.chunk_adapters(token_spans, i, j, device),
        trainer._workspace,
    )
    logp_all, loss_all = chunks.score(
        sel,
        losses_in_mb,
        loss_of,
        inputs,
        scales,
        backward,
        row_of,
        B,
        custom_grad=lambda values: custom_grads(rows, values.split(counts)),
    )
    for r, part_logp, part_loss in zip(range(B), logp_all.split(counts), loss_all.split(counts)):
        idx = rows[r].datum.active
        logps[r][idx] = part_logp.detach().float().cpu()
        losses[r][idx] = part_loss.detach().float().cpu()
