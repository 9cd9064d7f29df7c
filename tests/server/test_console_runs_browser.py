"""The console's run-following pages in a real headless Chromium (see test_console_browser.py for
the set-up): a run's logged metrics and step times plotted beside its loss, the CSV download, an
empty run's charts saying so, the Compare page's overlay (runs, metric, smoothing), the checkpoints
page grouping an RL loop's temp-sampling-* snapshots and samplers by run and paging, and usage by
run with the samplers' breakdown. Screenshots go to $TRINE_CONSOLE_SHOTS like the others."""

from __future__ import annotations

import csv
import io
import time

import httpx
import pytest
from consoleutil import MODEL, SEQS, chromium, console_server, sign_in, wait
from test_console_browser import CHROMEDRIVER, CHROMIUM, chart, pytestmark, shoot  # noqa: F401 (the skip mark)

import trine as trio

DATA = [
    trio.Datum(model_input=trio.ModelInput.from_ints(s[:-1]), loss_fn_inputs={"target_tokens": s[1:]})
    for s in SEQS
]
EXTRA_SAMPLERS = 21  # base-model samplers: with the two runs' groups, more than one page (20 rows)


def rl_run(service, name: str, rewards: list[float]) -> dict:
    """An RL loop's shape: each step a save_weights_and_get_sampling_client sampler, a sample, a
    training step and log_metrics(reward, kl)."""
    trainer = service.create_lora_training_client(MODEL, rank=4, seed=0, name=name, tags=["rl", name[-1]])
    params = trio.SamplingParams(max_tokens=3, temperature=1.0, seed=1)
    losses = []
    for step, r in enumerate(rewards, 1):
        sampler = trainer.save_weights_and_get_sampling_client()
        sampler.sample(trio.ModelInput.from_ints(SEQS[0]), num_samples=2, sampling_params=params).result()
        losses.append(trainer.forward_backward(DATA, "cross_entropy").result().metrics["loss_mean"])
        trainer.optim_step(trio.AdamParams(learning_rate=2e-2)).result()
        trainer.log_metrics({"reward": r, "kl": 0.1 * step}, step=step).result()
    return {"id": trainer.training_run_id, "rewards": rewards, "losses": losses}


@pytest.fixture(scope="module")
def env(tiny_model_dir, tmp_path_factory):
    with console_server(tiny_model_dir, tmp_path_factory.mktemp("console-runs")) as (srv, _):
        with trio.ServiceClient(api_key=srv.api_key, base_url=srv.url) as service:
            a = rl_run(service, "grpo-a", [0.1, 0.4, 0.3, 0.8])
            b = rl_run(service, "grpo-b", [0.2, 0.2, 0.5])
            empty = service.create_lora_training_client(MODEL, rank=4, name="not-started").training_run_id
            for _ in range(EXTRA_SAMPLERS):
                service.create_sampling_client(base_model=MODEL)
            with chromium(CHROMIUM, CHROMEDRIVER) as driver:
                sign_in(driver, srv.url, srv.api_key)
                wait(driver, "document.querySelector('#runs table')")
                yield srv, driver, a, b, empty


