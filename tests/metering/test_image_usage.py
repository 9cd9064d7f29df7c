"""Image tokens in metering (issue 47): they are prompt tokens, computed or cached, shown on a row of
their own in every usage report, and the rate card can price them apart from text."""

from __future__ import annotations

import pytest

from trine.engine.api import SampleUsage
from trine.metering.events import UsageEvent
from trine.metering.rates import BILLED_PHASES, RateCard
from trine.metering.report import Report, build_report, render
from trine.service.meter import Meter, SampleWork

T0 = 1_767_600_000.0
SHIPPED_ROW = "[models.default]\nprefill = 0.10\nsample = 0.30\ntrain = 0.30\n"


def ev(run="r1", session="s1", **n):
    return UsageEvent(
        time=T0, api_key_id="k", session_id=session, run_id=run, base_model="m", operation="sample", **n
    )


def test_image_tokens_are_part_of_the_prompt_tokens():
    ev(prefill=10, prefill_cached=6, prefill_image=10, prefill_image_cached=6)
    with pytest.raises(
        ValueError, match="prefill_image .11. exceeds prefill .10.: image tokens are prompt tokens"
    ):
        ev(prefill=10, prefill_image=11)
    with pytest.raises(ValueError, match="prefill_image_cached"):
        ev(prefill=10, prefill_cached=2, prefill_image_cached=3)
    old = {k: v for k, v in ev(prefill=4).to_dict().items()} | {
        "prefill_image": None,
        "prefill_image_cached": None,
    }
    assert UsageEvent.from_dict(old).prefill_image == 0  # a row stored before images: none


def test_the_rate_card_prices_image_tokens_as_text_unless_it_names_their_price():
    text = RateCard.from_tomls([("card", SHIPPED_ROW)])
    priced = RateCard.from_tomls(
        [("card", SHIPPED_ROW + "prefill_image = 0.50\nprefill_image_cached = 0.05\n")]
    )
    e = ev(prefill=1_000_000, prefill_cached=1_000_000, prefill_image=400_000, prefill_image_cached=100_000)
    as_text, apart = text.cost(e), priced.cost(e)
    assert as_text["total"] == pytest.approx(0.10 + 0.02)  # every prompt token at the text prices
    assert apart["prefill"] == pytest.approx(0.6 * 0.10) and apart["prefill_image"] == pytest.approx(
        0.4 * 0.50
    )
    assert apart["prefill_cached"] == pytest.approx(0.9 * 0.02)
    assert apart["prefill_image_cached"] == pytest.approx(0.1 * 0.05)
    assert apart["total"] == pytest.approx(sum(apart[ph] for ph in BILLED_PHASES))
    row = priced.pricing("m")
    assert (row["prefill_image"], row["prefill_image_cached"]) == (0.5, 0.05)
    older = priced.as_models_list()  # a server from before images names no image prices
    for m in older:
        m["pricing"] = {k: v for k, v in m["pricing"].items() if "image" not in k}
    back = RateCard.from_models_list(older).price("m")
    assert (back.prefill_image, back.prefill_image_cached) == (back.prefill, back.prefill_cached)


def test_reports_show_image_tokens_on_a_row_of_their_own(capsys):
    card = RateCard.from_tomls([("card", SHIPPED_ROW + "prefill_image = 0.50\n")])
    events = [
        ev("r1", "s1", prefill=30, prefill_cached=10, prefill_image=20, prefill_image_cached=10, sample=4),
        ev("r1", "s1", prefill=5, sample=2),
        ev("r2", "s2", prefill=16, prefill_image=12),
    ]
    for by in ("run", "session"):
        rep = build_report(events, by=by, rate_card=card)
        rows = {r.key: r.to_dict() for r in rep.rows}
        first = rows["r1" if by == "run" else "s1"]["tokens"]
        assert (first["prefill_image"], first["prefill_image_cached"], first["image"]) == (20, 10, 30)
        assert rows["r2" if by == "run" else "s2"]["tokens"]["image"] == 12
        total = rep.to_dict()["total"]
        assert total["tokens"]["image"] == 42 and total["tokens"]["prompt"] == 61
        assert set(total["cost"]) == {*BILLED_PHASES, "total"}
        assert total["cost"]["prefill_image"] == pytest.approx(32 * 0.5 / 1e6)
        assert Report.from_dict(rep.to_dict()).to_dict() == rep.to_dict()
    render(build_report(events, by="run", rate_card=card))
    out = capsys.readouterr().out
    assert "image" in out and "image = the prompt tokens that were images" in out


def test_a_samples_image_tokens_reach_its_usage_row():
    work = SampleWork("k", "s", "r", "m", "req", True, 0, T0)
    usage = SampleUsage(
        prompt_tokens=20, prefill_tokens=12, cached_tokens=8, image_tokens=6, cached_image_tokens=8
    )
    row = Meter(rate_card=RateCard.from_tomls([("card", SHIPPED_ROW)])).sample(work, usage).usage
    assert (row.prefill, row.prefill_cached, row.prefill_image, row.prefill_image_cached) == (12, 8, 6, 8)
