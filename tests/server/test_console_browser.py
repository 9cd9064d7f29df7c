"""The web console in a real headless Chromium (Debian's `chromium` + `chromium-driver`, driven by
selenium) against a real server: sign-in, a short SFT's loss curve, live updates, usage totals equal
to `trine usage --json`, checkpoints, the server page, key isolation and a refused key.

Screenshots of every page (1280x800, a narrow 420x860 window, and the whole page) go to
$TRINE_CONSOLE_SHOTS (default benchmarks/out/console/, git-ignored).
"""

from __future__ import annotations

import json
import os
import shutil
import tarfile
import time
from pathlib import Path

import pytest
from click.testing import CliRunner
from consoleutil import MODEL, SEQS, chromium, console_server, screenshots, sft, sign_in, wait

import trine as trio
from trine.cli.main import main as trine_cli

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
CHROMEDRIVER = shutil.which("chromedriver")
try:
    import selenium  # noqa: F401

    NO_SELENIUM = None
except ImportError:
    NO_SELENIUM = "selenium is not installed (`make test` installs it with the test extra)"

pytestmark = pytest.mark.skipif(
    bool(NO_SELENIUM or not CHROMIUM or not CHROMEDRIVER),
    reason=NO_SELENIUM
    or "no chromium/chromedriver on PATH: `make test` installs Debian's chromium and "
    "chromium-driver when run as root (or: apt-get install chromium chromium-driver)",
)

SHOTS = Path(
    os.environ.get("TRINE_CONSOLE_SHOTS", Path(__file__).resolve().parents[2] / "benchmarks/out/console")
)


@pytest.fixture(scope="module")
def env(tiny_model_dir, tmp_path_factory):
    with console_server(tiny_model_dir, tmp_path_factory.mktemp("console-browser")) as (srv, bob):
        run = sft(srv.url, srv.api_key, steps=8)
        with trio.ServiceClient(api_key=srv.api_key, base_url=srv.url) as service:  # some sampling usage
            sampler = service.create_sampling_client(base_model=MODEL)
            params = trio.SamplingParams(max_tokens=6, temperature=1.0, seed=1)
            for _ in range(2):  # the same prompt twice as one-sample requests: a split_group diagnostic
                sampler.sample(
                    trio.ModelInput.from_ints(SEQS[0] * 5), num_samples=1, sampling_params=params
                ).result()
        yield srv, bob, run


@pytest.fixture(scope="module")
def browser():
    with chromium(CHROMIUM, CHROMEDRIVER) as driver:
        yield driver


def shoot(driver, name: str) -> None:
    screenshots(driver, SHOTS / name)


def chart(driver, canvas: str) -> dict:
    return driver.execute_script(
        f"const c = Chart.getChart('{canvas}'); return c && "
        "{labels: c.data.labels, data: c.data.datasets.map(d => d.data)}"
    )


def test_a_wrong_key_is_refused_with_a_clear_message(env, browser):
    srv, _, _ = env
    sign_in(browser, srv.url, "trine-this-is-not-a-key")
    msg = wait(browser, "(e => e && !e.hidden && e.textContent)(document.getElementById('signin-error'))")
    assert msg.startswith("Refused:") and "not valid" in msg and "trine keys create" in msg
    assert browser.execute_script("return sessionStorage.getItem('trine.apiKey')") is None
    shoot(browser, "signin-refused")


def test_sign_in_lists_the_run(env, browser):
    srv, _, run = env
    sign_in(browser, srv.url, srv.api_key)
    row = wait(browser, f"document.querySelector('tr[data-run=\"{run.run_id}\"]')")
    cells = [c.text for c in row.find_elements("tag name", "td")]
    assert cells[0] == run.run_id and cells[3] == "tiny-llama" and cells[4] == "r4 mlp+attn+unembed"
    assert cells[5] == "ENDED" and cells[6] == "8"
    assert browser.find_element("id", "who").text == "key: embedded"
    shoot(browser, "runs")


def test_run_page_plots_one_point_per_step_with_the_sdk_values(env, browser):
    srv, _, run = env
    browser.find_element("css selector", f"a[href='/console/runs/{run.run_id}']").click()
    wait(browser, "Chart.getChart('chart-loss') && Chart.getChart('chart-loss').data.labels.length === 8")
    loss = chart(browser, "chart-loss")
    assert loss["labels"] == list(range(1, 9))
    # the SDK's floats through JSON and JS numbers (fp64 both); rel 1e-12 for the console's
    # token-weighted mean of a step's chunks (a few fp64 operations, 1.1e-16 each)
    assert loss["data"][0] == pytest.approx(run.losses, rel=1e-12)
    assert chart(browser, "chart-grad")["data"][0] == pytest.approx(run.grad_norms, rel=1e-12)
    assert chart(browser, "chart-tokens")["data"] == [run.train_tokens, run.loss_tokens]
    assert [list(p) for p in zip(*chart(browser, "chart-cycles")["data"])] == [list(c) for c in run.cycles]
    assert browser.current_url.endswith(f"/console/runs/{run.run_id}")
    assert run.checkpoint_uri in browser.find_element("id", "run-checkpoints").text
    shoot(browser, "run")


