"""Prefix-aware routing of sample requests across a model's engine replicas (docs/ray.md).

A request's prompt is cut into full blocks (the engine's KV block size). Each block gets a stable
key: blake2b over (weights identity, the previous block's key, the block's token ids as little-
endian int32, and the content hash and offset of each image the block overlaps, as the engine's
prefix cache keys it) - the same in every process and on every run, unlike Python's salted `hash()`.

Choosing a replica:
1. Affinity: the replica that last served the longest prefix of these block keys, if it is alive
   and within the load bound. So turn 5 of a conversation follows turns 1-4, and a group follows
   its first request.
2. Otherwise (a new prefix, or its replica is full) consistent hashing with bounded loads: the
   first block's key (or the weights identity alone, for a prompt shorter than a block) picks a
   point on a ring of virtual nodes; walk clockwise to the first live replica whose in-flight count
   stays within its fair share, ceil((total + 1) / n). New prefixes thus spread evenly even when
   few of them (a handful of system prompts) hash unevenly.
The load bound for affinity: in-flight <= max(ceil(c * (total + 1) / n), least-loaded + slack)
(c = `load_factor`): under real load no replica takes more than c times its share, while a small
burst that shares a prefix (a group of 8 sent at once) stays together instead of computing the
prefix on every replica.

`random` routing (for the benchmark's baseline) ignores prompts.
"""

from __future__ import annotations

import bisect
import hashlib
import math
import random as _random
from collections import OrderedDict

import numpy as np

from .models import Replica

VIRTUAL_NODES = 64
MAX_BLOCKS = 64  # prompt blocks hashed per request (a 1k-token prefix at block size 16)
MAX_AFFINITY_KEYS = 200_000


def _digest(data: bytes) -> int:
    return int.from_bytes(hashlib.blake2b(data, digest_size=8).digest(), "little")


def block_keys(
    identity: str, prompt: list[int], block_size: int, max_blocks: int = MAX_BLOCKS, images=()
) -> list[int]:
    """Stable chained keys of the prompt's first full blocks (`images`: the prompt's `ImageInput`s,
    whose placeholders alone would not tell two images apart)."""
    n = min(len(prompt) // block_size, max_blocks)
    if n == 0:
        return []
    tokens = np.asarray(prompt[: n * block_size], dtype="<i4").tobytes()
    step = 4 * block_size
    keys, prev = [], _digest(identity.encode())
    for b in range(n):
        data = prev.to_bytes(8, "little") + tokens[b * step : (b + 1) * step]
        for im in images:
            if im.overlaps(b * block_size, (b + 1) * block_size):
                data += f"{im.content_hash}@{im.offset}".encode()
        prev = _digest(data)
        keys.append(prev)
    return keys


class Router:
    def __init__(self, policy: str = "prefix", load_factor: float = 1.25, slack: int = 8, seed: int = 0):
        if policy not in ("prefix", "random"):
            raise ValueError(f"routing policy {policy!r}: use 'prefix' or 'random'")
        self.policy = policy
        self.load_factor = load_factor
        self.slack = slack
        self._rng = _random.Random(seed)
        self._affinity: OrderedDict[int, int] = OrderedDict()  # block key -> replica index
        self._rings: dict[int, tuple[list[int], list[int]]] = {}  # n replicas -> (points, indices)

    def route(
        self, replicas: list[Replica], identity: str, prompt: list[int], block_size: int, images=()
    ) -> Replica:
        live = [r for r in replicas if r.alive]
        if not live:
            raise RuntimeError("no live replica")
        if len(live) == 1:
            return live[0]
        if self.policy == "random":
            return self._rng.choice(live)
        loads = [r.inflight_samples for r in live]
        share = math.ceil((sum(loads) + 1) / len(live))
        bound = max(math.ceil(self.load_factor * (sum(loads) + 1) / len(live)), min(loads) + self.slack)
        fits = {r.index: r for r in live if r.inflight_samples + 1 <= bound}
        keys = block_keys(identity, prompt, block_size, images=images)
        chosen = None
        for k in reversed(keys):
            idx = self._affinity.get(k)
            if idx is not None and idx in fits:
                chosen = fits[idx]
                break
        if chosen is None:  # never empty: the least loaded replica is within the fair share
            fair = {r.index: r for r in live if r.inflight_samples + 1 <= share}
            chosen = self._ring_walk(replicas, keys[0] if keys else _digest(identity.encode()), fair)
        for k in keys:
            self._affinity[k] = chosen.index
            self._affinity.move_to_end(k)
        while len(self._affinity) > MAX_AFFINITY_KEYS:
            self._affinity.popitem(last=False)
        return chosen

    def _ring_walk(self, replicas: list[Replica], key: int, fits: dict[int, Replica]) -> Replica:
        points, owners = self._ring(len(replicas))
        start = bisect.bisect_left(points, key % (1 << 64))
        for i in range(len(points)):
            rep = fits.get(owners[(start + i) % len(points)])
            if rep is not None:
                return rep
        return min(fits.values(), key=lambda r: r.inflight_samples)

    def _ring(self, n: int) -> tuple[list[int], list[int]]:
        ring = self._rings.get(n)
        if ring is None:
            pts = sorted(
                (_digest(f"replica-{i}-{v}".encode()), i) for i in range(n) for v in range(VIRTUAL_NODES)
            )
            ring = self._rings[n] = ([p for p, _ in pts], [i for _, i in pts])
        return ring
