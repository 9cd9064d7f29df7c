"""The paged KV block pool and its prefix cache.

The pool is preallocated once: for each layer `k_pool[layer]` and `v_pool[layer]` of shape
`[num_blocks * block_size, num_kv_heads, head_dim]`, the layout `KVContext` reads (slot =
block * block_size + offset). Sequences own lists of block ids; nothing is concatenated per step.

Prefix cache. A full block of `block_size` tokens at chain position i has the key
`hash((key of block i-1, tokens))`; the key before block 0 is the `WeightsIdentity` itself, so the
chain of a prompt is rooted in the weights (base model, adapter, version) that computed its KV.
A chain's last, partial block is cached too, as a *tail*: the KV of its first n < `block_size`
tokens, keyed under its parent (the chain's last full block). After its full blocks, a prompt's
next few tokens are served from any cached block under the same parent (a tail or a full block)
whose first m tokens they share: those m slots are copied into a block of its own. So a chat's
next turn reuses the KV of the previous reply's last partial block, a repeated prompt computes
only its last token, and prompts that share a system prompt share all of it, instead of computing
up to `block_size - 1` tokens again.

Block states:
- free        ref 0, no key: on the free list.
- in use      ref > 0 (shared by every sequence that references it), with or without a key.
- cached-free ref 0 but still keyed: reusable by a hit until evicted, least recently used first.

Invariants
- Reference counts are never negative; a block with ref > 0 is never evicted or handed out.
- Every hit is verified: same WeightsIdentity, same parent key and the same tokens (a partial
  hit: the same first m tokens), stored with the block. KV computed under other weights is never
  served, even on a hash collision.
- Evicting a block removes its key (and the prompt scores and state snapshots kept with it:
  `Block.scores`, `Block.states`) before the block is reused, so a reused block is never served for
  its old content.
- A partial hit is never shared: its first m slots are copied, while the hit holds a reference. A
  keyed block's keyed slots are not written again (a full block is keyed once computed, a tail when
  its sequence stops), so the copy is its keyed content. A hybrid model's prompt tail is keyed as
  soon as the prompt is done, while its first sample goes on filling the slots after it: its key
  then grows with the tokens (`register`, `register_tail`), never covering a slot not yet computed.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from itertools import islice
from typing import TYPE_CHECKING, Callable

import torch

from ...prefixes import common_prefix
from ..api import WeightsIdentity

if TYPE_CHECKING:
    from .prompt_scores import BlockScores

CPU_KV_CACHE_BYTES = 512 * 2**20
MAX_SCAN = 64  # a partial lookup compares the tokens of this many blocks under its parent, newest first
GPU_KV_CACHE_FRACTION = 0.5  # of the memory free when the pool is built


def default_kv_cache_bytes(device: torch.device) -> int:
    """The pool's default size: 512 MiB on CPU; on a GPU, half of its free memory."""
    if device.type == "cuda":
        return int(torch.cuda.mem_get_info(device)[0] * GPU_KV_CACHE_FRACTION)
    return CPU_KV_CACHE_BYTES


def block_key(parent: object, tokens: list[int] | tuple[int, ...]) -> int:
    """The key of a full block: its parent's key (or the WeightsIdentity at the root) + its tokens."""
    return hash((parent, tuple(tokens)))


def tail_key(parent: object, tokens: list[int] | tuple[int, ...]) -> int:
    """The key of a tail: apart from any full block's (a tuple of another shape is hashed)."""
    return hash(("tail", parent, tuple(tokens)))


