"""A hybrid model's recurrent state in the sampler: one slot per live sequence, and the prefix
cache's snapshots of it (Qwen3.5's Gated DeltaNet layers: model/gated_deltanet.py).

A dense model's cached prefix is its KV blocks. A hybrid model's is its attention layers' KV
blocks *and* its linear layers' state after the prefix's last token, and that state cannot be
rewound: the state after 100 tokens says nothing exact about the state after 90. So a prefix is
reusable only where its state was kept: a *snapshot* (conv + recurrent state of every linear layer)
taken at the prefix's end. The sampler keeps them where reuse happens:
- after `len(prompt) - 1` tokens (what a request's cacheable part is: its last token is always
  computed), so a group's samples, and separate requests of one prompt, prefill it once;
- after all but a finished sequence's last token (the KV it leaves cached), so a chat's next turn
  computes only its new tokens;
- every `state_snapshot_tokens` tokens of a prompt, so prompts that share a long system prompt
  share its aligned part.

Layout. One preallocated pool per linear layer, `conv` [slots, conv_dim, K - 1] and `recurrent`
[slots, Hv, Dk, Dv]: the first `running_slots` slots hold live requests' and sequences' states (one
per prompt being prefilled, one per sample once forked), the rest hold snapshots. A forward reads
its rows' states by slot and writes them back (`SlotState`), layer by layer.

Snapshots live with KV blocks, as prompt scores do (kv_cache.py's `Block.states`): a block keyed in
the prefix cache holds the snapshots taken after its first m tokens (m = block_size at a full
block's end, fewer inside a tail). A lookup walks the block chain as the dense cache does (full
blocks, then the best partial block) and serves the longest prefix that ends at a snapshot and is
no longer than what the request may read from the cache (`hit`). The snapshot's state is copied into
the request's slot; the KV of the prefix is shared or copied as for a dense model.

Budget and eviction. Snapshots take `state_cache_bytes` (`SamplerConfig`): as many slots as fit,
each `state_bytes` (every linear layer's conv + recurrent state). When all are taken, a new one
evicts the least recently used (taken or served) snapshot; its KV block stays cached. Evicting a
KV block drops its snapshots (`BlockManager.drop_states`).

Invariants
- A snapshot on block b at m is the state after the chain's tokens up to b's first m tokens,
  computed under b's weights identity: it is taken in the forward that computed those tokens (or
  at a sequence's end, from the sequence's own slot), attached only to a keyed block that holds
  those tokens, and dropped with the block's key. So a hit serves exactly what a fresh prefill of
  the prefix computes (bit for bit under batch-invariant kernels; model/gated_deltanet.py).
- Every snapshot slot is free, waiting on its request until the block holding its prefix's end
  is keyed, or attached to exactly one (block, m) and in the LRU order; every running slot is
  free or held by exactly one request or sequence.
"""

from __future__ import annotations

import heapq
from collections import OrderedDict
from typing import TYPE_CHECKING

import torch

from ..model.gated_deltanet import Cuts, LinearState
from ..model.invariant import wide_dtype
from ..model.qwen3_5 import HybridConfig, HybridState
from .kv_cache import Block, BlockManager

if TYPE_CHECKING:
    from .sequence import Request

CPU_STATE_CACHE_BYTES = 512 * 2**20
GPU_STATE_CACHE_FRACTION = 0.25  # of the memory free when the pool is built (after the KV pool)


def default_state_cache_bytes(device: torch.device) -> int:
    """The snapshots' default budget: 512 MiB on CPU; on a GPU, a quarter of its free memory."""
    if device.type == "cuda":
        return int(torch.cuda.mem_get_info(device)[0] * GPU_STATE_CACHE_FRACTION)
    return CPU_STATE_CACHE_BYTES


def state_bytes(cfg: HybridConfig, dtype: torch.dtype) -> int:
    """Bytes of one sequence's state: every linear layer's conv state (model dtype) and recurrent
    state (its wide dtype)."""
    sh = cfg.linear
    conv = sh.conv_dim * (sh.conv_kernel - 1) * dtype.itemsize
    rec = sh.num_value_heads * sh.key_head_dim * sh.value_head_dim * wide_dtype(dtype).itemsize
    return len(cfg.linear_layers) * (conv + rec)


