"""Usage events, the rate card and reports: totals add up, prices come from TOML, costs by phase."""

from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from trine.metering.events import PHASES, UsageEvent
from trine.metering.rates import SHIPPED, RateCard
from trine.metering.report import Report, build_report, render

T0 = 1_767_600_000.0  # 2026-01-05 08:00 UTC


def ev(op="sample", *, t=T0, key="k1", session="s1", run="r1", model="SmolLM2-135M-Instruct", **n):
    return UsageEvent(
        time=t, api_key_id=key, session_id=session, run_id=run, base_model=model, operation=op, **n
    )


@pytest.fixture
def card(tmp_path):
    return RateCard.load(home=tmp_path)  # shipped card only: the test must not see ~/.trine


def test_event_validation():
    with pytest.raises(ValueError, match="operation"):
        ev("train")
    with pytest.raises(ValueError, match="prefill"):
        ev(prefill=-1)
    with pytest.raises(ValueError, match="train_loss"):
        ev("forward_backward", train=3, train_loss=4)
    with pytest.raises(ValueError, match="does not add up"):
        UsageEvent.from_counts(
            prompt_tokens=10,
            prefill=6,
            prefill_cached=3,
            time=T0,
            api_key_id="k",
            session_id="s",
            run_id="r",
            base_model="m",
            operation="sample",
        )
    e = UsageEvent.from_counts(
        prompt_tokens=10,
        prefill=6,
        prefill_cached=4,
        sample=5,
        time=T0,
        api_key_id="k",
        session_id="s",
        run_id="r",
        base_model="m",
        operation="sample",
    )
    assert e.prompt_tokens == 10 and UsageEvent.from_dict(e.to_dict()) == e


def test_shipped_card_proportions(card):
    # money here is plain fp64 arithmetic (the same bits on every CPU): a price is a decimal read
    # once, a product or a sum of a few rounds once each (1.1e-16), so rel 1e-12 where the test's
    # formula and the code's may differ in order (abs=0: pytest's default floor of 1e-12 would be
    # 1e-8 of these amounts), == where they are the same operation
    for row in card.rows.values():
        assert row.prefill_cached == pytest.approx(0.2 * row.prefill, rel=1e-12, abs=0)
        assert row.train >= 2.5 * row.prefill and row.sample >= 2.5 * row.prefill
        assert row.storage_gb_month == 0.10  # the card's decimal, read as a float
    assert card.price("HuggingFaceTB/SmolLM2-135M-Instruct").model == "SmolLM2-135M-Instruct"
    assert card.price("/models/qwen3-8b/").model == "Qwen3-8B"
    assert card.price("never-heard-of-it").model == "default"
    ids = {m["model_id"] for m in card.as_models_list()}
    assert {"default", "SmolLM2-135M-Instruct", "Qwen3-8B"} <= ids
    assert all(
        set(m["pricing"]) >= {"prefill", "prefill_cached", "sample", "train"} for m in card.as_models_list()
    )


def test_user_card_overrides(tmp_path):
    (tmp_path / "rates.toml").write_text(
        '[models."SmolLM2-135M-Instruct"]\nprefill = 1.0\n\n'
        '[models."my-model"]\nprefill = 2\nsample = 6\ntrain = 6\nstorage_gb_month = 1\n'
    )
    card = RateCard.load(home=tmp_path)
    smol = card.price("SmolLM2-135M-Instruct")
    assert (smol.prefill, smol.prefill_cached, smol.sample) == (
        1.0,
        0.2,
        0.03,
    )  # cached re-derived, rest kept
    mine = card.price("My-Model")
    assert (mine.prefill, mine.prefill_cached, mine.train, mine.storage_gb_month) == (2, 0.4, 6, 1)
    assert card.storage_cost("my-model", 3) == 3
    extra = tmp_path / "x.toml"
    extra.write_text("[models.default]\ntrain = 9\n")
    assert RateCard.load(extra, home=tmp_path).price("zzz").train == 9


@pytest.mark.parametrize(
    "text, msg",
    [
        ("[models.a]\nprefill = -1\nsample = 1\ntrain = 1\n", "prefill"),
        ('[models.a]\nprefill = 1\nsample = "x"\ntrain = 1\n', "sample"),
        ("[models.a]\nprefill = 1\ntrain = 1\n", "sample"),
        ("[models.a]\nprefil = 1\n", "prefil"),
        ("prices = 1\n", "prices"),
        ("[models\n", "TOML"),
    ],
)
def test_bad_user_card(tmp_path, text, msg):
    (tmp_path / "rates.toml").write_text(text)
    with pytest.raises(ValueError, match=msg):
        RateCard.load(home=tmp_path)
    with pytest.raises(ValueError, match="--rates"):
        RateCard.load(tmp_path / "missing.toml")


