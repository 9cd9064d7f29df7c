"""Prefix-aware routing: stable block keys, affinity for growing prompts, bounded loads."""

from __future__ import annotations

import random

from trine.engine.api import ImageInput
from trine.service.models import Replica
from trine.service.routing import Router, block_keys


def _replicas(n: int) -> list[Replica]:
    return [Replica(i, engine=None) for i in range(n)]


def test_block_keys_are_stable_across_processes_and_depend_on_weights():
    prompt = list(range(1000, 1040))
    keys = block_keys("m\0ck", prompt, 16)
    # full blocks only; fixed values (blake2b), the same in every process, unlike salted hash()
    assert keys == [4867572638503693814, 4469386065086479619]
    assert block_keys("m\0other", prompt, 16)[0] != keys[0]
    assert block_keys("m\0ck", prompt[:20], 16) == keys[:1]  # a block's key depends only on its prefix


def test_block_keys_tell_images_with_equal_placeholders_apart():
    """Blocks overlapping an image are keyed by its content hash and offset, as the engine's cache."""
    prompt = [1, 2, 3] + [49152] * 40 + [4, 5]

    def image(h: str) -> ImageInput:
        return ImageInput(h, 3, 40, (1, 10, 16), b"", "png")

    a, b = (block_keys("m\0", prompt, 16, images=[image(h)]) for h in ("aa", "bb"))
    assert a != b and a[0] != b[0]  # every block meets the image here
    assert block_keys("m\0", prompt, 16, images=[image("aa")]) == a
    assert block_keys("m\0", prompt, 16) not in (a, b)


def test_conversations_and_groups_stick_to_one_replica_while_loads_stay_bounded():
    reps = _replicas(2)
    router = Router()
    rng = random.Random(0)
    homes = set()
    for _conv in range(20):  # each conversation grows turn by turn: its turns share one replica
        prompt = [rng.randrange(50000) for _ in range(40)]
        seen = set()
        for _turn in range(4):
            seen.add(router.route(reps, "m\0", prompt, 16).index)
            prompt = prompt + [rng.randrange(50000) for _ in range(30)]
        assert len(seen) == 1
        homes |= seen
    assert homes == {0, 1}  # different conversations spread over both replicas

    group = [5] * 80  # a group of 8 sent at once stays on one replica (within the slack)
    picks = []
    for _ in range(8):
        rep = router.route(reps, "m\0", group, 16)
        rep.inflight_samples += 1
        picks.append(rep.index)
    assert len(set(picks)) == 1
    for r in reps:
        r.inflight_samples = 0

    hot = [7] * 64  # one hot prefix; replica loads are in flight counts
    first = router.route(reps, "m\0", hot, 16)
    first.inflight_samples = 10
    other = router.route(reps, "m\0", hot, 16)
    assert other is not first  # over the load bound: spill to the other replica
    first.inflight_samples = 0


def test_dead_replicas_are_skipped_and_random_policy_ignores_prompts():
    reps = _replicas(3)
    router = Router()
    prompt = list(range(64))
    home = router.route(reps, "m\0", prompt, 16)
    home.alive = False
    assert router.route(reps, "m\0", prompt, 16) is not home
    rand = Router("random", seed=1)
    picks = {rand.route(reps, "m\0", prompt, 16).index for _ in range(30)}
    assert picks == {r.index for r in reps if r.alive}


def test_a_few_system_prompts_split_evenly_and_each_stays_on_one_replica():
    rng = random.Random(3)
    systems = [[rng.randrange(50000) for _ in range(96)] for _ in range(4)]
    reps = _replicas(2)
    router = Router()
    homes: dict[int, set[int]] = {}
    batch = []
    for i in range(48):  # 16 in flight at a time
        if len(batch) == 16:
            for r in batch:
                r.inflight_samples -= 1
            batch = []
        rep = router.route(reps, "m\0", systems[i % 4] + [rng.randrange(50000) for _ in range(20)], 16)
        rep.inflight_samples += 1
        batch.append(rep)
        homes.setdefault(i % 4, set()).add(rep.index)
    assert all(len(h) == 1 for h in homes.values())  # every system prompt is computed once
    assert sorted(sum((list(h) for h in homes.values()), [])) == [0, 0, 1, 1]
