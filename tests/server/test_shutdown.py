"""SIGTERM bounds `trine serve`'s shutdown (issue 32, item 1): new work is refused with 503 and
Retry-After while accepted work drains; at the deadline queued events fail with
`server_shutting_down` and a running sample is cancelled and metered; the process exits 0 in time."""

from __future__ import annotations

import signal
import threading
import time

import httpx
from serverutil import RawClient, ce_payload, event, free_port, run_serve_cli, wait_http

from trine.store import Store

SHUTDOWN_TIMEOUT = 8.0


def long_sample(request_id: str) -> dict:
    """Far more decoding than the drain allows on a tiny model (32 x 4000 tokens)."""
    return {
        "request_id": request_id,
        "prompt": {"chunks": [{"type": "encoded_text", "tokens": [1, 2, 3, 4]}]},
        "num_samples": 32,
        "sampling_params": {"max_tokens": 4000, "temperature": 1.0},
    }


def test_sigterm_drains_then_exits_zero_within_the_bound(tiny_model_dir, tmp_path):
    port = free_port()
    proc, text, key = run_serve_cli(
        [
            "--model",
            str(tiny_model_dir),
            "--port",
            str(port),
            "--home",
            str(tmp_path),
            "--threads",
            "1",
            "--shutdown-timeout",
            str(SHUTDOWN_TIMEOUT),
        ]
    )
    url = f"http://127.0.0.1:{port}"
    try:
        assert key, text
        assert wait_http(f"{url}/health", key).json()["status"] == "ok"
        client, poller, sampler = RawClient(url, key), RawClient(url, key), RawClient(url, key)
        run, rid = client.started_run(tiny_model_dir.name)
        # index 3 while 2 never arrives: queued until the deadline
        queued = "event_queued000001"
        r = client.submit(run, event(queued, "forward_backward", 3, ce_payload([5, 6, 7]), rid))
        assert r.status_code < 300, r.text
        srun = client.sampling_run(client.session(), tiny_model_dir.name)
        answers: dict[str, object] = {}
        threads = [
            threading.Thread(target=lambda: answers.update(sample=sampler.sample(srun, long_sample("long")))),
            threading.Thread(target=lambda: answers.update(queued=poller.get(run, queued, wait=60))),
        ]
        for t in threads:
            t.start()
        time.sleep(2.0)  # the sample is decoding
        assert "sample" not in answers
        sent = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        time.sleep(0.5)
        refused = client.sample(srun, long_sample("new-one"))
        assert refused.status_code == 503, refused.text
        assert refused.json()["code"] == "server_shutting_down"
        assert int(refused.headers["retry-after"]) > 0
        health = httpx.get(f"{url}/health", trust_env=False)
        assert health.status_code == 503 and health.json()["status"] == "shutting_down"
        status = proc.wait(SHUTDOWN_TIMEOUT + 5)
        log = proc.stdout.read()
        assert status == 0, log
        assert "exiting now" not in log  # ended by itself, not by the watchdog
        took = time.monotonic() - sent
        for t in threads:
            t.join(10)
        assert took <= SHUTDOWN_TIMEOUT + 1.0, took
        sample = answers["sample"]
        assert sample.status_code == 503 and sample.json()["code"] == "server_shutting_down", sample.text
        assert "retry-after" in sample.headers
        assert answers["queued"]["status"] == "failed"
        assert "server_shutting_down" in str(answers["queued"]), answers["queued"]
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
    store = Store(tmp_path)
    key_id = store.key_by_secret(key).id
    metered = [u for u in store.usage_events(key_id) if u.request_id == "long"]
    assert len(metered) == 1, metered  # the cancelled sample's partial work, once
    assert metered[0].sample > 0 and metered[0].prefill + metered[0].prefill_cached == 4
    assert not [u for u in store.usage_events(key_id) if u.request_id == "new-one"]
