"""Restart benchmark: `kill -9` of `trine serve` with an SDK sample in flight, then a restart on the
same data dir and port; the SDK retries the sample (same request id) until the new server answers.

Starts `trine serve` (the real CLI, SmolLM2-135M-Instruct unless `--model`) on 127.0.0.1 with a
fresh data dir. Through the trine SDK with its default retry settings: one warm-up sample, then
the measured sample alone (`--samples` x `--new` tokens, fixed seed), then the same sample again
(a new request id); `--kill-at` of the way through it the server gets SIGKILL and is started again
at once. Reported (`--json`):

- sample_alone_s: the sample on a warm server.
- restart_to_ready_s: from the restart to `GET /health` answering 200 (loading the model,
  recovering the data dir); start_to_ready_s: the same for the first start, on an empty data dir.
- restart_to_answer_s: from the restart to the retried sample's answer (the figure a user sees);
  answer_after_ready_s: from ready to that answer.
- retry_sent_after_ready_s: from ready to the SDK's attempt that the new server answered (the
  SDK's backoff, 0.5 s doubling to 10 s, while the server was down);
  retry_to_answer_s: that attempt's own time, and retry_vs_alone: it over sample_alone_s (about
  1 when the restarted server serves the retry as fast as the first one).

    .venv/bin/python benchmarks/restart.py [--json] [--new 256] [--samples 4] [--model DIR]
"""

from __future__ import annotations

import argparse
import json
import re
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx
from report import record  # benchmarks/report.py

import trine as trio


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def serve(model: Path, home: str, port: int, threads: int | None) -> tuple[subprocess.Popen, str | None]:
    """`trine serve` in the background; returns it and the API key it printed (first start only),
    once it has printed its connection hint."""
    cmd = [sys.executable, "-m", "trine.cli.main", "serve", "--model", str(model), "--home", home]
    cmd += ["--port", str(port), "--quiet", "--log-level", "warning"]
    if threads:
        cmd += ["--threads", str(threads)]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    text = ""
    for line in proc.stdout:
        text += line
        if "PYTRIO_API_KEY=" in line:
            break
    threading.Thread(target=proc.stdout.read, daemon=True).start()  # drain it from now on
    found = re.search(r"(trine-[0-9A-Za-z]{43})", text)
    if proc.poll() is not None:
        raise SystemExit(f"trine serve exited:\n{text}")
    return proc, found.group(1) if found else None


def wait_ready(url: str, limit: float = 600) -> float:
    """When `GET /health` first answers 200."""
    end = time.monotonic() + limit
    while time.monotonic() < end:
        try:
            if httpx.get(f"{url}/health", trust_env=False, timeout=5).status_code == 200:
                return time.monotonic()
        except httpx.HTTPError:
            pass
        time.sleep(0.05)
    raise SystemExit(f"{url} not ready after {limit} s")


class Attempts(httpx.AsyncBaseTransport):
    """Records when each sample request is sent (the SDK's retries included)."""

    def __init__(self, inner: httpx.AsyncBaseTransport):
        self.inner, self.sent = inner, []

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        if request.url.path.endswith("/sample"):
            self.sent.append(time.monotonic())
        return await self.inner.handle_async_request(request)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="a model directory (default: SmolLM2-135M-Instruct)")
    ap.add_argument("--new", type=int, default=256, help="new tokens per sample")
    ap.add_argument("--samples", type=int, default=4, help="samples in the request")
    ap.add_argument("--kill-at", type=float, default=0.5, help="fraction of sample_alone_s")
    ap.add_argument("--threads", type=int, default=None, help="--threads for trine serve")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    if args.model:
        model = Path(args.model).resolve()
    else:
        from trine.engine.model.default_model import ensure_default_model

        model = ensure_default_model()
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    prompt = trio.ModelInput.from_ints([1, 9690, 198, 22503, 549, 253, 1789, 2665, 30, 2, 198])
    params = trio.SamplingParams(max_tokens=args.new, temperature=1.0, seed=11)
    with tempfile.TemporaryDirectory() as home:
        started = time.monotonic()
        first, key = serve(model, home, port, args.threads)
        second = None
        try:
            first_ready = wait_ready(url) - started
            with trio.ServiceClient(api_key=key, base_url=url) as svc:
                sampler = svc.create_sampling_client(base_model=model.name)
                sampler.sample(prompt, 1, trio.SamplingParams(max_tokens=4)).result()  # warm
                start = time.monotonic()
                alone = sampler.sample(prompt, args.samples, params).result()
                sample_alone = time.monotonic() - start
                log(f"sample alone: {sample_alone:.1f} s, {alone.output_tokens} tokens")

                http = svc._rt.actor_http  # every sampling client's connection pool
                http._transport = attempts = Attempts(http._transport)
                future = sampler.sample(prompt, args.samples, params)
                time.sleep(args.kill_at * sample_alone)
                if future.done():
                    raise SystemExit("the sample finished before the kill: raise --new")
                first.kill()
                first.wait(30)
                killed = time.monotonic()
                second, _ = serve(model, home, port, args.threads)
                ready = wait_ready(url)
                retried = future.result(timeout=3600)
                answered = time.monotonic()
                log(f"killed; ready {ready - killed:.1f} s later, answered {answered - ready:.1f} s after")
        finally:
            for proc in (first, second):
                if proc is not None and proc.poll() is None:
                    proc.terminate()
                    proc.wait(60)
    last = attempts.sent[-1]
    result = {
        "sample_alone_s": round(sample_alone, 2),
        "output_tokens": alone.output_tokens,
        "retried_output_tokens": retried.output_tokens,
        "killed_after_s": round(args.kill_at * sample_alone, 2),
        "start_to_ready_s": round(first_ready, 2),
        "restart_to_ready_s": round(ready - killed, 2),
        "restart_to_answer_s": round(answered - killed, 2),
        "answer_after_ready_s": round(answered - ready, 2),
        "retry_sent_after_ready_s": round(last - ready, 2),
        "retry_to_answer_s": round(answered - last, 2),
        "retry_vs_alone": round((answered - last) / sample_alone, 2),
        "attempts": len(attempts.sent),
    }
    record(result)  # benchmarks/results/restart.jsonl
    print(json.dumps(result) if args.json else "\n".join(f"{k}: {v}" for k, v in result.items()))


if __name__ == "__main__":
    main()
