"""The console's session pages in a real headless Chromium (set-up as in test_console_browser.py):
the Sessions list, a session's timeline drawn in lanes per replica (queue, prefill, decode, clock
cycles, train) with its time and cost by lane equal to the session's metering, the run page's link
to it, and another key's session not found. Screenshots go to $TRINE_CONSOLE_SHOTS."""

from __future__ import annotations

import json
import time

import pytest
from consoleutil import MODEL, SEQS, chromium, console_server, sft, sign_in, wait
from test_console_browser import CHROMEDRIVER, CHROMIUM, pytestmark, shoot  # noqa: F401 (the skip mark)

import trine as trio

SAMPLES = 3


@pytest.fixture(scope="module")
def env(tiny_model_dir, tmp_path_factory):
    with console_server(tiny_model_dir, tmp_path_factory.mktemp("console-timeline")) as (srv, bob):
        run = sft(srv.url, srv.api_key, steps=2, save=None)
        with trio.ServiceClient(api_key=srv.api_key, base_url=srv.url) as service:
            sampler = service.create_sampling_client(base_model=MODEL)
            params = trio.SamplingParams(max_tokens=4, temperature=1.0, seed=1)
            futures = [
                sampler.sample(trio.ModelInput.from_ints(SEQS[0] * 4), num_samples=2, sampling_params=params)
                for _ in range(SAMPLES)
            ]
            for f in futures:
                f.result()
            sampling_session = service.service_session_cuid
        with trio.ServiceClient(api_key=srv.api_key, base_url=srv.url) as service:  # both: the docs' picture
            mixed(service)
        with chromium(CHROMIUM, CHROMEDRIVER) as driver:
            sign_in(driver, srv.url, srv.api_key)
            wait(driver, "document.querySelector('#runs table')")
            yield srv, bob, driver, run, sampling_session


def mixed(service) -> None:
    """An RL-shaped session: each step samples a group from the latest weights, then trains."""
    trainer = service.create_lora_training_client(MODEL, rank=4, seed=0)
    data = [trio.Datum(model_input=trio.ModelInput.from_ints(s[:-1]), loss_fn_inputs={"target_tokens": s[1:]})
            for s in SEQS]  # fmt: skip
    params = trio.SamplingParams(max_tokens=8, temperature=1.0, seed=1)
    for _ in range(2):
        sampler = trainer.save_weights_and_get_sampling_client()
        group = [sampler.sample(trio.ModelInput.from_ints(SEQS[0] * 4), 2, params) for _ in range(3)]
        [f.result() for f in group]
        trainer.forward_backward(data, "cross_entropy")
        trainer.optim_step(trio.AdamParams(learning_rate=2e-2)).result()


def test_the_sessions_page_lists_both_sessions_and_opens_a_timeline(env):
    srv, _, browser, run, sampling_session = env
    browser.get(f"{srv.url}/console/sessions")
    wait(browser, "document.querySelectorAll('#sessions tr[data-session]').length >= 2")
    train_session = srv.service.store.training_run(run.run_id).session_id
    ids = browser.execute_script(
        "return [...document.querySelectorAll('#sessions tr[data-session]')].map(r => r.dataset.session)"
    )
    assert {train_session, sampling_session} <= set(ids)
    shoot(browser, "sessions")
    browser.find_element("css selector", f"tr[data-session='{sampling_session}'] a").click()
    wait(browser, "document.querySelectorAll('#timeline-svg rect.span').length > 0")
    assert browser.current_url.endswith(f"/console/sessions/{sampling_session}")


def lanes(browser) -> dict[str, int]:
    return browser.execute_script(
        "const n = {}; document.querySelectorAll('#timeline-svg rect.span')"
        ".forEach(r => n[r.dataset.lane] = (n[r.dataset.lane] || 0) + 1); return n"
    )


def summary_tokens(browser, lane: str) -> int:
    cell = browser.find_element("css selector", f"#timeline-summary tr[data-lane='{lane}'] td:nth-child(4)")
    return int(cell.text.replace(",", ""))


