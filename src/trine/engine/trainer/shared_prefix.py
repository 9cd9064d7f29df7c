"""One training micro-batch of prefix-sharing trees (prefix_groups.py): each shared token computed once.

How it is computed
1. Slots: every position the micro-batch computes gets one slot, segment after segment in pass
   order. Per attention layer, a flat K/V pool of that many slots holds each position's keys and values
   (after RoPE), written by the pass that computes the position (`KVContext`, as the sampler's
   prefix cache does).
2. One pass of the body per tree depth: the segments of depth d are the rows (right padded; split
   into passes of similar lengths when they differ widely, `_length_groups`, siblings never
   reading each other). A
   row's queries attend to its ancestors' keys and to its own, read from the pool in position
   order (key index = position), with positions continuing from its parent's end; the mask is
   causal by position. Autograd records the pool's writes and reads, so the gradients that all
   children send into an ancestor's keys and values are summed there and flow back through the
   ancestor's pass once, in one backward call. A micro-batch of single-segment trees
   (multi-turn chains, duplicates) needs no pool: one causal pass over each tree's longest datum.
   A hybrid model's (qwen3_5.py) linear-attention layers read no keys: their recurrent state is
   the whole of a row's past. A root's pass starts from the zero state; each segment with children
   keeps its row's state at its end (conv and recurrent, `HybridState`), and its children's pass
   starts from it, so autograd sums the children's gradients into that state as into the
   parent's keys and values. Only the attention layers have pools.
3. The LM head runs once per scored position (a target other than -100), however many datums
   score it (a GRPO prompt position, an earlier turn of a multi-turn chain): each datum reads its
   own target's logprob from that position's log-softmax and its loss uses its own weights /
   logprobs / advantages; dLoss/dlogits there is the sum over those datums of
   g * (onehot(target) - softmax), g = dloss/dlogp (times the datum's 1/denominator).

Exactness: a position's hidden state depends only on the tokens at positions <= its own (causal
attention), and those are the same for every datum that reads it. With the batch-invariant
kernels (invariant.py) each row's keys sit at index = position as in the plain path, so hidden
states and logprobs are bit for bit the plain path's; without them they differ in the last bits
(SDPA picks another kernel for an explicit mask). Gradients are the same sums, added in another order.
A hybrid model's child runs its linear layers' chunked rule from its parent's state, with chunks
counted from its own first token, where the plain path's chunks run on from position 0: the same
rule cut in other places, equal within fp32 rounding (gated_deltanet.py's invariant), bit for bit
only where the layer's form does not depend on the cuts.

Images: datums share a prefix only where their images are the same (prefix_groups sees each image
position as its content hash and offset, `images.keyed_tokens`), so a segment's multimodal
positions and features are those of any datum through it, and a GRPO group over one image
computes the image's positions once.
"""

from __future__ import annotations

import torch

from ..model import invariant
from ..model.attention import KVContext
from ..model.lora import AdapterBatch
from ..model.qwen3_5 import HybridConfig, HybridState
from .head import HeadChunks, chunk_adapters, position_scales
from .losses import LossInputs
from .prefix_groups import Tree