def chain_hashes(
    identity: WeightsIdentity, tokens: list[int], block_size: int, start: int = 0, parent: int | None = None
) -> list[int]:
    """Chained keys of the full blocks of `tokens`, from block `start` on.

    `parent` is the key of block `start - 1` (ignored when start == 0, where the root is
    `identity`). Returns one key per full block in `tokens[start * block_size:]`.
    """
    keys = []
    prev: object = identity if start == 0 else parent
    for b in range(start, len(tokens) // block_size):
        prev = block_key(prev, tokens[b * block_size : (b + 1) * block_size])
        keys.append(prev)
    return keys


@dataclass(eq=False)
class Block:
    """One block of the pool. `key`, `parent`, `identity` and `tokens` are set while it is cached."""

    id: int
    ref: int = 0
    key: int | None = None
    parent: object = None  # parent block's key, or the WeightsIdentity for block 0 of a chain
    identity: WeightsIdentity | None = None
    tokens: tuple[int, ...] | None = None  # block_size of them; fewer for a tail
    scores: "BlockScores | None" = None  # its prompt scores, when a request that computed them keyed it
    states: dict[int, int] | None = None  # a hybrid model's snapshots: m -> slot (state_cache.py)


class NoFreeBlocks(RuntimeError):
    """The pool has fewer free (or evictable) blocks than asked for."""


class BlockManager:
    """A fixed KV pool of `num_blocks` blocks with reference counting and an LRU prefix cache."""

    def __init__(
        self,
        num_layers: int,
        num_kv_heads: int,
        head_dim: int,
        num_blocks: int,
        block_size: int = 16,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
    ):
        if num_blocks < 1 or block_size < 1:
            raise ValueError(f"num_blocks ({num_blocks}) and block_size ({block_size}) must be >= 1")
        self.block_size = block_size
        self.num_blocks = num_blocks
        shape = (num_layers, num_blocks * block_size, num_kv_heads, head_dim)
        self.k = torch.zeros(shape, dtype=dtype, device=device)
        self.v = torch.zeros(shape, dtype=dtype, device=device)
        self.k_pool = list(self.k.unbind(0))  # views: per layer [slots, kv_heads, head_dim]
        self.v_pool = list(self.v.unbind(0))
        self.blocks = [Block(i) for i in range(num_blocks)]
        self._free: list[int] = list(range(num_blocks - 1, -1, -1))  # pop() gives low ids first
        self._cached_free: OrderedDict[int, None] = OrderedDict()  # LRU first
        self._table: dict[int, int] = {}  # key -> block id
        self._children: dict[object, dict[int, None]] = {}  # parent -> keyed blocks after it, oldest first
        self.hit_blocks = 0
        self.hit_partial_tokens = 0
        self.queried_blocks = 0
        self.evictions = 0
        # a hybrid model's state cache frees the snapshots of an evicted block (state_cache.py)
        self.drop_states: Callable[[dict[int, int]], None] | None = None

    @staticmethod
    def bytes_per_block(
        num_layers: int, num_kv_heads: int, head_dim: int, block_size: int, dtype: torch.dtype
    ) -> int:
        elem = torch.empty((), dtype=dtype).element_size()
        return 2 * num_layers * block_size * num_kv_heads * head_dim * elem

    @classmethod
    def from_budget(
        cls,
        memory_bytes: int,
        num_layers: int,
        num_kv_heads: int,
        head_dim: int,
        block_size: int = 16,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
    ) -> "BlockManager":
        """As many blocks as fit in `memory_bytes` (K and V, every layer)."""
        per = cls.bytes_per_block(num_layers, num_kv_heads, head_dim, block_size, dtype)
        if memory_bytes < per:
            raise ValueError(f"kv_cache_bytes={memory_bytes} is below one KV block ({per} bytes)")
        return cls(num_layers, num_kv_heads, head_dim, memory_bytes // per, block_size, dtype, device)

    # ------------------------------------------------------------------ accounting
    @property
    def num_free(self) -> int:
        """Blocks that can be handed out now: never-cached free ones plus evictable cached ones."""
        return len(self._free) + len(self._cached_free)

    @property
    def num_cached_free(self) -> int:
        return len(self._cached_free)

    @property
    def num_used(self) -> int:
        return self.num_blocks - self.num_free

    @property
    def num_cached(self) -> int:
        """Blocks holding a key (in use or cached-free)."""
        return len(self._table)

    # ------------------------------------------------------------------ allocation
    def allocate(self, n: int) -> list[int]:
        """`n` blocks with ref 1: free ones first, then the least recently used cached-free ones."""
        if n > self.num_free:
            raise NoFreeBlocks(f"asked for {n} KV blocks, {self.num_free} free")
        out = []
        for _ in range(n):
            if self._free:
                bid = self._free.pop()
            else:
                bid, _ = self._cached_free.popitem(last=False)
                self._evict(self.blocks[bid])
            self.blocks[bid].ref = 1
            out.append(bid)
        return out

    def _evict(self, block: Block) -> None:
        del self._table[block.key]
        children = self._children[block.parent]
        del children[block.id]
        if not children:
            del self._children[block.parent]
        if block.states is not None:
            self.drop_states(block.states)
        block.key = block.parent = block.identity = block.tokens = block.scores = block.states = None
        self.evictions += 1

    def incref(self, block_ids: list[int]) -> None:
        for bid in block_ids:
            block = self.blocks[bid]
            if block.ref == 0:
                if block.key is None:
                    raise ValueError(f"block {bid} is free: it cannot be shared")
                del self._cached_free[bid]
            block.ref += 1

    def release(self, block_ids: list[int]) -> None:
        """Drop one reference to each block. Pass a sequence's blocks in order: the tail is made
        least recently used first, so a chain is evicted from its end."""
        for bid in reversed(block_ids):
            block = self.blocks[bid]
            if block.ref <= 0:
                raise ValueError(f"block {bid} released more often than referenced")
            block.ref -= 1
            if block.ref == 0:
                if block.key is None:
                    self._free.append(bid)
                else:
                    self._cached_free[bid] = None

    def copy_tokens(self, src: int, dsts: list[int], n: int) -> None:
        """Copy the first `n` slots of block `src` into each of `dsts`, every layer."""
        if not dsts or n == 0:
            return
        bs = self.block_size
        s = src * bs
        for d in dsts:
            self.k[:, d * bs : d * bs + n] = self.k[:, s : s + n]
            self.v[:, d * bs : d * bs + n] = self.v[:, s : s + n]

    # ------------------------------------------------------------------ prefix cache
    def match(
        self,
        identity: WeightsIdentity,
        tokens: list[int],
        keys: list[int] | None = None,
        serves: Callable[[int, Block], bool] | None = None,
    ) -> list[int]:
        """Block ids of the longest cached full-block prefix of `tokens`, each with one more ref.

        `keys` are the chain keys of `tokens` (`chain_hashes`), if the caller already has them;
        `serves(i, block)`, if given, may end the prefix before block i.
        """
        bs = self.block_size
        keys = chain_hashes(identity, tokens, bs) if keys is None else keys
        out: list[int] = []
        parent: object = identity
        for i, key in enumerate(keys):
            bid = self._table.get(key)
            if bid is None:
                break
            block = self.blocks[bid]
            if (
                block.identity != identity
                or block.parent != parent
                or block.tokens != tuple(tokens[i * bs : (i + 1) * bs])
            ):
                break  # hash collision: never serve it
            if serves is not None and not serves(i, block):
                break
            out.append(bid)
            parent = key
        self.queried_blocks += len(keys)
        self.hit_blocks += len(out)
        self.incref(out)  # takes hit blocks off the LRU list until released again
        return out

    def register(
        self,
        block_id: int,
        key: int,
        parent: object,
        identity: WeightsIdentity,
        tokens: list[int] | tuple[int, ...],
    ) -> bool:
        """Key a full, in-use block whose KV is computed. False if the key is already taken (the
        content is cached in another block) or the block already has a key."""
        block = self.blocks[block_id]
        if block.ref <= 0:
            raise ValueError(f"block {block_id} is not in use: only computed KV can be cached")
        if len(tokens) != self.block_size:
            raise ValueError(f"only full blocks are cached: got {len(tokens)} tokens")
        return self._key(block, key, parent, identity, tokens)

    def register_tail(
        self, block_id: int, parent: object, identity: WeightsIdentity, tokens: list[int] | tuple[int, ...]
    ) -> bool:
        """Key the first `len(tokens)` (1..block_size-1) slots of an in-use block as the tail of the
        chain whose last full block is `parent` (the WeightsIdentity for a chain of no full block).
        Call it when nothing will write those slots again. False if it is cached already (same
        parent and tokens) or the block has a key."""
        block = self.blocks[block_id]
        if block.ref <= 0:
            raise ValueError(f"block {block_id} is not in use: only computed KV can be cached")
        if not 0 < len(tokens) < self.block_size:
            raise ValueError(f"a tail holds 1..{self.block_size - 1} tokens: got {len(tokens)}")
        return self._key(block, tail_key(parent, tokens), parent, identity, tokens)

    def _key(
        self,
        block: Block,
        key: int,
        parent: object,
        identity: WeightsIdentity,
        tokens: list[int] | tuple[int, ...],
    ) -> bool:
        if key in self._table:
            return False
        if block.key is not None:  # only a tail its own sequence goes on filling grows its key
            old = block.tokens
            if block.parent != parent or block.identity != identity or tuple(tokens[: len(old)]) != old:
                return False
            del self._table[block.key]
            block.key, block.tokens = key, tuple(tokens)
            self._table[key] = block.id
            return True
        block.key, block.parent, block.identity, block.tokens = key, parent, identity, tuple(tokens)
        self._table[key] = block.id
        self._children.setdefault(parent, {})[block.id] = None
        return True

    def match_partial(
        self,
        identity: WeightsIdentity,
        parent: object,
        tokens: list[int],
        usable: Callable[[Block, int], int] | None = None,
    ) -> tuple[int, int] | None:
        """(block id, m): the cached block after `parent` (a tail or a full block; the newest
        `MAX_SCAN`) whose first m >= 1 tokens are the longest start of `tokens` (the rest of a
        prompt after its matched full blocks, up to its last token); the block with one more ref
        (copy its first m slots, then release it). None when none starts with tokens[0].
        `usable(block, m)`, if given, is how many of a block's m shared tokens may be served (a
        hybrid model's: up to its last snapshot)."""
        best, best_m, want = None, 0, tuple(tokens[: self.block_size])
        for bid in islice(reversed(self._children.get(parent, {})), MAX_SCAN):
            block = self.blocks[bid]
            if block.identity != identity:
                continue  # other weights under a colliding parent key: never serve it
            m = common_prefix(block.tokens, want)
            if usable is not None:
                m = usable(block, m)
            if m > best_m:
                best, best_m = bid, m
        if best is None:
            return None
        self.incref([best])
        self.hit_partial_tokens += best_m
        return best, best_m

    def keyed(self, key: int) -> Block | None:
        """The block cached under `key`, if any."""
        bid = self._table.get(key)
        return None if bid is None else self.blocks[bid]

    def unmatch(self, block_ids: list[int]) -> None:
        """Give back full blocks `match` found that the request will not be served after all."""
        self.hit_blocks -= len(block_ids)
        self.release(block_ids)

    def served_partial(self, m: int) -> None:
        """A block `match` found is served as a partial hit of its first m tokens instead."""
        self.hit_blocks -= 1
        self.hit_partial_tokens += m

    def reset_cache(self) -> int:
        """Forget every cached block no one holds (they become free); blocks in use keep their keys.
        Returns how many were forgotten."""
        n = len(self._cached_free)
        for bid in self._cached_free:
            self._evict(self.blocks[bid])
            self._free.append(bid)
        self._cached_free.clear()
        return n

    def keep_scores(self, key: int, scores: "BlockScores") -> None:
        """Keep `scores` with the cached block keyed `key` (if it still is), unless it carries scores
        with a top-k at least as wide already."""
        bid = self._table.get(key)
        if bid is not None:
            block = self.blocks[bid]
            if block.scores is None or block.scores.k < scores.k:
                block.scores = scores

    def check(self) -> None:
        """Assert the internal invariants (for tests)."""
        free, cached = set(self._free), set(self._cached_free)
        assert len(free) == len(self._free) and not free & cached
        for b in self.blocks:
            assert b.ref >= 0
            assert (b.id in free) == (b.ref == 0 and b.key is None)
            assert (b.id in cached) == (b.ref == 0 and b.key is not None)
            if b.key is not None:
                assert self._table[b.key] == b.id
                assert b.id in self._children[b.parent]
            else:
                assert b.scores is None and b.states is None
        assert len(self._table) == sum(b.key is not None for b in self.blocks)
        assert sum(map(len, self._children.values())) == len(self._table) and all(self._children.values())