class SlotState(HybridState):
    """The `HybridState` of a forward's rows, kept in the pool: layer j's state is read from the
    rows' slots and written back there; the states at `cuts` go to `snapshot_slots` (in order).
    Rows in consecutive slots (a group's samples, a batch admitted together) are read as a view of
    the pool, which a decode step updates in place (`LinearState.donated`): no copy in or out."""

    def __init__(self, pool: StateCache, slots: list[int], cuts: Cuts | None = None, snapshot_slots=()):
        super().__init__([], cuts or None)
        dev = pool.conv.device
        self.pool = pool
        self.span = (slots[0], len(slots)) if slots == list(range(slots[0], slots[0] + len(slots))) else None
        self.slots = torch.tensor(slots, dtype=torch.long, device=dev)
        self.snapshot_slots = torch.tensor(list(snapshot_slots), dtype=torch.long, device=dev)
        # layer -> the (conv, recurrent) rows `read` lent as views
        self._views: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

    def read(self, j: int) -> LinearState:
        p = self.pool
        if self.span is not None:
            a, n = self.span
            conv, rec = p.conv[j].narrow(0, a, n), p.recurrent[j].narrow(0, a, n)
            self._views[j] = (conv, rec)
            return LinearState(conv, rec, donated=True)
        conv, rec = p.conv[j].index_select(0, self.slots), p.recurrent[j].index_select(0, self.slots)
        return LinearState(conv, rec, donated=True)

    def write(self, j: int, state: LinearState) -> None:
        p = self.pool
        if self.span is not None:
            a, n = self.span
            conv, rec = self._views.pop(j, (None, None))
            if state.conv is not conv:  # else updated where it is
                p.conv[j].narrow(0, a, n).copy_(state.conv)
            if state.recurrent is not rec:
                p.recurrent[j].narrow(0, a, n).copy_(state.recurrent)
        else:
            p.conv[j].index_copy_(0, self.slots, state.conv.to(p.conv.dtype))
            p.recurrent[j].index_copy_(0, self.slots, state.recurrent.to(p.recurrent.dtype))
        if state.snapshots is not None:
            at = self.snapshot_slots
            p.conv[j].index_copy_(0, at, state.snapshots.conv.to(p.conv.dtype))
            p.recurrent[j].index_copy_(0, at, state.snapshots.recurrent.to(p.recurrent.dtype))