def run_micro_batch(
    trainer,
    rows: list,
    trees: list[Tree],
    logps: list[torch.Tensor],
    losses: list[torch.Tensor],
    backward: bool,
) -> None:
    """Forward (and backward when `backward`) of the datums of `trees`; `rows` are the trainer's
    `Row`s (micro_batch.py) of the whole call (tree members index them); fills logps[i] / losses[i]
    of each member."""
    model, device = trainer.model, trainer.model.device
    # ---- slots, segment by segment in pass order (depth, then tree, then segment)
    order = sorted(((s.depth, t, k) for t, tree in enumerate(trees) for k, s in enumerate(tree.segments)))
    base: dict[tuple[int, int], int] = {}
    slot_key: list[torch.Tensor] = []  # per segment: its tree's rank (adapter) for each slot
    n = 0
    for _, t, k in order:
        base[t, k] = n
        seg = trees[t].segments[k]
        slot_key.append(torch.full((seg.end - seg.start,), t, dtype=torch.long))
        n += seg.end - seg.start
    cfg = model.cfg
    depths = sorted({d for d, _, _ in order})
    # Only children read the pool: a micro-batch of single-segment trees (multi-turn chains) is
    # the plain causal forward of each tree's longest datum.
    pools = (
        [
            torch.zeros(n, cfg.num_kv_heads, cfg.head_dim, dtype=model.dtype, device=device)
            for _ in range(2 * len(cfg.attention_layers))
        ]
        if len(depths) > 1
        else None
    )
    # A hybrid model's segments with children: their rows' recurrent state at the segment's end
    # (one row each), what each child's pass starts from.
    end_states: dict[tuple[int, int], HybridState] | None = (
        {} if pools is not None and isinstance(cfg, HybridConfig) else None
    )
    parents = {(t, s.parent) for t, tree in enumerate(trees) for s in tree.segments if s.parent >= 0}
    # ---- the body, one pass per depth (several when its segments' lengths differ widely)
    hidden, slots_of = [], []
    with torch.set_grad_enabled(backward):
        for depth in depths:
            level = [(t, k) for d, t, k in order if d == depth]
            for group in _length_groups(level, trees):
                h, real, state = _pass(trainer, rows, trees, group, base, pools, device, end_states)
                for r, tk in enumerate(group) if state is not None else ():
                    if tk in parents:
                        end_states[tk] = state.rows(slice(r, r + 1))
                hidden.append(h.reshape(-1, h.shape[-1]).index_select(0, real))
                slots_of += [base[t, k] + torch.arange(_length(trees[t].segments[k])) for t, k in group]
        states = torch.cat(hidden) if len(hidden) > 1 else hidden[0]
        by_slot = torch.cat(slots_of)
        if not bool((by_slot[1:] > by_slot[:-1]).all()):  # groups out of slot order: put them back
            states = states.index_select(0, torch.argsort(by_slot).to(device))  # [n, hidden], by slot

    # ---- scored positions: one entry per (datum, active position), pointing at a slot
    members = sorted(i for tree in trees for i, _ in tree.members)
    local = {i: r for r, i in enumerate(members)}
    entry_slot = [None] * len(members)
    for t, tree in enumerate(trees):
        for i, seg in tree.members:
            length = len(rows[i].datum)
            spans = []
            for k in tree.path(seg):
                s = tree.segments[k]
                spans.append(torch.arange(base[t, k], base[t, k] + min(s.end, length) - s.start))
            entry_slot[local[i]] = torch.cat(spans)[rows[i].datum.active]
    counts = [rows[i].datum.active.numel() for i in members]
    slots = torch.cat(entry_slot)
    if slots.numel() == 0:
        return
    # Positions through the LM head: each scored slot once, those of one adapter adjacent.
    tree_of_slot = torch.cat(slot_key)
    used = torch.unique(slots)
    used = used[torch.argsort(tree_of_slot[used] * n + used)]
    rank = torch.empty(n, dtype=torch.long)
    rank[used] = torch.arange(used.numel())
    at = rank[slots]  # each entry's row in `sel`
    perm = torch.argsort(at, stable=True)  # entries by LM-head row
    at = at[perm]
    datum_of = torch.repeat_interleave(torch.arange(len(members)), torch.tensor(counts))
    losses_in_mb = list(dict.fromkeys(rows[i].loss for i in members))
    loss_of = torch.tensor([losses_in_mb.index(rows[i].loss) for i in members])[datum_of][perm].to(device)
    inputs = LossInputs.cat([rows[i].datum.inputs.select(rows[i].datum.active) for i in members])
    inputs = inputs.select(perm).to(device)
    tgt = torch.cat([rows[i].datum.targets[rows[i].datum.active] for i in members])[perm].to(device)
    scales = position_scales(
        [rows[i].grad_scale for i in members], datum_of[perm], invariant.wide_dtype(model.dtype), device
    )
    adapter_of_tree = [rows[tree.members[0][0]].adapter for tree in trees]
    spans = _adapter_spans(adapter_of_tree, tree_of_slot[used])
    one = AdapterBatch.single(adapter_of_tree[0]) if spans is None else None

    sel = states.index_select(0, used.to(device))
    chunks = HeadChunks(
        model,
        at.to(device),
        tgt,
        used.numel(),
        trainer.logits_chunk_tokens,
        lambda i, j: one if spans is None else chunk_adapters(spans, i, j, device),
        trainer._workspace,
    )
    logp_all, loss_all = chunks.score(
        sel, losses_in_mb, loss_of, inputs, scales, backward, datum_of[perm], len(members)
    )
    out_logp = torch.empty_like(logp_all)
    out_loss = torch.empty_like(loss_all)
    out_logp[perm.to(device)], out_loss[perm.to(device)] = logp_all, loss_all
    for r, part_logp, part_loss in zip(range(len(members)), out_logp.split(counts), out_loss.split(counts)):
        i = members[r]
        logps[i][rows[i].datum.active] = part_logp.detach().float().cpu()
        losses[i][rows[i].datum.active] = part_loss.detach().float().cpu()


PAD_BOUND = 1.25  # a pass may compute at most this many positions per real one...
MIN_PASS_POSITIONS = 512  # ...once it holds this many (fewer rows make small, slow GEMMs)


