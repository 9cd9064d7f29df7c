"""BlockManager: refcounts, the prefix cache's keys and verification, LRU eviction. No model."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from trine.engine.api import WeightsIdentity
from trine.engine.sampler.kv_cache import MAX_SCAN, BlockManager, NoFreeBlocks, block_key, chain_hashes

BS = 4
W = WeightsIdentity("base")


def make(num_blocks: int = 8) -> BlockManager:
    return BlockManager(num_layers=2, num_kv_heads=1, head_dim=2, num_blocks=num_blocks, block_size=BS)


def cache(
    bm: BlockManager, tokens: list[int], identity: WeightsIdentity = W, tail: bool = False
) -> list[int]:
    """Allocate blocks for `tokens`, register the full ones (and, with `tail`, the partial last
    one), release them: they become cached-free (unless that content is cached already)."""
    keys = chain_hashes(identity, tokens, BS)
    blocks = bm.allocate(-(-len(tokens) // BS))
    for i, key in enumerate(keys):
        bm.register(blocks[i], key, keys[i - 1] if i else identity, identity, tokens[i * BS : (i + 1) * BS])
    if tail and len(tokens) % BS:
        bm.register_tail(
            blocks[len(keys)], keys[-1] if keys else identity, identity, tokens[len(keys) * BS :]
        )
    bm.release(blocks)
    return blocks


def test_pool_layout_and_budget():
    bm = BlockManager.from_budget(10_000, num_layers=3, num_kv_heads=2, head_dim=4, block_size=BS)
    per = BlockManager.bytes_per_block(3, 2, 4, BS, torch.float32)
    assert per == 2 * 3 * BS * 2 * 4 * 4
    assert bm.num_blocks == 10_000 // per
    assert len(bm.k_pool) == 3 and bm.k_pool[0].shape == (bm.num_blocks * BS, 2, 4)
    bm.k_pool[1][5] = 7.0  # the per-layer views write through to the pool
    assert bm.k[1, 5].eq(7).all()
    with pytest.raises(ValueError, match="kv_cache_bytes"):
        BlockManager.from_budget(per - 1, 3, 2, 4, BS)


def test_refcounts_never_negative():
    bm = make(4)
    a = bm.allocate(2)
    bm.incref(a)
    bm.release(a)
    bm.release(a)
    assert bm.num_free == 4
    with pytest.raises(ValueError, match="released more often"):
        bm.release(a[:1])
    with pytest.raises(ValueError, match="free"):
        bm.incref(a[:1])  # a free, unkeyed block cannot be shared
    with pytest.raises(NoFreeBlocks):
        bm.allocate(5)
    bm.check()


def test_hit_shares_blocks_and_counts_refs():
    bm = make()
    toks = list(range(10))  # 2 full blocks + 2 tokens
    blocks = cache(bm, toks)
    assert bm.num_cached_free == 2 and bm.num_free == 8
    hit = bm.match(W, toks)
    assert hit == blocks[:2]
    assert [bm.blocks[b].ref for b in hit] == [1, 1]
    assert bm.num_free == 6  # hit blocks are in use, not evictable
    again = bm.match(W, toks[:4] + [99] * 4)  # diverges in block 1
    assert again == blocks[:1] and bm.blocks[blocks[0]].ref == 2
    bm.release(hit)
    bm.release(again)
    bm.check()
    assert bm.hit_blocks == 3 and bm.queried_blocks == 4


def test_one_differing_token_at_the_start_misses_everything():
    bm = make()
    toks = list(range(12))
    cache(bm, toks)
    assert bm.match(W, [100] + toks[1:]) == []


@pytest.mark.parametrize(
    "other", [WeightsIdentity("base", version=1), WeightsIdentity("base", "run1"), WeightsIdentity("other")]
)
def test_different_weights_never_share(other):
    bm = make()
    toks = list(range(8))
    cache(bm, toks)
    assert bm.match(other, toks) == []
    assert bm.match(W, toks) != []


def test_hash_collision_is_never_served():
    bm = make()
    toks = list(range(4))
    blocks = bm.allocate(1)
    # A block stored under the key of `toks` but holding other tokens (as a collision would).
    bm.register(blocks[0], block_key(W, toks), W, W, [9, 9, 9, 9])
    assert bm.match(W, toks) == []
    # ... or computed under other weights.
    bm2 = make()
    b2 = bm2.allocate(1)
    bm2.register(b2[0], block_key(W, toks), W, WeightsIdentity("evil"), toks)
    assert bm2.match(W, toks) == []


def test_register_rules():
    bm = make()
    a, b = bm.allocate(2)
    key = block_key(W, [1, 2, 3, 4])
    with pytest.raises(ValueError, match="full blocks"):
        bm.register(a, key, W, W, [1, 2])
    assert bm.register(a, key, W, W, [1, 2, 3, 4])
    assert not bm.register(b, key, W, W, [1, 2, 3, 4])  # content already cached in `a`
    assert not bm.register(a, block_key(W, [5, 6, 7, 8]), W, W, [5, 6, 7, 8])  # already keyed
    bm.release([a, b])
    with pytest.raises(ValueError, match="not in use"):
        bm.register(b, block_key(W, [5, 6, 7, 8]), W, W, [5, 6, 7, 8])
    bm.check()


def test_eviction_removes_the_key_and_reused_block_is_not_served():
    bm = make(2)
    toks = list(range(8))
    old = cache(bm, toks)
    assert bm.num_cached == 2
    fresh = bm.allocate(2)  # nothing free: both cached-free blocks are evicted and reused
    assert sorted(fresh) == sorted(old)
    assert bm.num_cached == 0 and bm.evictions == 2
    assert bm.match(W, toks) == []  # their old content is gone with their keys
    bm.release(fresh)
    assert bm.match(W, toks) == []
    bm.check()


def test_lru_order_and_chain_tail_first():
    bm = make(4)
    a = cache(bm, list(range(8)))  # released tail first: a[1] is older than a[0]
    b = cache(bm, list(range(100, 108)))
    assert list(bm._cached_free) == [a[1], a[0], b[1], b[0]]
    hit = bm.match(W, list(range(8)))  # a hit refreshes a's blocks when released again
    bm.release(hit)
    assert bm.allocate(1) == [b[1]]
    head = bm.match(W, list(range(100, 108)))  # b's chain lost its second block, not its head
    assert head == [b[0]]
    bm.release(head)
    bm.check()


def test_copy_tokens_copies_every_layer():
    bm = make(3)
    src, dst = bm.allocate(2)
    bm.k[:, src * BS : src * BS + BS] = torch.arange(BS, dtype=torch.float32)[None, :, None, None]
    bm.v[:, src * BS : src * BS + BS] = 1.0
    bm.copy_tokens(src, [dst], 3)
    assert bm.k[:, dst * BS : dst * BS + 3].equal(bm.k[:, src * BS : src * BS + 3])
    assert bm.v[:, dst * BS : dst * BS + 3].eq(1).all() and bm.v[:, dst * BS + 3].eq(0).all()


ops = st.lists(
    st.tuples(st.sampled_from(["cache", "match", "alloc", "free"]), st.integers(0, 3), st.integers(1, 12)),
    max_size=40,
)


def test_a_tail_serves_the_first_tokens_it_shares():
    bm = make()
    blocks = cache(bm, [1, 2, 3, 4, 5, 6, 7], tail=True)  # one full block and a tail of 3
    parent = chain_hashes(W, [1, 2, 3, 4], BS)[0]
    assert bm.num_cached == 2 and bm.num_free == 8
    assert bm.match_partial(W, parent, [5, 6, 9]) == (blocks[1], 2)
    assert bm.blocks[blocks[1]].ref == 1  # held until its slots are copied
    bm.release([blocks[1]])
    assert bm.match_partial(W, parent, [6, 5]) is None  # a tail serves from its first token
    assert bm.match_partial(W, W, [5, 6]) is None  # under another parent
    assert bm.match_partial(WeightsIdentity("base", version=1), parent, [5, 6]) is None
    assert bm.hit_partial_tokens == 2
    bm.check()


def test_a_cached_full_block_serves_its_first_tokens():
    bm = make()
    blocks = cache(bm, [1, 2, 3, 4, 5, 6, 7, 8])
    keys = chain_hashes(W, [1, 2, 3, 4, 5, 6, 7, 8], BS)
    assert bm.match_partial(W, keys[0], [5, 6, 7]) == (blocks[1], 3)  # a repeated prompt
    bm.release([blocks[1]])
    assert bm.match_partial(W, keys[0], [5, 9]) == (blocks[1], 1)  # a prompt that leaves it
    bm.release([blocks[1]])
    assert bm.match_partial(W, W, [1, 2, 3]) == (blocks[0], 3)  # before any full block
    bm.release([blocks[0]])
    bm.check()


def test_the_longest_shared_start_wins_among_the_newest():
    bm = make(MAX_SCAN + 4)
    short = cache(bm, [1, 2], tail=True)
    long = cache(bm, [1, 2, 3], tail=True)
    assert bm.match_partial(W, W, [1, 2, 3]) == (long[0], 3)
    bm.release([long[0]])
    bid, m = bm.match_partial(W, W, [1, 2, 9])
    assert m == 2 and bid in (short[0], long[0])
    bm.release([bid])
    for t in range(MAX_SCAN):  # newer blocks under the same parent: the first two are not looked at
        cache(bm, [100 + t], tail=True)
    assert bm.match_partial(W, W, [1, 2, 3]) is None
    bm.check()


def test_register_tail_rules():
    bm = make()
    (b,) = bm.allocate(1)
    with pytest.raises(ValueError):
        bm.register_tail(b, W, W, [])
    with pytest.raises(ValueError):
        bm.register_tail(b, W, W, [1, 2, 3, 4])  # a full block is `register`'s
    assert bm.register_tail(b, W, W, [1, 2])
    assert not bm.register_tail(b, W, W, [1, 9, 3])  # keyed already, with other tokens
    assert bm.register_tail(b, W, W, [1, 2, 3])  # its sequence filled one slot more: the key grows
    assert bm.match_partial(W, W, [1, 2, 3]) == (b, 3) and bm.match_partial(W, W, [1, 2]) == (b, 2)
    bm.release([b, b])
    (c,) = bm.allocate(1)
    assert not bm.register_tail(c, W, W, [1, 2, 3])  # the same content is cached in b
    bm.release([b, c])
    with pytest.raises(ValueError):
        bm.register_tail(c, W, W, [7])  # not in use
    bm.check()


def test_evicting_a_tail_forgets_it():
    bm = make(2)
    (b,) = cache(bm, [1, 2, 3], tail=True)
    assert bm.num_cached_free == 1
    bm.allocate(2)  # takes the cached-free tail last
    assert bm.match_partial(W, W, [1, 2]) is None and bm.evictions == 1
    bm.check()


@settings(max_examples=60, deadline=None)
@given(ops)
def test_random_operations_keep_invariants(script):
    """Any mix of caching, hits, allocation and release keeps the pool consistent, and every hit
    returns blocks whose stored tokens and weights are exactly the query's."""
    bm = make(6)
    identities = [WeightsIdentity("base"), WeightsIdentity("base", version=1)]
    held: list[list[int]] = []
    for op, a, n in script:
        identity = identities[a % 2]
        toks = [(a * 7 + i) % 5 for i in range(n)]
        if op == "cache" and bm.num_free >= -(-n // BS):
            cache(bm, toks, identity, tail=a > 1)
        elif op == "match":
            hit = bm.match(identity, toks)
            for i, bid in enumerate(hit):
                blk = bm.blocks[bid]
                assert blk.identity == identity and blk.tokens == tuple(toks[i * BS : (i + 1) * BS])
            keys = chain_hashes(identity, toks, BS)
            rest = toks[len(hit) * BS :]
            if rest:
                parent = keys[len(hit) - 1] if hit else identity
                part = bm.match_partial(identity, parent, rest)
                if part is not None:
                    blk = bm.blocks[part[0]]
                    assert blk.identity == identity and blk.tokens[: part[1]] == tuple(rest[: part[1]])
                    hit = hit + [part[0]]
            held.append(hit)
        elif op == "alloc" and bm.num_free >= a:
            held.append(bm.allocate(a))
        elif op == "free" and held:
            bm.release(held.pop(a % len(held)))
        bm.check()
    for h in held:
        bm.release(h)
    bm.check()
    assert bm.num_free == bm.num_blocks


def test_reset_forgets_unheld_blocks_and_keeps_held_ones():
    bm = make()
    cache(bm, list(range(8)))
    cache(bm, list(range(100, 108)))
    held = bm.match(W, list(range(100, 108)))  # in use now
    assert bm.reset_cache() == 2  # the first prompt's two blocks
    bm.check()
    assert bm.match(W, list(range(8))) == [] and bm.num_cached == 2
    assert bm.match(W, list(range(100, 108))) == held  # still keyed while held
    assert bm.num_free == 6
