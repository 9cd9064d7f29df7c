"""KV blocks that slide out of the window (sampler/window.py): a model whose every layer is windowed
frees them while a sequence runs, and a cached prefix whose early blocks were evicted is still
served exactly (kind 3 against a cold sampler and a full forward, tests/tolerance.py); a model
with a global layer frees nothing."""

from __future__ import annotations

import pytest
from conftest import TINY_WINDOW
from test_sampler import against_full_forward, make, prompt, req
from tolerance import assert_same_samples, fp64_model

from trine.engine.model.tokenizer import Tokenizer
from trine.engine.model.weights import load_model, read_config
from trine.engine.sampler.kv_cache import BlockManager
from trine.engine.sampler.scheduler import Scheduler
from trine.engine.sampler.window import SlidingBlocks, SlidingScheduler, freed_window, kv_classes

BS = 16  # the sampler's default block size
SPAN = -(-TINY_WINDOW // BS) + 1  # the most blocks a window of positions can touch


@pytest.fixture(scope="module")
def twins(tiny_windowed_dirs):
    d = tiny_windowed_dirs["gemma3-sliding"]
    tok = Tokenizer(d)
    return (load_model(d, "cpu"), tok), (fp64_model(d), tok)


def same_samples(compute, twins) -> None:
    (m32, tok), (m64, _) = twins
    assert_same_samples(lambda m: compute((m, tok)), m32, m64)


def held(sampler, seq) -> list[int]:
    """The blocks a sequence really holds (not the sink that stands for what it released)."""
    return [b for b in seq.blocks if b != sampler.kv.sink]


def test_only_a_model_whose_every_layer_is_windowed_frees_blocks(tiny_windowed_dirs):
    for family in ("gemma3", "olmo3"):  # a global layer reads every key to the end
        cfg = read_config(tiny_windowed_dirs[family])
        assert freed_window(cfg) is None and kv_classes(cfg) == (BlockManager, Scheduler)
    cfg = read_config(tiny_windowed_dirs["gemma3-sliding"])
    blocks, scheduler = kv_classes(cfg)
    assert freed_window(cfg) == TINY_WINDOW and blocks is SlidingBlocks and scheduler.func is SlidingScheduler


def test_a_long_generation_holds_only_its_window(twins):
    """A 40-token prompt decoding 60 tokens with 3 samples: from its first decode step on, each
    sequence holds at most the blocks its window touches, the released ones are free for others,
    and the samples are what a full forward gives."""
    p = prompt(40, seed=1)

    def compute(mt):
        s = make(mt, kv_cache_bytes=64 * 2 * 3 * 4 * 24 * 2 * BS)  # 64 blocks
        s.add(req(p, 60, n=3, seed=2))
        done, peak, available = [], 0, []
        while not done:
            done = s.step()
            for seq in s.scheduler.running:
                peak = max(peak, len(held(s, seq)))
                if len(seq.out) > 1:  # it decoded: the step's query was at position len - 2
                    gone = max(0, len(seq.tokens) - 1 - TINY_WINDOW) // BS
                    assert seq.blocks[:gone] == [s.kv.sink] * gone
            available.append(s.kv.num_free - s.scheduler.reserved)
            s.kv.check()
        assert peak <= SPAN + 1  # the window's blocks and the one the next token starts
        assert available[-2] > available[1] + 3  # what slid out went back to the pool as it ran
        assert s.stats["blocks_used"] == 0 and s.kv.blocks[s.kv.sink].ref == 1
        return (*against_full_forward(mt[0], p, done[0].sequences), [x.tokens for x in done[0].sequences])

    same_samples(compute, twins)


def test_a_prefix_whose_early_blocks_were_evicted_is_served_exactly(twins):
    """Blocks of 4 tokens, so a window of 8 reads two or three blocks. A chat's first turn (40 + 40
    tokens) slides past its first blocks, which are then evicted (the pool forgets what no one
    holds) while its later blocks stay cached. The next turn is served those later blocks (the
    sink for the evicted ones, metered as cached) and samples what a sampler without a prefix
    cache samples; so does a prompt that leaves the reply early. A prompt whose last window
    reaches an evicted block is served none of it."""
    p = prompt(40, seed=3)

    def compute(mt):
        hot, cold = make(mt, block_size=4), make(mt, block_size=4, enable_prefix_cache=False)
        hot.add(req(p, 40, temperature=0))
        done, forgot = [], 0
        while not done:
            done = hot.step()
            seq = hot.scheduler.running[0] if hot.scheduler.running else None
            if not forgot and seq is not None and len(seq.out) > 1:
                forgot = hot.reset_prefix_cache()  # the first decode step released blocks 0..7
        assert forgot == 8
        reply = done[0].sequences[0].tokens
        cases = (  # (name, prompt, cached tokens, full blocks hit)
            ("turn", p + reply + prompt(6, seed=4), 79, 11),  # blocks 8..18 and block 19's 3-token tail
            ("mid", p + reply[:10], 49, 4),  # blocks 8..11 and block 12's first token
            ("early", p[:38], 0, 0),  # the window of position 36 reads block 7, which is gone
        )
        reference, path, tokens = {}, {}, [reply]
        for name, q, cached, hits in cases:
            before = hot.stats["cache_hit_blocks"]
            got = hot.run([req(q, 8, n=2, seed=5)])[0]
            want = cold.run([req(q, 8, n=2, seed=5)])[0]
            assert (got.usage.cached_tokens, hot.stats["cache_hit_blocks"] - before) == (cached, hits)
            assert [x.tokens for x in got.sequences] == [x.tokens for x in want.sequences]
            reference[name], path[name] = (
                [x.logprobs for x in want.sequences],
                [x.logprobs for x in got.sequences],
            )
            full_ref, full_path = against_full_forward(mt[0], q, got.sequences)
            reference[name + " full"], path[name + " full"] = full_ref["full"], full_path["full"]
            tokens += [x.tokens for x in got.sequences]
        hot.kv.check()
        assert hot.stats["blocks_used"] == 0
        return reference, path, tokens

    same_samples(compute, twins)