def test_cost_by_phase(card):
    e = ev(prefill=1_000_000, prefill_cached=2_000_000, sample=1_000_000)
    c = card.cost(e)
    assert c == pytest.approx(
        {
            "prefill": 0.01,
            "prefill_cached": 0.004,
            "sample": 0.03,
            "train": 0.0,
            "prefill_image": 0.0,
            "prefill_image_cached": 0.0,
            "total": 0.044,
        },
        rel=1e-12,
        abs=0,
    )  # tokens x price / 1e6 and their sum: a few fp64 roundings
    f = ev("forward_backward", model="unknown", train=1_000_000, train_loss=10)
    assert card.cost(f)["train"] == pytest.approx(
        0.30, rel=1e-12, abs=0
    )  # loss tokens are not billed on their own


def test_report_totals_and_groups(card):
    events = [
        ev(prefill=100, prefill_cached=0, sample=64),
        ev(prefill=20, prefill_cached=80, sample=64, t=T0 + 10),
        ev("compute_logprobs", prefill=300, t=T0 + 3600, run="r2"),
        ev("forward_backward", train=512, train_loss=128, t=T0 + 3700, run="r2", model="Qwen3-8B"),
        ev("optim_step", t=T0 + 3701, run="r2", model="Qwen3-8B"),
    ]
    for by in (None, "hour", "run", "model", "session"):
        r = build_report(events, by, card)
        for ph in PHASES:
            assert getattr(r.total.tokens, ph) == sum(getattr(e, ph) for e in events)
            if by:
                assert sum(getattr(row.tokens, ph) for row in r.rows) == getattr(r.total.tokens, ph)
        assert r.total.requests == len(events)
        # 5 events' costs added in another order: within gamma_5 of their sum, far below 1e-12
        assert r.total.cost["total"] == pytest.approx(
            sum(card.cost(e)["total"] for e in events), rel=1e-12, abs=0
        )
    r = build_report(events, "hour", card)
    assert [row.key for row in r.rows] == ["2026-01-05 08:00Z", "2026-01-05 09:00Z"]
    assert r.total.tokens.cache_hit_rate == 80 / 500  # one correctly rounded division of the counts
    assert r.total.tokens.loss_fraction == 128 / 512
    assert r.total.dominant_phase == "train"  # 512 tokens at Qwen3-8B's train price outweigh the rest
    by_model = {row.key: row for row in build_report(events, "model", card).rows}
    assert by_model["Qwen3-8B"].cost["train"] == pytest.approx(512 * 0.40 / 1e6, rel=1e-12, abs=0)
    d = json.loads(r.to_json())
    assert d["total"]["tokens"]["prompt"] == 500 and len(d["rows"]) == 2
    assert Report.from_dict(d).to_dict() == d
    assert [row.key for row in build_report(events, "day", card).rows] == ["2026-01-05"]
    minutes = build_report(events, "minute", card).rows
    assert len(minutes) >= 2 and all(row.key[-1] == "Z" and len(row.key) == 17 for row in minutes)
    assert sum(row.requests for row in minutes) == len(events)
    with pytest.raises(ValueError, match="by"):
        build_report(events, "week", card)


def test_report_renders(card, capsys):
    from rich.console import Console

    events = [ev(prefill=100, sample=10), ev("forward_backward", train=50, train_loss=10)]
    console = Console(width=160, force_terminal=False)
    render(build_report(events, "run", card), console)
    out = capsys.readouterr().out
    assert "r1" in out and "total" in out and "dominant phase" in out and "cost by phase" in out


counts = st.integers(0, 10_000)


@settings(max_examples=50, deadline=None)
@given(
    st.lists(
        st.tuples(
            st.sampled_from(["sample", "forward_backward"]),
            counts,
            counts,
            counts,
            counts,
            st.integers(0, 3),
            st.sampled_from(["a", "b", "Qwen3-8B"]),
        ),
        max_size=30,
    )
)
def test_report_totals_property(rows):
    card = RateCard.from_tomls([("shipped", SHIPPED.read_text())])
    events = [
        ev(
            op,
            prefill=p,
            prefill_cached=c,
            sample=s,
            train=tr,
            train_loss=min(tr, tr // (1 + l)),
            run=f"r{l}",
            model=m,
            t=T0 + 1000 * l,
        )
        for op, p, c, s, tr, l, m in rows
    ]
    for by in (None, "hour", "run", "model"):
        r = build_report(events, by, card)
        assert r.total.tokens.prompt == sum(e.prompt_tokens for e in events)
        assert r.total.tokens.train_loss == sum(e.train_loss for e in events)
        if by:
            assert sum(row.requests for row in r.rows) == len(events)
            # the rows' costs and the total add the same events' costs in other groupings
            assert sum(row.cost["total"] for row in r.rows) == pytest.approx(
                r.total.cost["total"], rel=1e-12, abs=0
            )


def test_parse_since():
    from trine.metering.since import parse_since

    now = T0 + 7200
    assert parse_since("2h", now=now) == T0
    assert parse_since("90m", now=now) == T0 + 1800
    assert parse_since(str(int(T0))) == T0
    assert parse_since("2026-01-05T08:00:00Z") == T0 == parse_since("2026-01-05T08:00")
    assert parse_since("2026-01-05T09:00+01:00") == T0
    with pytest.raises(ValueError, match="since"):
        parse_since("last tuesday")
