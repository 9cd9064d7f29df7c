"""What a shutdown's drain does to the samples it stops (issue 51, item 4).

- A sample whose 200 had begun (keep-alive whitespace) when the drain stopped it is never a
  complete 200 with no sequences: the response is broken off, so every client retries it, and the
  trine SDK's retry is answered by the restarted server with every sequence; the partial work is
  metered once.
- An engine inside a training step at the deadline does not hold the drain up: samples are
  cancelled first, each step is bounded (no `draining failed`), and what the stopped sample
  computed is metered when the engine answers.
"""

from __future__ import annotations

import logging
import threading
import time

import httpx
import pytest
from serverutil import TEST_ENGINE, RawClient, ce_payload, event, free_port, start

import trine as trio
from trine.engine.runtime.local import LocalEngine
from trine.server.pytrio import routes_actor
from trine.store import Store

MODEL = "tiny-llama"


def long_sample(request_id: str) -> dict:
    """Far more decoding than any drain here allows on a tiny model."""
    return {
        "request_id": request_id,
        "prompt": {"chunks": [{"type": "encoded_text", "tokens": [1, 2, 3, 4]}]},
        "num_samples": 8,
        "sampling_params": {"max_tokens": 1200, "temperature": 1.0},  # within the test KV pool
    }


@pytest.fixture
def quick_keepalive(monkeypatch):
    """The actor plane's 200 and keep-alive whitespace go out after 0.3 s instead of 20 s."""
    monkeypatch.setattr(routes_actor, "KEEPALIVE_AFTER", 0.3)
    monkeypatch.setattr(routes_actor, "KEEPALIVE_EVERY", 0.3)


def sample_usage(home, key_id: str, request_id: str) -> list:
    store = Store(home)
    try:
        return [u for u in store.usage_events(key_id) if u.request_id == request_id]
    finally:
        store.close()


def test_a_sample_stopped_after_its_200_began_is_broken_off_not_answered_empty(
    quick_keepalive, tiny_model_dir, tmp_path
):
    srv = start(tiny_model_dir, tmp_path, shutdown_timeout=3)
    key_id = srv.service.authenticate(srv.api_key).id
    c = RawClient(srv.url, srv.api_key)
    srun = c.sampling_run(c.session(), MODEL)
    got: dict = {}

    def run():
        url = f"{srun['actor']['endpoint']}/v1/sampling-runs/{srun['sampling_run_cuid']}/sample"
        headers = {"Authorization": f"Bearer {srun['actor_jwt']['token']}"}
        try:
            with c.http.stream("POST", url, json=long_sample("long"), headers=headers) as r:
                got["status"] = r.status_code
                got["body"] = r.read()
        except httpx.HTTPError as e:
            got["error"] = e

    pending = threading.Thread(target=run)
    pending.start()
    time.sleep(1.5)  # decoding, and the 200 with its keep-alive whitespace has gone out
    srv.stop()
    pending.join(30)
    c.close()
    assert got.get("status") == 200, got  # the status line had gone out before the drain
    assert "body" not in got, got["body"][-300:]  # never a complete body (it read as success)
    assert isinstance(got["error"], httpx.RemoteProtocolError), got  # retryable for every client
    metered = sample_usage(tmp_path, key_id, "long")
    assert len(metered) == 1 and metered[0].sample > 0, metered  # the partial work, once


def test_the_sdk_resends_a_sample_stopped_after_its_200_began(quick_keepalive, tiny_model_dir, tmp_path):
    port = free_port()
    srv = start(tiny_model_dir, tmp_path, port=port, shutdown_timeout=3)
    key_id = srv.service.authenticate(srv.api_key).id
    restarted = None
    try:
        with trio.ServiceClient(base_url=srv.url, api_key=srv.api_key) as svc:
            sampler = svc.create_sampling_client(base_model=MODEL)
            params = trio.SamplingParams(max_tokens=1200, temperature=1.0, seed=3)
            prompt = trio.ModelInput.from_ints([1, 2, 3, 4])
            future = sampler.sample(prompt=prompt, num_samples=8, sampling_params=params)
            time.sleep(1.5)  # past the keep-alive: the 200 has begun
            srv.stop()
            restarted = start(tiny_model_dir, tmp_path, port=port, shutdown_timeout=3)
            result = future.result(timeout=180)
        assert len(result.sequences) == 8 and all(s.tokens for s in result.sequences), result
    finally:
        if restarted is not None:
            restarted.stop()
    usage = [u for u in Store(tmp_path, read_only=True).usage_events(key_id) if u.operation == "sample"]
    assert len({u.request_id for u in usage}) == 1 and len(usage) == 2, usage  # stopped part, then whole


HOLD_SECONDS = 6.0


class BusyTraining(LocalEngine):
    """An engine whose next training cycle, once `hold` is set, first keeps its thread busy for
    HOLD_SECONDS, as a long training step does: nothing else (sampling, cancels) runs meanwhile."""

    hold = threading.Event()

    async def run_cycle(self, cycle):
        if self.hold.is_set():
            self.hold.clear()
            self.worker.submit(lambda w: time.sleep(HOLD_SECONDS))
        return await super().run_cycle(cycle)


def busy_training(name, path):
    return [BusyTraining(name, path, TEST_ENGINE)]


def test_a_training_step_at_the_deadline_does_not_hold_the_drain_or_lose_the_metering(
    tiny_model_dir, tmp_path, caplog
):
    caplog.set_level(logging.WARNING)
    srv = start(tiny_model_dir, tmp_path, engines=busy_training, shutdown_timeout=4)
    key_id = srv.service.authenticate(srv.api_key).id
    c, sampler = RawClient(srv.url, srv.api_key), RawClient(srv.url, srv.api_key)
    run, rid = c.started_run(MODEL)
    srun = c.sampling_run(c.session(), MODEL)
    held = long_sample("held")
    pending = threading.Thread(target=_ignore_errors, args=(lambda: sampler.sample(srun, held),))
    pending.start()
    time.sleep(1.0)  # decoding
    BusyTraining.hold.set()
    r = c.submit(run, event("event_busy00000001", "forward_backward", 2, ce_payload([5, 6, 7]), rid))
    assert r.status_code < 300, r.text
    time.sleep(0.5)  # the engine is inside the "training step"
    asked = time.time()
    srv.stop()
    pending.join(30)
    c.close()
    sampler.close()
    drain_log = [rec for rec in caplog.records if rec.name.startswith("trine")]
    assert not [rec for rec in drain_log if "draining failed" in rec.getMessage()], drain_log
    (deadline,) = [rec for rec in drain_log if "shutdown deadline" in rec.getMessage()]
    assert deadline.created - asked < 4.0, deadline.created - asked  # within the drain's bound
    assert "cancelled 1 sample" in deadline.getMessage(), deadline.getMessage()
    metered = sample_usage(tmp_path, key_id, "held")
    assert len(metered) == 1 and metered[0].sample > 0, metered  # metered once the engine answered


def _ignore_errors(fn):
    try:
        fn()
    except httpx.HTTPError:
        pass