class StateCache:
    """The state pool of one sampler: `running_slots` slots for live states, and snapshot slots
    for `snapshot_bytes` (see the module docstring)."""

    def __init__(
        self,
        cfg: HybridConfig,
        kv: BlockManager,
        running_slots: int,
        snapshot_bytes: int,
        interval: int,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
    ):
        sh, layers = cfg.linear, len(cfg.linear_layers)
        self.kv = kv
        self.block_size = kv.block_size
        self.interval = interval
        self.state_bytes = state_bytes(cfg, dtype)
        self.running_slots = running_slots
        self.snapshot_slots = snapshot_bytes // self.state_bytes
        total = running_slots + self.snapshot_slots
        # empty, not zeros: a slot is written (zeros, a snapshot, a fork's copy) before it is read,
        # and pages never touched cost no memory
        self.conv = torch.empty(layers, total, sh.conv_dim, sh.conv_kernel - 1, dtype=dtype, device=device)
        rec = (layers, total, sh.num_value_heads, sh.key_head_dim, sh.value_head_dim)
        self.recurrent = torch.empty(rec, dtype=wide_dtype(dtype), device=device)
        # a heap: the lowest free slots go first, so a decode batch's rows tend to be consecutive
        self._free = list(range(running_slots))
        self._free_snapshots = list(range(total - 1, running_slots - 1, -1))
        self._lru: OrderedDict[int, tuple[Block, int]] = OrderedDict()  # slot -> (block, m), LRU first
        self._waiting = 0  # snapshot slots waiting on their requests for a keyed block
        kv.drop_states = self._dropped
        self.hits = 0
        self.taken = 0
        self.evictions = 0

    # ------------------------------------------------------------------ live slots
    @property
    def num_free(self) -> int:
        return len(self._free)

    def acquire(self, n: int) -> list[int]:
        """`n` live slots (their content undefined until `load` or `copy`)."""
        if n > len(self._free):
            raise RuntimeError(f"asked for {n} state slots, {len(self._free)} free")
        return [heapq.heappop(self._free) for _ in range(n)]

    def release(self, slots: list[int]) -> None:
        for slot in slots:
            heapq.heappush(self._free, slot)

    def load(self, slot: int, snapshot: int | None) -> None:
        """Start `slot` from a snapshot (a hit: counted, and made most recently used), or from
        zeros (the state before any token)."""
        if snapshot is None:
            self.conv[:, slot].zero_()
            self.recurrent[:, slot].zero_()
            return
        self.copy(snapshot, [slot])
        self._lru.move_to_end(snapshot)
        self.hits += 1

    def copy(self, src: int, dsts: list[int]) -> None:
        """Copy slot `src`'s state into each of `dsts` (a prompt's state into its samples')."""
        for d in dsts:
            self.conv[:, d] = self.conv[:, src]
            self.recurrent[:, d] = self.recurrent[:, src]

    def rows(self, slots: list[int], cuts: Cuts | None = None, snapshot_slots=()) -> SlotState:
        return SlotState(self, slots, cuts, snapshot_slots)

    # ------------------------------------------------------------------ taking snapshots
    def prefill_cuts(self, rows: list[tuple[Request, int]]) -> tuple[Cuts, list[tuple[Request, int, int]]]:
        """Where a prefill chunk takes snapshots: every `interval`-aligned prefix it completes and
        the prompt's cacheable end (`len(prompt) - 1`), for requests whose blocks are keyed. Returns
        the cuts (row, tokens into the chunk) and, for each, (request, prefix length, its slot);
        a chunk with more snapshots than the budget holds takes the first ones only."""
        wanted = []
        for i, (r, take) in enumerate(rows):
            if r.mixed:
                continue  # nothing it computes is keyed
            start, end, last = r.prefilled, r.prefilled + take, len(r.prompt) - 1
            ends = set(range((start // self.interval + 1) * self.interval, min(end, last) + 1, self.interval))
            if start < last <= end:
                ends.add(last)
            wanted += [(i, r, p) for p in sorted(ends)]
        slots = self._reserve(len(wanted))
        cuts = [(i, p - r.prefilled) for (i, r, p) in wanted[: len(slots)]]
        return cuts, [(r, p, s) for (_, r, p), s in zip(wanted, slots)]

    def _reserve(self, n: int) -> list[int]:
        """Up to `n` snapshot slots, evicting the least recently used snapshots for them."""
        out = []
        while len(out) < n and (self._free_snapshots or self._lru):
            if not self._free_snapshots:
                slot, (block, m) = self._lru.popitem(last=False)
                self._detach(block, m)
                self.evictions += 1
                self._free_snapshots.append(slot)
            out.append(self._free_snapshots.pop())
        self._waiting += len(out)
        return out

    def keep(
        self, r: Request, taken: list[tuple[int, int]], tokens: list[int], blocks: list[int], keys: list[int]
    ) -> list[tuple[int, int]]:
        """Attach the snapshots (prefix length, slot) that `r` took to the blocks holding their
        prefixes' ends (`blocks` hold the KV of `tokens`, `keys` are their full blocks' keys);
        returns those whose block is not keyed yet (the prompt's last block while the prompt is
        prefilled: call again once it is). A snapshot whose prefix has one already, or whose block
        is not keyed and never will be (a duplicate of a cached block's tokens), is dropped."""
        later = []
        for p, slot in taken:
            block = self._holder(r, p, tokens, blocks, keys)
            if block is None and r.prompt_left and p > len(tokens) // self.block_size * self.block_size:
                later.append((p, slot))
                continue
            self._waiting -= 1
            m = self._offset(p)
            if block is None or block.states is not None and m in block.states:
                self._free_snapshots.append(slot)
                continue
            if block.states is None:
                block.states = {}
            block.states[m] = slot
            self._lru[slot] = (block, m)
            self.taken += 1
        return later

    def take(self, r: Request, tokens: list[int], blocks: list[int], keys: list[int], slot: int) -> None:
        """Snapshot live slot `slot` (a stopped sequence's) as the state after `tokens`, unless its
        block is not keyed or holds that snapshot already."""
        p = len(tokens)
        block = self._holder(r, p, tokens, blocks, keys)
        if block is None or block.states is not None and self._offset(p) in block.states:
            return
        snap = self._reserve(1)
        if snap:
            self.copy(slot, snap)
            self.keep(r, [(p, snap[0])], tokens, blocks, keys)

    def forget(self, taken: list[tuple[int, int]]) -> None:
        """Free snapshot slots that wait on a request that will not key their block (cancelled)."""
        self._waiting -= len(taken)
        self._free_snapshots += [slot for _, slot in taken]

    def _offset(self, p: int) -> int:
        """m of prefix length p: the tokens of the block holding its end that the prefix covers."""
        return p - (p - 1) // self.block_size * self.block_size

    def _holder(self, r: Request, p: int, tokens: list[int], blocks: list[int], keys: list[int]):
        """The keyed block that holds the end of prefix `tokens[:p]` after the same chain: the
        chain's own block, or, for a full block keyed in another block (two requests computed it
        at once), that one. None if neither is keyed."""
        bs = self.block_size
        b = (p - 1) // bs
        own = self.kv.blocks[blocks[b]] if b < len(blocks) else None
        if own is not None and own.key is not None and len(own.tokens) >= p - b * bs:
            return own
        if b < len(keys):
            other = self.kv.keyed(keys[b])
            same = other is not None and other.tokens == tuple(tokens[b * bs : (b + 1) * bs])
            if same and other.identity == r.weights:
                return other
        return None

    def _detach(self, block: Block, m: int) -> None:
        del block.states[m]
        if not block.states:
            block.states = None

    def _dropped(self, states: dict[int, int]) -> None:
        """A KV block was evicted: its snapshots go with it."""
        for slot in states.values():
            del self._lru[slot]
            self._free_snapshots.append(slot)

    # ------------------------------------------------------------------ serving snapshots
    def usable(self, block: Block, m: int) -> int:
        """The longest prefix of a block's first m tokens that ends at a snapshot (0: none)."""
        return max((k for k in block.states or () if k <= m), default=0)

    def hit(
        self, matched: list[int], part: tuple[int, int] | None, whole_blocks: bool
    ) -> tuple[list[int], tuple[int, int] | None, int | None]:
        """Cut a prefix-cache hit (full blocks `matched`, then `part` = (block, m) whose first m
        tokens follow them, m a snapshot position: `usable`) back to its longest prefix that ends
        at a snapshot; `whole_blocks`: only at a block's end. Returns (the full blocks kept, (block,
        m) whose first m slots follow them, held: copy then release it; the snapshot's slot, None
        when nothing is served). Releases the matched blocks it does not keep."""
        kv, bs = self.kv, self.block_size
        if part is not None:
            bid, m = part
            return matched, part, kv.blocks[bid].states[m]
        for i in range(len(matched) - 1, -1, -1):
            states = kv.blocks[matched[i]].states or {}
            m = max((k for k in states if k == bs or not whole_blocks), default=0)
            if m == bs:
                kv.unmatch(matched[i + 1 :])
                return matched[: i + 1], None, states[m]
            if m:
                kv.unmatch(matched[i + 1 :])
                kv.served_partial(m)  # block i is the partial hit's: held, copied, then released
                return matched[:i], (matched[i], m), states[m]
        kv.unmatch(matched)
        return [], None, None

    # ------------------------------------------------------------------ accounting
    @property
    def num_snapshots(self) -> int:
        return len(self._lru)

    def check(self, live: list[int]) -> None:
        """Assert the invariants (for tests); `live` are the slots requests and sequences hold."""
        assert sorted(live + self._free) == list(range(self.running_slots))
        held = sorted(self._lru) + self._free_snapshots
        assert len(held) + self._waiting == self.snapshot_slots and len(set(held)) == len(held)
        for slot, (block, m) in self._lru.items():
            assert block.key is not None and block.states[m] == slot and 0 < m <= len(block.tokens)
        for block in self.kv.blocks:
            if block.states is not None:
                assert block.key is not None and block.states
                assert all(self._lru[s] == (block, m) for m, s in block.states.items())
