"""KV blocks that slide out of a model's window: freed while a sequence runs, and cached prefixes
served without them (a model whose every layer is windowed, Mistral 7B v0.1's kind:
model/sliding_window.py).

A windowed layer's query at position p reads keys p - W + 1 .. p only. A block is needed while any
layer may still read it, so:
- With a global layer anywhere (Gemma 3: one layer in six; OLMo 3: one in four), every key stays
  readable to the end of the sequence: nothing is freed while it runs (`freed_window` is None and
  the sampler keeps its plain `BlockManager` and `Scheduler`).
- With every layer windowed, a sequence whose next query is at position q never reads a block
  that ends before q - W + 1 again. Before each decode step (`SlidingScheduler.grow`) such blocks
  are released: one held by no one else is free at once (or, if the prefix cache keyed it,
  cached-free: still served to prefix hits until it is evicted, least recently used first).
  Its entry in the sequence's block table becomes the `sink`, a block that is never keyed,
  written or freed, so the table still maps every position (attention never reads the sink's
  slots unmasked).

Prefix hits (`SlidingBlocks.match`). A cached chain's early blocks may have been evicted while its
later ones stay cached. Continuing after m cached blocks reads only the keys from position
m x block_size - W + 1 on, in every layer, and those are exactly the cached KV a fresh prefill
would compute, so the hit may skip the evicted blocks before that window: it serves the longest
prefix whose blocks from its window on are cached, the sink standing for the rest. A request
that reuses cached prompt scores reads every block's scores: it gets no holes.

Admission is unchanged: a request still reserves its worst case (its prompt's blocks and each
sample decoding to `max_tokens`), so what sliding frees is what other requests can use while it
runs, each released block one more than the pool had free.
"""

from __future__ import annotations

import functools
from typing import Callable

from ..api import WeightsIdentity
from ..config import SamplerConfig
from ..model.model import ModelConfig
from ..model.sliding_window import WindowedConfig
from .kv_cache import Block, BlockManager, chain_hashes
from .scheduler import Scheduler
from .sequence import Sequence


def freed_window(cfg: ModelConfig) -> int | None:
    """The window past which a sequence's KV is never read again: a model's whose every layer is
    windowed; None when a global layer reads every key (nothing can be freed while it runs)."""
    return cfg.sliding_window if isinstance(cfg, WindowedConfig) and cfg.all_windowed else None


def kv_classes(cfg: ModelConfig) -> tuple[type[BlockManager], Callable[..., Scheduler]]:
    """The sampler's block manager class and scheduler factory for a model of `cfg`."""
    window = freed_window(cfg)
    if window is None:
        return BlockManager, Scheduler
    return SlidingBlocks, functools.partial(SlidingScheduler, window=window)


class SlidingBlocks(BlockManager):
    """A `BlockManager` whose prefix hits may skip blocks evicted before the window (module
    docstring), with one block set aside as the `sink`. `window` is set by `SlidingScheduler`."""

    window: int = 0

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.sink = self.allocate(1)[0]  # held forever: never free, never keyed
        self.num_blocks -= 1  # what requests can have

    def match(
        self,
        identity: WeightsIdentity,
        tokens: list[int],
        keys: list[int] | None = None,
        serves: Callable[[int, Block], bool] | None = None,
    ) -> list[int]:
        """`BlockManager.match`, a block before the window of the prefix's end allowed to be gone
        (the sink in its place, with one more reference for each)."""
        if serves is not None or not self.window:
            return super().match(identity, tokens, keys, serves)
        bs = self.block_size
        keys = chain_hashes(identity, tokens, bs) if keys is None else keys
        found: list[int | None] = []
        parent: object = identity
        for i, key in enumerate(keys):
            bid = self._table.get(key)
            block = None if bid is None else self.blocks[bid]
            ok = block is not None and (block.identity, block.parent) == (identity, parent)
            found.append(bid if ok and block.tokens == tuple(tokens[i * bs : (i + 1) * bs]) else None)
            parent = key
        end = len(found)
        while end and None in found[max(0, end * bs - self.window + 1) // bs : end]:
            end -= 1  # a block the first uncached position's window reads is gone
        out = [self.sink if b is None else b for b in found[:end]]
        self.queried_blocks += len(keys)
        self.hit_blocks += sum(b is not None for b in found[:end])
        self.incref(out)
        return out


class SlidingScheduler(Scheduler):
    """A `Scheduler` that releases each decoding sequence's blocks that slid out of the window."""

    def __init__(self, kv: SlidingBlocks, config: SamplerConfig = SamplerConfig(), *, window: int, **kwargs):
        super().__init__(kv, config, **kwargs)
        self.window = kv.window = window

    def grow(self, seqs: list[Sequence]) -> None:
        """Release what the next query of each sequence no longer reads, then `Scheduler.grow`."""
        bs, sink = self.block_size, self.kv.sink
        for s in seqs:
            gone = max(0, len(s.tokens) - self.window) // bs  # blocks before position q - W + 1
            dropped = [b for b in s.blocks[:gone] if b != sink]
            if dropped:
                self.kv.incref([sink] * len(dropped))
                self.kv.release(dropped)
                s.blocks[:gone] = [sink] * gone
        super().grow(seqs)
