"""The sampler's scheduler with plain numbers: no model, no forward, a clock the test drives.

Admission against the KV pool (worst-case reservations), the prefill budget sized by time, the
order of prefill chunks, and the prefill share: prompts held back while others decode, and the
debt that decode steps pay."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from trine.engine.api import SampleRequest, SamplingOptions, WeightsIdentity
from trine.engine.config import SamplerConfig
from trine.engine.sampler.admission import FifoAdmission
from trine.engine.sampler.kv_cache import BlockManager
from trine.engine.sampler.kv_layout import KVLayout
from trine.engine.sampler.scheduler import Scheduler, chunk_rows, fair_order
from trine.engine.sampler.sequence import Request, Sequence
from trine.engine.sampler.stops import Stops

BS = 4
W = WeightsIdentity("base")
_ids = iter(range(10**9))


def pool(num_blocks: int) -> BlockManager:
    return BlockManager(num_layers=1, num_kv_heads=1, head_dim=1, num_blocks=num_blocks, block_size=BS)


def request(n: int, max_tokens: int = 4, samples: int = 1, first: int = 0, **kw) -> Request:
    """A request whose prompt is n distinct tokens starting at `first`."""
    opts = SamplingOptions(max_tokens=max_tokens)
    req = SampleRequest(f"r{next(_ids)}", list(range(first, first + n)), opts, W, num_samples=samples, **kw)
    return Request(req, Stops.of(opts, frozenset()), scores_prompt=not req.generate)


def add(sch: Scheduler, *rs: Request) -> None:
    for r in rs:
        sch.add(r)


def prefill(sch: Scheduler, seconds: float = 0.0) -> list[tuple[Request, int]]:
    """Schedule a step, run its prefill rows as the step loop would (computed blocks are keyed in
    the prefix cache; a prompt completed forks its sequences, each with its first token) and report
    `seconds` for it; returns the rows."""
    plan = sch.schedule()
    for r, take in plan.prefill:
        KVLayout(sch.kv).cache_prompt(r, r.prefilled, r.prefilled + take)
        r.prefilled += take
        if not r.prompt_left:
            sch.prompt_done(r)
            for blocks in KVLayout(sch.kv).fork(r) if r.samples else []:
                s = Sequence(r, r.req.prompt + [0], blocks, [], None, sch.sample_reserve(r))
                stop(sch, s) if r.max_new == 1 else sch.start([s])
    if plan.prefill:
        sch.prefilled(plan, seconds)
    return plan.prefill


def decode(sch: Scheduler, seqs: list[Sequence]) -> None:
    """A decode step as the step loop runs it: blocks for the input tokens, then one new token each;
    a sequence with max_tokens new tokens stops."""
    sch.grow(seqs)
    for s in seqs:
        s.tokens.append(0)
        if len(s.tokens) - len(s.request.req.prompt) == s.request.max_new:
            stop(sch, s)
    sch.drop_stopped()


def stop(sch: Scheduler, s: Sequence, reason: str = "length") -> None:
    s.stop_reason = reason
    sch.release(s)


def decoding(sch: Scheduler, *rs: Request) -> None:
    """Bring `rs` to the decoding state: admitted and wholly prefilled."""
    add(sch, *rs)
    while any(r.prompt_left for r in rs):
        assert prefill(sch)


# ----------------------------------------------------------------------------- admission
def test_admission_reserves_worst_case_blocks_and_waits_when_they_are_short():
    sch = Scheduler(pool(10), SamplerConfig(max_batch_tokens=64))
    big = request(10, max_tokens=10)  # 3 prompt blocks (2 full + 1 partial) + 2 more while decoding
    assert sch.blocks_needed(10, 10, 1) == 5
    add(sch, big)
    sch.schedule()
    assert sch.prefilling == [big] and len(big.blocks) == 3 and sch.reserved == 2
    # 7 blocks free, 2 of them promised to `big`: a request needing 6 must wait, though 7 are free
    second = request(10, max_tokens=14, first=100)
    assert sch.blocks_needed(10, 14, 1) == 6
    add(sch, second)
    sch.schedule()
    assert sch.prefilling == [big] and len(sch.waiting) == 1 and second.blocks == []
    assert sch.kv.num_free == 7  # refused: it holds nothing


def test_a_request_that_does_not_fit_holds_back_the_ones_behind_it_in_arrival_order():
    sch = Scheduler(pool(8), SamplerConfig(max_batch_tokens=64))
    add(
        sch,
        request(16, max_tokens=8),
        request(16, max_tokens=8, first=100),
        request(2, max_tokens=2, first=200),
    )
    sch.schedule()
    assert len(sch.prefilling) == 1 and len(sch.waiting) == 2  # the small third one waits its turn


def test_samples_share_the_full_prompt_blocks_and_reserve_their_own():
    sch = Scheduler(pool(32), SamplerConfig(max_batch_tokens=64))
    r = request(10, max_tokens=7, samples=3)  # each sample: a copy of the partial block + 1 more block
    add(sch, r)
    sch.schedule()
    assert len(r.blocks) == 3 and len(r.copies) == 2 and r.reserved == sch.reserved == 3
    assert sch.blocks_needed(10, 7, 3) == 2 + 3 * 2


def test_grow_and_release_keep_the_reservation_balanced():
    sch = Scheduler(pool(16), SamplerConfig(max_batch_tokens=64))
    r = request(4, max_tokens=9)  # KV of 4 + 9 - 1 positions (never the last token's): 1 + 2 blocks
    decoding(sch, r)
    (s,) = sch.running
    assert s.reserve == sch.reserved == 2 and len(s.blocks) == 1
    for _ in range(7):  # tokens 2..8: the inputs at positions 4 and 8 start new blocks
        decode(sch, [s])
    assert len(s.blocks) == 3 and s.reserve == sch.reserved == 0 and s.stop_reason is None
    decode(sch, [s])  # the 9th token: never computed, no block
    assert s.stop_reason == "length" and len(s.tokens) == 13
    assert sch.reserved == 0 and sch.kv.num_used == 0 and not sch.has_work()


def test_max_running_bounds_admission_but_never_blocks_an_idle_sampler():
    sch = Scheduler(pool(64), SamplerConfig(max_batch_tokens=64, max_running=4))
    add(sch, request(4, samples=3), request(4, samples=3, first=50))
    sch.schedule()
    assert len(sch.prefilling) == 1  # 3 + 3 > 4
    alone = Scheduler(pool(64), SamplerConfig(max_batch_tokens=64, max_running=2))
    add(alone, request(4, samples=5))
    alone.schedule()
    assert len(alone.prefilling) == 1  # more samples than max_running, but nothing else runs


def test_a_prompt_waits_for_blocks_another_request_is_computing_then_hits_them():
    sch = Scheduler(pool(64), SamplerConfig(max_batch_tokens=4 * BS))
    first, second = request(40), request(40)  # the same prompt
    add(sch, first)
    prefill(sch)  # the first chunk: 4 blocks of 10 computed and keyed
    add(sch, second)
    while first.prompt_left:
        assert second not in sch.prefilling  # its next block is being computed by `first`
        assert all(sch.kv.blocks[b].ref == 1 for b in first.blocks)  # it let go of its hits
        prefill(sch)
    assert prefill(sch) == [(second, 1)]  # prompt[:-1] came cached: 9 full blocks, 3 of the 10th
    assert second.cached == 39 and not second.prompt_left


def test_cancel_gives_back_prompt_blocks_copies_and_reservation():
    sch = Scheduler(pool(32), SamplerConfig(max_batch_tokens=8))
    r = request(30, max_tokens=8, samples=2)
    add(sch, r)
    prefill(sch)
    assert sch.prefilling == [r] and sch.reserved > 0
    sch.cancel(r)
    assert sch.reserved == 0 and sch.kv.num_used == 0 and not sch.has_work()
    queued = request(4)
    add(sch, queued)
    sch.cancel(queued)
    assert not sch.has_work()


def test_admission_order_is_the_policys():
    class Newest(FifoAdmission):
        def peek(self, held=()):
            return self._queue[-1] if self._queue else None

    sch = Scheduler(pool(6), SamplerConfig(max_batch_tokens=64), admission=Newest())
    old, new = request(16, max_tokens=4), request(16, max_tokens=4, first=100)  # 5 blocks each
    add(sch, old, new)
    sch.schedule()
    assert sch.prefilling == [new] and len(sch.waiting) == 1


# ----------------------------------------------------------------------------- prefill chunks
def test_the_prefill_budget_follows_the_measured_step_time_while_others_decode():
    sch = Scheduler(
        pool(512), SamplerConfig(max_batch_tokens=256, prefill_step_seconds=0.25, min_prefill_tokens=1)
    )
    assert sch._prefill_budget(decoding=True) == 4 * BS  # nothing measured yet: 4 blocks
    sch.last_prefill = (16, 0.5)
    assert sch._prefill_budget(decoding=True) == 8  # 16 tokens took 0.5 s: 8 take 0.25 s
    sch.last_prefill = (8, 0.01)
    assert sch._prefill_budget(decoding=True) == 16  # fast: at most twice the last chunk
    sch.last_prefill = (32, 10.0)
    assert sch._prefill_budget(decoding=True) == BS  # slow: never below one block
    sch.last_prefill = (256, 0.01)
    assert sch._prefill_budget(decoding=True) == 256  # never above max_batch_tokens


def test_a_prefill_chunk_beside_decoding_sequences_never_drops_below_the_token_floor():
    """On a slow or busy CPU, time alone would cut chunks to a few tokens, each paying a step."""
    sch = Scheduler(
        pool(512), SamplerConfig(max_batch_tokens=256, prefill_step_seconds=0.25, min_prefill_tokens=64)
    )
    assert sch._prefill_budget(decoding=True) == 64  # nothing measured yet: the floor over 4 blocks
    sch.last_prefill = (64, 10.0)  # very slow: time alone says one token
    assert sch._prefill_budget(decoding=True) == 64
    sch.last_prefill = (64, 0.05)  # fast: time rules above the floor
    assert sch._prefill_budget(decoding=True) == 128
    small = Scheduler(pool(512), SamplerConfig(max_batch_tokens=32, min_prefill_tokens=64))
    small.last_prefill = (32, 10.0)
    assert small._prefill_budget(decoding=True) == 32  # never above max_batch_tokens


def test_when_nothing_decodes_whole_prompts_prefill_in_one_forward():
    sch = Scheduler(pool(4096), SamplerConfig(max_batch_tokens=2048, idle_prefill_seconds=1.0))
    group = [request(512, first=1000 * i, samples=8) for i in range(4)]  # a GRPO step
    add(sch, *group)
    assert prefill(sch, seconds=0.5) == [(r, 512) for r in group]  # nothing measured: all of it
    long = request(3000, generate=False, first=9000)
    add(sch, long)
    sch.running = []  # the group's samples finished
    assert prefill(sch, seconds=0.5) == [(long, 2048)]  # at most max_batch_tokens


def test_when_nothing_decodes_a_slow_prefill_is_bounded_by_time_so_a_newcomer_starts_soon():
    """A prompt of many thousand tokens alone on the engine (prompt logprobs: nothing decodes)
    takes chunks of about `idle_prefill_seconds`, so a short request arriving waits one of them."""
    sch = Scheduler(pool(4096), SamplerConfig(max_batch_tokens=2048, idle_prefill_seconds=1.0))
    long = request(8000, generate=False)
    add(sch, long)
    assert prefill(sch, seconds=8.0) == [(long, 2048)]  # nothing measured yet: the whole budget
    assert prefill(sch, seconds=1.0) == [(long, 256)]  # 2048 took 8 s: 256 take 1 s
    short = request(8, max_tokens=4, first=20000)
    add(sch, short)
    rows = prefill(sch, seconds=0.1)  # the next step starts with the newcomer, whole
    assert rows[0] == (short, 8) and len(rows) * 8 <= 256
    assert sch.running and sch.running[0].request is short


def test_an_idle_chunk_is_sized_from_the_last_large_chunk_not_a_small_one():
    """A few dozen positions (a chat turn's new tokens) take most of a large chunk's time: the
    next GRPO step's prompts, prefilled when nothing decodes, are not cut to a few blocks."""
    sch = Scheduler(pool(4096), SamplerConfig(max_batch_tokens=2048, idle_prefill_seconds=1.0))
    sch.last_prefill = (80, 0.15)  # a small chunk only (or the first, slowed by one-time costs)
    assert sch._prefill_budget(decoding=False) == 2048  # as if nothing were measured
    group = [request(512, first=1000 * i, samples=8) for i in range(6)]
    add(sch, *group)
    assert len(prefill(sch, seconds=3.2)) == 4  # 2048 positions in 3.2 s: 640 a second
    sch.last_prefill = (80, 0.15)  # then a small chunk: the rate comes from the large one
    assert sch._prefill_budget(decoding=False) == 640
    assert sch._prefill_budget(decoding=True) == 133  # beside decoding: from the last chunk (0.25 s)


def test_an_idle_chunk_size_measured_in_a_slow_moment_recovers():
    """A large chunk slowed once (a cold process, a busy machine) sizes the next ones short; a
    short chunk that runs faster per position than that proves the rate stale."""
    sch = Scheduler(pool(4096), SamplerConfig(max_batch_tokens=2048, idle_prefill_seconds=1.0))
    sch.rate_prefill = sch.last_prefill = (2048, 5.0)
    assert sch._prefill_budget(decoding=False) == 409
    add(sch, request(3000, generate=False))
    assert prefill(sch, seconds=0.35)[0][1] == 409  # 409 positions in 0.35 s: 1168 a second
    assert sch._prefill_budget(decoding=False) == 1168


def test_a_long_prompts_slower_later_chunks_update_the_rate():
    """Deep in a long prompt attention makes each position slower: a chunk of fewer than
    RATE_POSITIONS positions that took half its seconds or more shows the rate, so the next idle
    chunk is sized from it, not from the faster chunks near the prompt's start."""
    sch = Scheduler(
        pool(4096), SamplerConfig(max_batch_tokens=2048, idle_prefill_seconds=1.0, min_prefill_tokens=16)
    )
    sch.rate_prefill = sch.last_prefill = (2048, 8.0)  # 256 a second near the start
    add(sch, request(8000, generate=False))
    assert prefill(sch, seconds=2.5)[0][1] == 256  # sized from that rate, it took 2.5 s
    assert prefill(sch, seconds=1.0)[0][1] == 102  # sized from the slower chunk: 102 a second
    assert sch._prefill_budget(decoding=False) == 102


def test_a_short_request_beside_a_long_prompt_is_prefilled_alone_then_decodes_beside_it():
    """Nothing decodes yet, but the short request samples as soon as it is prefilled: its step holds
    it alone, not beside an idle-sized chunk of the long prompt, whose next chunk is then one the
    new sequence decodes beside (sized to prefill_step_seconds and paid for as debt)."""
    sch = Scheduler(
        pool(4096), SamplerConfig(max_batch_tokens=2048, idle_prefill_seconds=1.0, prefill_step_seconds=0.25)
    )
    long = request(8000, generate=False)
    add(sch, long)
    prefill(sch, seconds=8.0)  # 2048 positions in 8 s
    assert prefill(sch, seconds=1.0) == [(long, 256)]  # alone: an idle chunk
    short = request(8, max_tokens=4, first=20000)
    sch.clock = lambda: 10.0  # long after the long prompt arrived: no batch sent together
    add(sch, short)
    assert prefill(sch, seconds=0.05) == [(short, 8)]
    plan = sch.schedule()
    assert [s.request for s in plan.decode] == [short] and plan.prefill[0][0] is long
    assert plan.prefill[0][1] <= 128 and plan.charged  # 0.25 s of it, owed by the decode steps


def test_a_long_prompt_is_never_part_of_a_batch_sent_together():
    """A short request sent with a long prompt (same tenant, same moment) decodes every step
    beside its chunks: it is not held, as a batch's first sequences are, until the long prompt is
    prefilled, nor given a token per idle chunk."""
    sch = Scheduler(pool(4096), SamplerConfig(max_batch_tokens=256, idle_prefill_seconds=1.0))
    long, short = request(3000, max_tokens=2), request(8, max_tokens=8, first=20000)
    add(sch, long, short)  # the same instant, one tenant
    prefill(sch, seconds=0.1)
    (seq,) = sch.running
    assert seq.request is short
    for _ in range(4):
        plan = sch.schedule()
        assert plan.decode == [seq]  # decoded every step, not stalled
        assert sum(t for _, t in plan.prefill) <= 256
        if plan.prefill:
            sch.prefilled(plan, 0.1)
        long.prefilled += sum(t for r, t in plan.prefill if r is long)


def test_the_token_floor_falls_with_the_attention_work_deep_in_a_prompt():
    """The floor is for the GEMMs' rows: a chunk at a position where attention is most of each
    row's work may be smaller, so it still ends in about its seconds."""
    sch = Scheduler(pool(4096), SamplerConfig(max_batch_tokens=2048, min_prefill_tokens=128), key_cost=3e-4)
    sch.last_prefill = (128, 2.0)  # deep in a long prompt: 128 positions took 2 s
    assert sch._prefill_budget(decoding=True, position=0) == 128  # the floor near the start
    assert sch._prefill_budget(decoding=True, position=7000) == 41  # 128 / (1 + 2.1)
    assert Scheduler(pool(4096), SamplerConfig(min_prefill_tokens=128))._prefill_budget(True, 7000) >= 4 * BS


def test_prompts_with_the_fewest_tokens_left_go_first_and_the_longest_takes_the_rest():
    sch = Scheduler(pool(256), SamplerConfig(max_batch_tokens=64))
    long, mid, short = request(300, first=0), request(30, first=1000), request(9, first=2000)
    add(sch, long, mid, short)
    assert prefill(sch) == [(short, 9), (mid, 30)]  # `long` would pad both to 3 x 21
    sch.running = []
    assert prefill(sch) == [(long, 64)]


@given(st.lists(st.integers(1, 300), min_size=1, max_size=12), st.integers(1, 512))
def test_a_prefill_chunk_never_exceeds_the_budget_padding_included(lefts, budget):
    ready = [request(n) for n in lefts]
    rows = chunk_rows(fair_order(ready, {}), budget)  # one tenant: fewest tokens left first
    assert rows and len(rows) * max(take for _, take in rows) <= budget
    assert [r.prompt_left for r, _ in rows] == sorted(lefts)[: len(rows)]  # fewest tokens left first
    assert all(take == r.prompt_left for r, take in rows[:-1])  # whole, but the last


# ----------------------------------------------------------------------------- prefill share
def test_an_old_prompt_is_held_back_while_a_newer_request_decodes_until_decode_steps_pay_its_debt():
    sch = Scheduler(pool(512), SamplerConfig(max_batch_tokens=64, prefill_share=0.5))
    old = request(1000, generate=False)
    add(sch, old)
    prefill(sch, seconds=3.0)  # nobody decodes: no debt
    assert sch.debt == 0
    new = request(4, max_tokens=30, first=5000)
    add(sch, new)
    rows = prefill(sch, seconds=3.0)  # `new` is short and newer than every decoder: it goes
    assert new in [r for r, _ in rows] and sch.running and sch.debt == 0
    plan = sch.schedule()  # `old` now runs while `new` decodes: its chunk's time is a debt
    assert [r for r, _ in plan.prefill] == [old] and plan.charged and plan.decode == sch.running
    sch.prefilled(plan, 3.0)
    sch.decoded(1.0)
    assert sch.debt == pytest.approx(2.5)
    for _ in range(4):  # 4 more decode steps at 1 s each pay 0.5 s each: 0.5 s still owed
        plan = sch.schedule()
        assert plan.prefill == [] and plan.decode
        sch.decoded(1.0)
    plan = sch.schedule()
    assert plan.prefill == []
    sch.decoded(1.0)
    assert sch.debt == 0
    assert [r for r, _ in sch.schedule().prefill] == [old]  # paid: its next chunk


def test_newcomers_prefill_while_an_older_prompt_owes_time():
    sch = Scheduler(pool(512), SamplerConfig(max_batch_tokens=64, prefill_share=0.5))
    first = request(4, max_tokens=30)
    decoding(sch, first)
    old = request(1000, generate=False, first=100)
    add(sch, old)
    plan = sch.schedule()
    sch.prefilled(plan, 5.0)  # charged: `first` decodes
    assert sch.debt == 5.0
    grpo = [request(20, max_tokens=8, first=3000 + 100 * i) for i in range(3)]
    add(sch, *grpo)
    sch.last_prefill = (64, 0.0)  # a budget for all three
    plan = sch.schedule()  # newer than every decoder and short: they prefill despite the debt,
    # and `old`, newer than `first` too but longer than max_batch_tokens, still waits
    assert {r for r, _ in plan.prefill} == set(grpo) and not plan.charged
    sch.prefilled(plan, 1.0)
    assert sch.debt == 5.0  # their chunk is not the old prompt's debt


def test_a_prompt_longer_than_the_batch_is_held_back_even_when_it_is_newer():
    sch = Scheduler(pool(512), SamplerConfig(max_batch_tokens=64, prefill_share=0.5))
    decoding(sch, request(4, max_tokens=30))
    sch.debt = 1.0
    longer, fits = request(65, generate=False, first=100), request(64, generate=False, first=200)
    add(sch, longer, fits)
    assert [r for r, _ in sch.schedule().prefill] == [fits]


def test_without_decoders_the_debt_is_forgiven():
    sch = Scheduler(pool(512), SamplerConfig(max_batch_tokens=64))
    add(sch, request(1000, generate=False))
    sch.debt = 10.0
    assert sch.schedule().prefill and sch.debt == 0


@pytest.mark.parametrize(
    "kw", [dict(max_batch_tokens=0), dict(max_running=0), dict(prefill_share=0), dict(prefill_step_seconds=0)]
)
def test_bad_settings_are_refused(kw):
    with pytest.raises(ValueError):
        Scheduler(pool(4), SamplerConfig(**kw))


# ----------------------------------------------------------------------------- invariants
@settings(max_examples=60, deadline=None)
@given(
    st.lists(
        st.tuples(
            st.sampled_from(["add", "step", "step", "step", "cancel"]),
            st.integers(1, 40),
            st.integers(1, 12),
            st.integers(1, 3),
            st.booleans(),
        ),
        max_size=40,
    )
)
def test_reservations_always_balance_and_no_sequence_runs_out_of_blocks(ops):
    """Random arrivals, steps (prefill as planned, then one token for every decoding sequence)
    and cancels: the reservation is always what admitted requests still may allocate."""
    sch = Scheduler(pool(24), SamplerConfig(max_batch_tokens=16, max_running=6))
    live: list[Request] = []
    for op, n, max_tokens, samples, generate in ops:
        if (
            op == "add"
            and sch.blocks_needed(n, max_tokens if generate else 0, samples if generate else 0) <= 24
        ):
            live.append(request(n, max_tokens=max_tokens, samples=samples, generate=generate, first=n * 100))
            sch.add(live[-1])
        elif op == "cancel" and live:
            r = live.pop(n % len(live))
            sch.cancel(r)
            for s in sch.running:
                if s.request is r:
                    stop(sch, s, "cancelled")
            sch.drop_stopped()
        elif op == "step":
            running = list(sch.running)
            prefill(sch)
            decode(sch, running)  # grow never raises NoFreeBlocks
        sch.kv.check()
        assert sch.reserved == sum(r.reserved for r in sch.prefilling) + sum(s.reserve for s in sch.running)
        assert 0 <= sch.reserved <= sch.kv.num_free