def test_a_sampling_session_draws_queue_prefill_and_decode_with_its_cost(env, tmp_path):
    srv, _, browser, _, sid = env
    browser.get(f"{srv.url}/console/sessions/{sid}")
    wait(browser, "document.querySelectorAll('#timeline-svg rect.span').length > 0")
    n = lanes(browser)
    assert n["prefill"] == n["decode"] == SAMPLES and "train" not in n
    key = srv.service.store.key_by_secret(srv.api_key)
    metered = sum(
        srv.service.rate_card.cost(u)["total"] for u in srv.service.usage_events(key, session_id=sid)
    )
    usage = srv.service.usage_events(key, session_id=sid)
    assert summary_tokens(browser, "prefill") == sum(u.prefill + u.prefill_cached for u in usage)
    assert summary_tokens(browser, "decode") == SAMPLES * 2 * 4
    shown = float(browser.find_element("id", "timeline-cost").text)
    # the page prints 6 decimals (toFixed(6): within half of 1e-6) of its fp64 sum of the spans'
    # costs, a few roundings (~1e-18 here) from the metered sum
    assert shown == pytest.approx(metered, abs=0.5e-6 + 1e-12) and shown > 0
    tip = browser.execute_script("return document.querySelector('rect.lane-decode title').textContent")
    assert "sample 8" in tip and "cost:" in tip  # 2 samples x 4 tokens
    shoot(browser, "session-timeline-sampling")
    browser.execute_cdp_cmd(
        "Browser.setDownloadBehavior", {"behavior": "allow", "downloadPath": str(tmp_path)}
    )
    browser.find_element("id", "download-trace").click()
    path = tmp_path / f"trace-{sid}.json"
    deadline = time.monotonic() + 20
    while not path.is_file() and time.monotonic() < deadline:
        time.sleep(0.1)
    events = json.loads(path.read_text())["traceEvents"]
    assert sum(e.get("cat") == "decode" and e["ph"] == "X" for e in events) == SAMPLES


def test_the_run_page_links_to_its_sessions_training_timeline(env):
    srv, _, browser, run, _ = env
    browser.get(f"{srv.url}/console/runs/{run.run_id}")
    wait(browser, "document.querySelector('#run-facts a[href^=\"/console/sessions/\"]')")
    browser.find_element("css selector", '#run-facts a[href^="/console/sessions/"]').click()
    wait(browser, "document.querySelectorAll('#timeline-svg rect.lane-train').length > 0")
    n = lanes(browser)
    # init, then 2 x (forward_backward, optim_step); each waited in the queue and ran in a cycle
    assert n["train"] == 5 and n["cycle"] >= 3 and n["queue"] >= 1
    rows = browser.execute_script(
        "return [...document.querySelectorAll('#timeline-summary tr[data-lane]')].map(r => r.dataset.lane)"
    )
    assert rows == ["queue", "cycle", "train"]
    key = srv.service.store.key_by_secret(srv.api_key)
    session = srv.service.store.training_run(run.run_id).session_id
    trained = sum(u.train for u in srv.service.usage_events(key, session_id=session))
    assert summary_tokens(browser, "train") == trained == sum(run.train_tokens) > 0
    shoot(browser, "session-timeline-training")


def test_a_session_that_samples_and_trains_draws_every_lane(env):
    srv, _, browser, _, _ = env
    browser.get(f"{srv.url}/console/sessions")
    wait(browser, "document.querySelectorAll('#sessions tr[data-session]').length >= 3")
    newest = browser.find_element("css selector", "#sessions tr[data-session] a")  # newest first
    newest.click()
    wait(browser, "document.querySelectorAll('#timeline-svg rect.lane-train').length > 0")
    assert set(lanes(browser)) == {"queue", "prefill", "decode", "cycle", "train"}
    shoot(browser, "session-timeline")


def test_another_keys_session_is_not_found(env):
    srv, bob, browser, _, sid = env
    sign_in(browser, srv.url, bob)
    wait(browser, "document.querySelector('#runs')")
    browser.get(f"{srv.url}/console/sessions")
    wait(browser, "document.querySelector('#sessions .empty, #sessions table')")
    assert sid not in browser.find_element("id", "sessions").text  # bob has none of alice's sessions
    browser.get(f"{srv.url}/console/sessions/{sid}")
    wait(browser, "document.getElementById('notfound')")
    sign_in(browser, srv.url, srv.api_key)
    wait(browser, "document.querySelector('#runs table')")
