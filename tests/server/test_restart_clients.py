"""The official clients ride out a bounded shutdown and a restart (issue 32): a sample the drain
cancels is sent again by the client and answered by the server restarted on the same data dir and
port. (The trine SDK's own test: tests/client/test_sdk_restart.py.)"""

from __future__ import annotations

import signal
import threading
import time

import pytest
from serverutil import free_port, pytrio_env, run_serve_cli, tinker_env, wait_decoding, wait_http

from trine.store import Store


def serve_cli(model_dir, home, port: int):
    args = ["--model", str(model_dir), "--port", str(port), "--home", str(home), "--threads", "1"]
    return run_serve_cli([*args, "--shutdown-timeout", "1", "--quiet"])


def drain_and_restart(model_dir, home, port: int, proc, pending: threading.Thread):
    """SIGTERM `proc` while `pending` (a thread running an 8-sample request) decodes; start it again
    once it has exited; return the new process."""
    wait_decoding(f"http://127.0.0.1:{port}", 8)  # SIGTERM while they decode, not on a timer
    assert pending.is_alive()
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(15) == 0, proc.stdout.read()
    time.sleep(1.0)
    assert pending.is_alive(), "the client gave up on the cancelled sample"
    restarted, text, _ = serve_cli(model_dir, home, port)
    assert "PYTRIO_API_KEY" in text, text
    return restarted


def test_tinker_resubmits_a_sample_the_drain_cancelled(tiny_model_dir, tmp_path):
    tinker = pytest.importorskip("tinker")
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    proc, text, key = serve_cli(tiny_model_dir, tmp_path, port)
    restarted = None
    got: dict = {}
    try:
        assert key, text
        wait_http(f"{url}/health", key)
        with tinker_env():
            sc = tinker.ServiceClient(base_url=url, api_key="tml-" + key)
            sampler = sc.create_sampling_client(base_model=tiny_model_dir.name).result()
            params = tinker.types.SamplingParams(max_tokens=600, temperature=1.0, seed=3)
            prompt = tinker.types.ModelInput.from_ints([1, 2, 3, 4])

            def sample():
                try:
                    got["result"] = sampler.sample(prompt, 8, params).result(timeout=180)
                except Exception as e:  # noqa: BLE001 - reported by the assertion below
                    got["error"] = e

            pending = threading.Thread(target=sample)
            pending.start()
            restarted = drain_and_restart(tiny_model_dir, tmp_path, port, proc, pending)
            pending.join(180)
        assert "error" not in got, got.get("error")
        assert len(got["result"].sequences) == 8
    finally:
        for p in (proc, restarted):
            if p is not None and p.poll() is None:
                p.kill()
                p.wait(10)
    store = Store(tmp_path)
    usage = [u for u in store.usage_events(store.key_by_secret(key).id) if u.operation == "sample"]
    assert len(usage) == 2, usage  # the cancelled part, then the whole sample


def test_pytrio_resends_a_sample_the_drain_cancelled(tiny_model_dir, tmp_path):
    pytest.importorskip("pytrio")
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    proc, text, key = serve_cli(tiny_model_dir, tmp_path, port)
    restarted = None
    got: dict = {}
    try:
        assert key, text
        wait_http(f"{url}/health", key)
        with pytrio_env(url, key) as pytrio:
            pytrio.configure(sampling_retry_timeout_seconds=120)  # the restart is inside the window
            client = pytrio.ServiceClient()
            sampler = client.create_sampling_client(base_model=tiny_model_dir.name)
            params = pytrio.SamplingParams(max_tokens=600, temperature=1.0, seed=3)
            prompt = pytrio.ModelInput.from_ints([1, 2, 3, 4])

            def sample():
                try:
                    got["result"] = sampler.sample(
                        prompt=prompt, num_samples=8, sampling_params=params
                    ).result()
                except Exception as e:  # noqa: BLE001 - reported by the assertion below
                    got["error"] = e

            pending = threading.Thread(target=sample)
            pending.start()
            restarted = drain_and_restart(tiny_model_dir, tmp_path, port, proc, pending)
            pending.join(180)
            client._runtime.shutdown()
        assert "error" not in got, got.get("error")
        assert len(got["result"].sequences) == 8
    finally:
        for p in (proc, restarted):
            if p is not None and p.poll() is None:
                p.kill()
                p.wait(10)
    store = Store(tmp_path)
    usage = [u for u in store.usage_events(store.key_by_secret(key).id) if u.operation == "sample"]
    assert len(usage) == 2, usage  # the cancelled part, then the whole sample