def test_the_run_page_plots_logged_metrics_and_step_times_beside_the_loss(env, tmp_path):
    srv, browser, a, _, _ = env
    browser.get(f"{srv.url}/console/runs/{a['id']}")
    wait(
        browser,
        "Chart.getChart('chart-metric-reward') && Chart.getChart('chart-loss').data.labels.length === 4",
    )
    reward = chart(browser, "chart-metric-reward")
    assert reward["labels"] == [1, 2, 3, 4] and reward["data"] == [a["rewards"]]
    # the values the runs logged and reported, through JSON and JS numbers (fp64 both): rel 1e-12
    # covers the one fp64 rounding of a logged 0.1 * k and the console's token-weighted mean of a
    # step's chunks (a few fp64 operations, 1.1e-16 each), nothing a wrong value could hide in
    assert chart(browser, "chart-metric-kl")["data"][0] == pytest.approx([0.1, 0.2, 0.3, 0.4], rel=1e-12)
    assert chart(browser, "chart-loss")["data"][0] == pytest.approx(a["losses"], rel=1e-12)
    seconds = chart(browser, "chart-seconds")["data"][0]
    assert len(seconds) == 4 and all(s is not None and s >= 0 for s in seconds)
    facts = browser.find_element("id", "run-facts").text
    assert "r4 mlp+attn+unembed" in facts and "lr 0.02" in facts and "reward=0.8" in facts and "rl" in facts
    assert "grpo-a" in browser.find_element("id", "run-name").text
    assert not browser.execute_script(
        "return [...document.querySelectorAll('#run-charts .nodata')].some(n => !n.hidden)"
    )
    shoot(browser, "run-metrics")
    browser.execute_cdp_cmd(
        "Browser.setDownloadBehavior", {"behavior": "allow", "downloadPath": str(tmp_path)}
    )
    browser.find_element("id", "download-csv").click()
    path = tmp_path / f"{a['id']}-metrics.csv"
    deadline = time.monotonic() + 20
    while not path.is_file() and time.monotonic() < deadline:
        time.sleep(0.1)
    rows = list(csv.DictReader(io.StringIO(path.read_text())))
    assert [float(r["reward"]) for r in rows] == a["rewards"]
    # the CSV's text of the console's loss (above): rel 1e-12 as for the chart
    assert [float(r["train:loss"]) for r in rows] == pytest.approx(a["losses"], rel=1e-12)
    served = httpx.get(
        f"{srv.url}/api/trine/v1/training-runs/{a['id']}/metrics",
        params={"format": "csv"},
        headers={"X-API-Key": srv.api_key},
        trust_env=False,
    ).text
    assert path.read_text() == served


def test_a_run_with_nothing_yet_says_no_data_yet_on_its_charts(env):
    srv, browser, _, _, empty = env
    browser.get(f"{srv.url}/console/runs/{empty}")
    wait(browser, "!!Chart.getChart('chart-loss')")
    notes = browser.execute_script(
        "return [...document.querySelectorAll('#run-charts .nodata')]"
        ".filter(n => !n.hidden).map(n => n.parentElement.querySelector('canvas').id)"
    )
    assert set(notes) == {"chart-loss", "chart-grad", "chart-seconds", "chart-tokens", "chart-cycles"}
    assert browser.find_element("css selector", "#chart-loss + .nodata").text == "no data yet"


def test_compare_overlays_runs_with_a_chosen_metric_and_smoothing(env):
    from selenium.webdriver.support.ui import Select

    srv, browser, a, b, empty = env
    browser.get(f"{srv.url}/console/compare?runs={a['id']},{b['id']}&metric=reward")
    wait(
        browser,
        "Chart.getChart('chart-compare') && Chart.getChart('chart-compare').data.datasets.length === 2",
    )
    points = browser.execute_script(
        "return Chart.getChart('chart-compare').data.datasets.map(d => [d.label, d.data])"
    )
    assert points == [
        ["grpo-a", [{"x": i + 1, "y": r} for i, r in enumerate(a["rewards"])]],
        ["grpo-b", [{"x": i + 1, "y": r} for i, r in enumerate(b["rewards"])]],
    ]
    browser.execute_script(
        "const s = document.getElementById('compare-smooth'); s.value = '0.5';"
        "s.dispatchEvent(new Event('input'))"
    )
    wait(browser, "location.search.includes('smooth=0.5')")
    smoothed = browser.execute_script(
        "return Chart.getChart('chart-compare').data.datasets[0].data.map(p => p.y)"
    )
    avg, expect = 0.0, []
    # the page's EMA in JS against this one: the same few fp64 operations a point, perhaps in another
    # order, so rel 1e-12 (about 4 roundings of 1.1e-16 a step)
    for n, r in enumerate(a["rewards"], 1):  # bias-corrected exponential moving average, weight 0.5
        avg = 0.5 * avg + 0.5 * r
        expect.append(avg / (1 - 0.5**n))
    assert smoothed == pytest.approx(expect, rel=1e-12)
    shoot(browser, "compare")
    Select(browser.find_element("id", "compare-metric")).select_by_value("loss")
    wait(browser, "document.getElementById('compare-title').textContent.startsWith('loss')")
    browser.execute_script(
        "const s = document.getElementById('compare-smooth'); s.value = '0';"
        "s.dispatchEvent(new Event('input'))"
    )
    raw = browser.execute_script(
        "return Chart.getChart('chart-compare').data.datasets.map(d => d.data.map(p => p.y))"
    )
    # smoothing 0: the console's losses as charted above, rel 1e-12 as there
    assert raw[0] == pytest.approx(a["losses"], rel=1e-12) and raw[1] == pytest.approx(b["losses"], rel=1e-12)
    browser.find_element("css selector", f"input[data-compare-run='{b['id']}']").click()
    wait(browser, "Chart.getChart('chart-compare').data.datasets.length === 1")
    assert b["id"] not in browser.execute_script("return location.search")
    rows = browser.find_elements("css selector", "#compare-table tr[data-compare-row]")
    assert [r.get_attribute("data-compare-row") for r in rows] == [a["id"]]