def _length(seg) -> int:
    return seg.end - seg.start


def _length_groups(level: list[tuple[int, int]], trees: list[Tree]) -> list[list[tuple[int, int]]]:
    """`level`'s segments in passes of similar length, longest first, each right padded to its
    longest: a GRPO group's completions (a few tokens to hundreds) padded to the longest of 64 would
    compute about twice the positions they hold. A pass grows while its padded positions stay
    within PAD_BOUND of its real ones, or while it holds fewer than MIN_PASS_POSITIONS."""
    ranked = sorted(level, key=lambda tk: -_length(trees[tk[0]].segments[tk[1]]))
    groups: list[list[tuple[int, int]]] = []
    real = 0
    for tk in ranked:
        m = _length(trees[tk[0]].segments[tk[1]])
        if groups:
            longest = _length(trees[groups[-1][0][0]].segments[groups[-1][0][1]])
            padded = longest * (len(groups[-1]) + 1)
            if padded <= PAD_BOUND * (real + m) or longest * len(groups[-1]) < MIN_PASS_POSITIONS:
                groups[-1].append(tk)
                real += m
                continue
        groups.append([tk])
        real = m
    return groups


def _pass(trainer, rows, trees, level, base, pools, device, end_states):
    """The body over the segments `level` (one depth): returns hidden states [R, T, hidden], the
    flat indices of their real (unpadded) positions, in slot order, and, given `end_states` (a
    hybrid model's recurrent state at the end of each parent segment, by (tree, segment)), the
    rows' recurrent state after their segments (else None). A segment of a datum with images runs
    on its positions' multimodal RoPE and features (`Trainer.inputs`); keys stay at index = position."""
    model = trainer.model
    segs = [trees[t].segments[k] for t, k in level]
    R, T = len(level), max(s.end - s.start for s in segs)
    L = max(s.end for s in segs)
    tokens = torch.zeros(R, T, dtype=torch.long)
    positions = torch.zeros(R, T, dtype=torch.long)
    write = torch.full((R, T), -1, dtype=torch.long)
    read = torch.zeros(R, L, dtype=torch.long)
    ends = torch.empty(R, dtype=torch.long)
    real = []
    for r, ((t, k), s) in enumerate(zip(level, segs)):
        m = s.end - s.start
        tokens[r, :m] = rows[s.source].datum.tokens[s.start : s.end]
        positions[r] = s.start + torch.arange(T)
        write[r, :m] = base[t, k] + torch.arange(m)
        read[r, : s.end] = torch.cat(
            [
                base[t, p] + torch.arange(trees[t].segments[p].end - trees[t].segments[p].start)
                for p in trees[t].path(k)
            ]
        )
        ends[r] = s.end
        real.append(r * T + torch.arange(m))
    adapters = AdapterBatch.from_rows([rows[trees[t].members[0][0]].adapter for t, _ in level], device=device)
    tokens = tokens.to(device)
    inputs = trainer.inputs(tokens, [rows[s.source].datum.images for s in segs], [s.start for s in segs])
    if pools is None:  # depth 0 only: positions 0..T-1, causal attention within each row
        pad_mask = (write >= 0).to(device)
        h = model.hidden_states(tokens, adapters=adapters, pad_mask=pad_mask, **inputs)
        return h, torch.cat(real).to(device), None
    key = torch.arange(L)
    # causal by position; a padded query sees its row's real keys (its output is dropped)
    mask = (key[None, None, :] <= positions[:, :, None]) & (key[None, None, :] < ends[:, None, None])
    kv = KVContext(pools[0::2], pools[1::2], write.to(device), read.to(device), mask[:, None].to(device))
    state = None
    if end_states is not None:  # a root starts from the zero state, a child from its parent's end
        zero = HybridState.zeros(model.cfg, 1, device, model.dtype)
        state = HybridState.cat(
            [end_states[t, s.parent] if s.parent >= 0 else zero for (t, _), s in zip(level, segs)]
        )
    if state is not None:
        inputs["state"] = state
    h = model.hidden_states(tokens, adapters=adapters, kv=kv, **inputs)
    return h, torch.cat(real).to(device), state


def _adapter_spans(adapter_of_tree, tree_of_row: torch.Tensor):
    """Spans [(adapter, start, stop)] of LM-head rows by adapter (rows of one adapter are adjacent),
    or None when one adapter covers them all."""
    adapters = [adapter_of_tree[t] for t in tree_of_row.tolist()]
    if all(a is adapters[0] for a in adapters):
        return None
    spans, start = [], 0
    for r in range(1, len(adapters) + 1):
        if r == len(adapters) or adapters[r] is not adapters[start]:
            spans.append((adapters[start], start, r))
            start = r
    return spans
