"""Fairness across tenants (API keys) in the sampler's scheduler, with plain numbers: admission
by tokens, each tenant's share of the running batch and KV pool, and prefill rows shared by tokens."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st
from test_scheduler import add, pool, prefill, request

from trine.engine.config import SamplerConfig
from trine.engine.sampler.admission import FairAdmission, admission_cost
from trine.engine.sampler.scheduler import Scheduler


def tenants(sch: Scheduler) -> dict[str, int]:
    """Samples admitted (prefilling or running) per tenant."""
    out: dict[str, int] = {}
    for r in sch.prefilling:
        out[r.req.tenant] = out.get(r.req.tenant, 0) + r.samples
    for s in sch.running:
        out[s.request.req.tenant] = out.get(s.request.req.tenant, 0) + 1
    return out


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def was_active(sch: Scheduler, tenant: str) -> None:
    """`tenant` had a request here a moment ago (admitted, then cancelled)."""
    r = request(8, tenant=tenant, first=50_000)
    add(sch, r)
    sch.schedule()
    sch.cancel(r)


def test_a_flood_leaves_room_for_another_tenants_request_to_start_at_once():
    sch = Scheduler(pool(4096), SamplerConfig(max_batch_tokens=4096, max_running=8))
    was_active(sch, "B")
    add(sch, *[request(8, tenant="A", first=100 * i) for i in range(50)])
    sch.schedule()
    assert tenants(sch) == {"A": 4}  # half of max_running; the rest of A's flood waits, not refused
    add(sch, request(8, tenant="B", first=9000))
    sch.schedule()
    assert tenants(sch) == {"A": 4, "B": 1}
    assert len(sch.waiting) == 46


def test_a_tenant_over_its_kv_share_waits_while_others_are_admitted():
    sch = Scheduler(pool(40), SamplerConfig(max_batch_tokens=4096, max_running=64))  # a tenant: 20 blocks
    was_active(sch, "B")
    add(sch, *[request(16, max_tokens=16, tenant="A", first=100 * i) for i in range(10)])  # 8 blocks each
    sch.schedule()
    assert tenants(sch) == {"A": 2}
    add(sch, request(16, max_tokens=16, tenant="B", first=9000))
    sch.schedule()
    assert tenants(sch) == {"A": 2, "B": 1}


def test_a_tenant_alone_uses_the_whole_engine_until_another_one_shows_up():
    clock = Clock()
    sch = Scheduler(pool(4096), SamplerConfig(max_batch_tokens=4096, max_running=8), clock=clock)
    add(sch, *[request(8, tenant="A", first=100 * i) for i in range(50)])
    sch.schedule()
    assert tenants(sch) == {"A": 8}  # a single user's GRPO batch is not cut to the share
    add(sch, request(8, tenant="B", first=9000))  # waits for a slot, then is first in line
    clock.now += 1
    sch.schedule()
    assert tenants(sch) == {"A": 8}
    sch.cancel(sch.prefilling[0])  # one of A's requests ends: B takes its slot, A is now held to 4
    sch.schedule()
    assert tenants(sch) == {"A": 7, "B": 1}


def test_the_share_lifts_once_the_other_tenant_has_been_gone_for_the_window():
    clock = Clock()
    sch = Scheduler(
        pool(4096), SamplerConfig(max_batch_tokens=4096, max_running=8), clock=clock, tenant_window=60
    )
    was_active(sch, "B")
    add(sch, *[request(8, tenant="A", first=100 * i) for i in range(50)])
    sch.schedule()
    assert tenants(sch) == {"A": 4}
    clock.now += 61
    sch.schedule()
    assert tenants(sch) == {"A": 8}


def test_a_single_request_larger_than_the_share_is_still_admitted():
    sch = Scheduler(pool(40), SamplerConfig(max_batch_tokens=4096))
    big = request(100, max_tokens=40, tenant="A")  # 35 blocks: more than the tenant's 20
    add(sch, big)
    sch.schedule()
    assert sch.prefilling == [big]


def test_admission_alternates_between_tenants_by_tokens():
    policy = FairAdmission()
    sch = Scheduler(pool(4096), SamplerConfig(max_running=64), admission=policy)
    flood = [request(8, tenant="A", first=100 * i) for i in range(5)]
    add(sch, *flood)
    late = request(8, tenant="B", first=9000)
    add(sch, late)
    order = []
    while (r := policy.peek()) is not None:
        policy.pop(r)
        order.append(r)
    assert order.index(late) <= 1  # behind at most the request at the head when it arrived


@settings(max_examples=60, deadline=None)
@given(
    st.lists(
        st.tuples(st.sampled_from("ABC"), st.integers(1, 40), st.integers(1, 40)), min_size=2, max_size=60
    )
)
def test_tokens_admitted_while_tenants_wait_differ_by_at_most_one_request(reqs):
    """Every tenant waits from the start: while two tenants both still wait, the tokens admitted for
    them differ by at most the largest request's cost."""
    policy = FairAdmission()
    sch = Scheduler(pool(4096), admission=policy)
    rs = [request(n, max_tokens=m, tenant=t, first=1000 * i) for i, (t, n, m) in enumerate(reqs)]
    add(sch, *rs)
    biggest = max(admission_cost(r) for r in rs)
    left = {t: sum(1 for r in rs if r.req.tenant == t) for t in "ABC"}
    served = dict.fromkeys("ABC", 0)
    while (r := policy.peek()) is not None:
        policy.pop(r)
        t = r.req.tenant
        served[t] += admission_cost(r)
        left[t] -= 1
        waiting = [u for u in "ABC" if left[u]]
        for u in waiting:
            for v in waiting:
                assert served[u] - served[v] <= biggest


def test_many_short_prompts_of_one_tenant_do_not_hold_back_anothers_long_prompt():
    sch = Scheduler(pool(4096), SamplerConfig(max_batch_tokens=64, max_running=64))
    long = request(64, tenant="B", first=9000)
    add(sch, long, *[request(8, tenant="A", first=100 * i) for i in range(40)])
    for _ in range(3):
        prefill(sch)
    assert long.prefilled > 0  # fewest-tokens-first alone would prefill all 320 of A's tokens first


def test_a_long_prompt_of_one_tenant_does_not_hold_back_anothers_short_one():
    sch = Scheduler(pool(4096), SamplerConfig(max_batch_tokens=64))
    longs = [request(512, tenant="A", first=1000 * i, generate=False) for i in range(2)]
    add(sch, *longs)
    prefill(sch)
    short = request(8, tenant="B", first=9000)
    add(sch, short)
    rows = prefill(sch)
    assert (short, 8) in rows


def test_one_tenant_is_prefilled_fewest_tokens_first():
    sch = Scheduler(pool(4096), SamplerConfig(max_batch_tokens=64))
    a, b, c = request(40), request(8, first=100), request(16, first=200)
    add(sch, a, b, c)
    # nothing decodes: the whole budget (64 positions, rows x the longest row), the last row partial
    assert prefill(sch) == [(b, 8), (c, 16), (a, 21)]