def test_checkpoints_page_groups_temp_sampling_snapshots_and_samplers_by_run_and_pages(env):
    srv, browser, a, b, _ = env
    browser.get(f"{srv.url}/console/checkpoints")
    group = wait(browser, f"document.querySelector('#checkpoints tr.group[data-group=\"{a['id']}\"]')")
    assert "4 temporary sampler snapshots" in group.text and a["id"] in group.text
    assert not browser.find_elements("css selector", "#checkpoints tr.member")  # folded
    assert len(browser.find_elements("css selector", "#checkpoints tr.group")) == 2
    group.find_element("css selector", "button[data-action=toggle-group]").click()
    wait(browser, "document.querySelectorAll('#checkpoints tr.member').length === 4")
    names = [
        r.find_element("tag name", "td").text
        for r in browser.find_elements("css selector", "#checkpoints tr.member")
    ]
    assert all(n.startswith("temp-sampling-") for n in names)
    pager = browser.find_element("css selector", "#samplers .pager")
    assert f"page 1 of 2 · {EXTRA_SAMPLERS + 2} rows" in pager.text  # 21 base-model samplers + 2 runs' groups
    assert len(browser.find_elements("css selector", "#samplers tbody tr")) == 20
    shoot(browser, "checkpoints-grouped")
    pager.find_element("css selector", "button[data-page='1']").click()  # the older page: the runs' samplers
    wait(browser, "document.querySelector('#samplers .pager span').textContent.startsWith('page 2 of 2')")
    assert len(browser.find_elements("css selector", "#samplers tbody tr")) == EXTRA_SAMPLERS + 2 - 20
    samplers = browser.find_element("css selector", f"#samplers tr.group[data-group='{a['id']}']")
    assert "4 samplers of run" in samplers.text
    assert (
        "3 samplers of run"
        in browser.find_element("css selector", f"#samplers tr.group[data-group='{b['id']}']").text
    )


def test_usage_by_run_shows_each_runs_name_and_its_samplers_inside_its_row(env):
    srv, browser, a, _, _ = env
    browser.get(f"{srv.url}/console/usage")
    row = wait(
        browser,
        f"(td => td && td.parentElement)(document.querySelector('#usage-groups td[data-key=\"{a['id']}\"]'))",
    )
    assert row.find_elements("tag name", "td")[1].text == "grpo-a"
    part = row.find_element("xpath", "following-sibling::tr[1]")
    assert part.text.startswith("├ training")
    sampling = row.find_element("xpath", "following-sibling::tr[2]")
    assert sampling.text.startswith("└ 4 samplers")
    keys = browser.execute_script(
        "return [...document.querySelectorAll('#usage-groups td[data-key]')].map(t => t.dataset.key)"
    )
    assert [k for k in keys if k.startswith("sr_")] == []  # the base-model samplers sampled nothing: no usage
    shoot(browser, "usage-by-run")