def test_the_run_page_updates_live_while_the_run_trains(env, browser):
    srv, _, _ = env
    data = [
        trio.Datum(
            model_input=trio.ModelInput.from_ints(SEQS[0][:-1]), loss_fn_inputs={"target_tokens": SEQS[0][1:]}
        )
    ]
    with trio.ServiceClient(api_key=srv.api_key, base_url=srv.url) as service:
        trainer = service.create_lora_training_client(MODEL, rank=4, seed=0)
        trainer.forward_backward(data, "cross_entropy").result()
        browser.get(f"{srv.url}/console/runs/{trainer.training_run_id}")
        wait(browser, "Chart.getChart('chart-loss') && Chart.getChart('chart-loss').data.labels.length === 1")
        browser.execute_script("window.__notReloaded = true")
        losses = []
        for _ in range(2):
            trainer.optim_step(trio.AdamParams(learning_rate=5e-2)).result()
            losses.append(trainer.forward_backward(data, "cross_entropy").result().metrics["loss_mean"])
        wait(browser, "Chart.getChart('chart-loss').data.labels.length === 3", timeout=15)
        assert browser.execute_script("return window.__notReloaded") is True
        # the SDK's loss_mean through JSON and JS (fp64): rel 1e-12 as in the test above
        assert chart(browser, "chart-loss")["data"][0][1:] == pytest.approx(losses, rel=1e-12)
        assert len(chart(browser, "chart-grad")["labels"]) == 2


def test_usage_chart_totals_equal_trine_usage_json(env, browser):
    from selenium.webdriver.support.ui import Select

    srv, _, _ = env
    browser.get(f"{srv.url}/console/usage")
    wait(browser, "Chart.getChart('chart-usage') && document.querySelector('#usage-groups table')")
    out = CliRunner().invoke(trine_cli, ["usage", "--url", srv.url, "--api-key", srv.api_key, "--json"])
    assert out.exit_code == 0, out.output
    total = json.loads(out.output)["total"]["tokens"]
    sums = browser.execute_script(
        "const c = Chart.getChart('chart-usage'); return Object.fromEntries("
        "c.data.datasets.map(d => [d.phase, d.data.reduce((a, b) => a + b, 0)]))"
    )
    assert sums == {ph: total[ph] for ph in ("prefill", "prefill_cached", "sample", "train")}
    assert total["train"] > 0 and total["sample"] > 0 and total["prefill"] > 0
    assert browser.find_element("css selector", ".diag[data-pattern='split_group']").text.count("Fix:") == 1
    facts = browser.find_element("id", "usage-facts").text
    assert f"{total['train']:,}" in facts and f"{total['sample']:,}" in facts
    shoot(browser, "usage")
    Select(browser.find_element("css selector", "select[data-ui=by]")).select_by_value("model")
    wait(browser, "document.getElementById('usage-groups-title').textContent === 'By model'")
    rows = browser.find_elements("css selector", "#usage-groups tbody tr")
    assert [r.find_element("tag name", "td").text for r in rows] == ["tiny-llama", "total"]


def test_server_page_shows_models_engines_and_cycles(env, browser):
    srv, _, run = env
    browser.get(f"{srv.url}/console/server")
    wait(browser, "document.querySelector('.replica-card[data-model=\"tiny-llama\"]')")
    assert "KV pool" in browser.find_element("css selector", ".replica-card").text
    assert run.run_id in browser.find_element("css selector", ".replica-card .cycles").text
    shoot(browser, "server")


def test_checkpoints_page_lists_downloads_and_deletes(env, browser, tmp_path):
    srv, _, run = env
    browser.get(f"{srv.url}/console/checkpoints")
    row = wait(browser, "document.querySelector('tr[data-checkpoint]')")
    assert run.checkpoint_uri in row.text
    shoot(browser, "checkpoints")
    browser.execute_cdp_cmd(
        "Browser.setDownloadBehavior", {"behavior": "allow", "downloadPath": str(tmp_path)}
    )
    browser.find_element("css selector", "tr[data-checkpoint] button[data-action=download]").click()
    tar = tmp_path / "ck-console.tar"
    deadline = time.monotonic() + 20
    while not (tar.is_file() and tarfile.is_tarfile(tar)) and time.monotonic() < deadline:
        time.sleep(0.1)
    with tarfile.open(tar) as tf:
        assert any(n.endswith("adapter_model.safetensors") for n in tf.getnames())
    button = "tr[data-checkpoint] button[data-action=delete]"
    browser.find_element("css selector", button).click()
    wait(browser, "document.querySelector('button.armed')")
    browser.find_element("css selector", button).click()
    wait(browser, "!document.querySelector('tr[data-checkpoint]')")
    assert srv.service.store.checkpoint_by_uri(run.checkpoint_uri) is None


def test_another_keys_run_is_invisible_and_its_url_is_not_found(env, browser):
    srv, bob, run = env
    sign_in(browser, srv.url, bob)
    wait(browser, "document.querySelector('#runs .empty')")
    assert run.run_id not in browser.find_element("id", "main").text
    browser.get(f"{srv.url}/console/runs/{run.run_id}")
    text = wait(browser, "(e => e && e.textContent)(document.getElementById('notfound'))")
    assert "Not found" in text and f"training run {run.run_id} not found" in text
    assert not browser.execute_script("return Chart.getChart('chart-loss')")
    shoot(browser, "not-found")
