"""The SDK rides out a server restart (issue 32): a retryable answer's Retry-After is honoured
(bounded), and a sample that a draining server cancels with 503 `server_shutting_down` is sent
again, with the same request id, until the restarted server (same data dir, same port) answers it."""

from __future__ import annotations

import asyncio
import email.utils
import logging
import signal
import time

import httpx
from serverutil import free_port, run_serve_cli, wait_decoding, wait_http

import trine as trio
from trine.client.http import Settings, retry_after, send_with_retry
from trine.store import Store


def answers(*responses: httpx.Response):
    """A `send` that gives `responses` in order and records when each was asked for."""
    sent: list[float] = []

    async def send() -> httpx.Response:
        sent.append(time.monotonic())
        return responses[len(sent) - 1]

    return send, sent


def test_retry_after_reads_seconds_and_http_dates():
    assert retry_after(httpx.Response(503, headers={"Retry-After": "7"})) == 7
    assert retry_after(httpx.Response(503)) == 0
    assert retry_after(httpx.Response(503, headers={"Retry-After": "soon"})) == 0
    when = email.utils.formatdate(time.time() + 20, usegmt=True)
    assert 18 <= retry_after(httpx.Response(503, headers={"Retry-After": when})) <= 20


def test_the_next_attempt_waits_for_retry_after_within_its_cap_and_the_window():
    asyncio.run(retry_after_is_honoured())


async def retry_after_is_honoured():
    fast = Settings(retry_initial_delay_s=0.01, retry_after_max_s=0.6)
    shutting = httpx.Response(503, headers={"Retry-After": "0.4"}, json={"code": "server_shutting_down"})
    send, sent = answers(shutting, httpx.Response(200))
    assert (await send_with_retry(send, fast)).status_code == 200
    assert 0.4 <= sent[1] - sent[0] < 0.55  # honoured, not the 0.01 s backoff

    send, sent = answers(httpx.Response(503, headers={"Retry-After": "3600"}), httpx.Response(200))
    assert (await send_with_retry(send, fast)).status_code == 200
    assert 0.6 <= sent[1] - sent[0] < 0.75  # capped by retry_after_max_s

    send, sent = answers(*[httpx.Response(503, headers={"Retry-After": "30"})] * 3)
    got = await send_with_retry(send, Settings(retry_after_max_s=60), window_s=0.3)
    assert got.status_code == 503 and len(sent) == 2 and sent[1] - sent[0] < 0.45  # the window still ends


def test_a_refused_connection_is_retried_at_most_retry_connect_max_delay_s_apart():
    async def run() -> list[float]:
        sent: list[float] = []

        async def send() -> httpx.Response:
            sent.append(time.monotonic())
            if len(sent) <= 4:
                raise httpx.ConnectError("connection refused")
            return httpx.Response(200)

        settings = Settings(retry_initial_delay_s=1.0, retry_connect_max_delay_s=0.1)
        assert (await send_with_retry(send, settings)).status_code == 200
        return sent

    sent = asyncio.run(run())
    gaps = [b - a for a, b in zip(sent, sent[1:])]
    assert len(gaps) == 4 and all(0.09 <= g < 0.3 for g in gaps), gaps  # not 1, 2, 4, 8 s


def serve_cli(model_dir, home, port: int):
    args = ["--model", str(model_dir), "--port", str(port), "--home", str(home), "--threads", "1"]
    return run_serve_cli([*args, "--shutdown-timeout", "1", "--quiet"])


def test_a_sample_cancelled_by_shutdown_finishes_after_the_restart(tiny_model_dir, tmp_path, caplog):
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    proc, text, key = serve_cli(tiny_model_dir, tmp_path, port)
    restarted = None
    caplog.set_level(logging.INFO, logger="trine.client")
    try:
        assert key, text
        wait_http(f"{url}/health", key)
        # Retry-After asks for 30 s (the server's guess of a restart); the test waits at most 1 s
        settings = Settings(retry_after_max_s=1.0, retry_initial_delay_s=0.1, retry_max_delay_s=0.5)
        with trio.ServiceClient(api_key=key, base_url=url, settings=settings) as svc:
            sampler = svc.create_sampling_client(base_model=tiny_model_dir.name)
            # 600 tokens x 8: seconds of decoding on the tiny model (600 steps, each a forward) and
            # no more: the whole sample runs again after the restart
            params = trio.SamplingParams(max_tokens=600, temperature=1.0, seed=3)
            future = sampler.sample(trio.ModelInput.from_ints([1, 2, 3, 4]), 8, params)
            wait_decoding(url, 8)  # SIGTERM while its 8 sequences decode, not on a timer
            assert not future.done()
            proc.send_signal(signal.SIGTERM)
            assert proc.wait(15) == 0, proc.stdout.read()
            assert not future.done()  # the 503 was retried, not raised
            restarted, text, _ = serve_cli(tiny_model_dir, tmp_path, port)
            assert "PYTRIO_API_KEY" in text, text
            result = future.result(timeout=120)
        assert len(result.sequences) == 8 and all(s.tokens for s in result.sequences)
    finally:
        for p in (proc, restarted):
            if p is not None and p.poll() is None:
                p.kill()
                p.wait(10)
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert any("HTTP 503" in w and "/sample" in w for w in warnings), warnings
    store = Store(tmp_path)
    usage = [u for u in store.usage_events(store.key_by_secret(key).id) if u.operation == "sample"]
    assert len({u.request_id for u in usage}) == 1 and len(usage) == 2, usage  # cancelled part, then whole
