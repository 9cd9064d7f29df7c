"""Start a real trine server on a free loopback port for tests (in a thread), and small raw clients.

    with serve(tiny_model_dir, tmp_path / "home") as srv:
        srv.url, srv.api_key          # control plane root and a valid key

Other test files reuse this; keep it dependency-free beyond trine itself.
"""

from __future__ import annotations

import contextlib
import os
import re
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import msgpack

from trine.engine.config import EngineConfig, SamplerConfig, TrainerConfig
from trine.server.app import ServerHandle, start_server

# Small engines: tests run on 2 shared cores.
TEST_ENGINE = EngineConfig(
    num_threads=1,
    device="cpu",
    sampler=SamplerConfig(kv_cache_bytes=16 << 20, max_batch_tokens=512),
    trainer=TrainerConfig(micro_batch_tokens=1024),
)
TEST_OPTIONS = dict(gather_seconds=0.02, engine=TEST_ENGINE)


def start(models, home: str | Path, **options) -> ServerHandle:
    opts = {**TEST_OPTIONS, **options}
    if not isinstance(models, (list, tuple, dict)):
        models = [models]
    return start_server(models, home=home, **opts)


@contextlib.contextmanager
def serve(models, home: str | Path, **options):
    handle = start(models, home, **options)
    try:
        yield handle
    finally:
        handle.stop()


@contextlib.contextmanager
def pytrio_env(url: str, api_key: str):
    """Point the official pytrio client at `url` (it reads the env at import; configure() later)."""
    old = {k: os.environ.get(k) for k in ("PYTRIO_BASE_URL", "PYTRIO_API_KEY", "NO_PROXY")}
    os.environ.update(PYTRIO_BASE_URL=url, PYTRIO_API_KEY=api_key, NO_PROXY="127.0.0.1,localhost")
    import pytrio

    # short retry windows: a test that fails must not leave the client retrying for 15 minutes
    pytrio.configure(
        base_url=url,
        api_key=api_key,
        control_retry_timeout_seconds=10,
        training_retry_timeout_seconds=10,
        sampling_retry_timeout_seconds=10,
    )
    pytrio.configure_observability(enabled=False)
    try:
        yield pytrio
    finally:
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


class RawClient:
    """Speaks the wire protocol directly (control JSON + actor msgpack), for tests of the server's
    own behaviour: retries, ordering, bad input."""

    def __init__(self, url: str, api_key: str):
        self.url = url
        self.http = httpx.Client(
            base_url=url,
            timeout=60,
            trust_env=False,
            headers={"X-API-Key": api_key, "Authorization": f"Bearer {api_key}"},
        )

    def close(self):
        self.http.close()

    def control(self, method: str, path: str, **kw) -> httpx.Response:
        return self.http.request(method, f"/api/openapi/v1/{path}", **kw)

    def session(self) -> str:
        r = self.control("POST", "service-sessions", json={"sdk_version": "test"})
        r.raise_for_status()
        return r.json()["service_session_cuid"]

    def training_run(self, session: str, base_model: str, rank: int = 4) -> dict:
        r = self.control(
            "POST",
            f"service-sessions/{session}/training-runs",
            json={
                "base_model": base_model,
                "lora_rank": rank,
                "train_mlp": True,
                "train_attn": True,
                "train_unembed": True,
                "source_checkpoint_uri": "",
                "restore_optimizer": False,
            },
        )
        r.raise_for_status()
        return r.json()

    def started_run(self, base_model: str = "tiny-llama", wait: bool = True) -> tuple[dict, str]:
        """A new session's training run with its init_run event accepted (and, with `wait`,
        succeeded): (the run, its id)."""
        run = self.training_run(self.session(), base_model)
        rid = run["training_run_cuid"]
        init = f"event_init{rid[-6:]}"
        r = self.submit(run, event(init, "init_run", 1, init_payload(run["model_id"]), rid))
        assert r.status_code < 300, r.text
        if wait:
            assert self.wait(run, init)["status"] == "succeeded"
        return run, rid

    def sampling_run(self, session: str, base_model: str, uri: str = "") -> dict:
        r = self.control(
            "POST",
            f"service-sessions/{session}/sampling-runs",
            json={"base_model": base_model, "source_checkpoint_uri": uri},
        )
        r.raise_for_status()
        return r.json()

    def submit(self, run: dict, event: dict | bytes) -> httpx.Response:
        body = event if isinstance(event, bytes) else msgpack.packb(event, use_bin_type=True)
        return self.http.post(
            f"{run['actor']['endpoint']}/v1/events",
            content=body,
            headers={
                "Authorization": f"Bearer {run['actor_jwt']['token']}",
                "Content-Type": "application/msgpack",
            },
        )

    def get(self, run: dict, event_id: str, wait: int = 30) -> dict:
        r = self.http.get(
            f"{run['actor']['endpoint']}/v1/events/{event_id}",
            headers={"Authorization": f"Bearer {run['actor_jwt']['token']}", "Prefer": f"wait={wait}"},
        )
        r.raise_for_status()
        return msgpack.unpackb(r.content)

    def refused(self, run: dict, event: dict) -> dict:
        """Submit an event whose payload the server refuses: it is accepted, takes its index and
        fails (the official client treats any failed submit as fatal to its run, so a refusal
        must come as a failed event). Its error, {code, message}."""
        r = self.submit(run, event)
        assert r.status_code in (200, 202), (r.status_code, r.text)
        assert msgpack.unpackb(r.content)["type"] == event["type"]  # the client checks it
        got = self.wait(run, event["event_id"])
        assert got["status"] == "failed" and got["type"] == event["type"], got
        return got["error"]

    def wait(self, run: dict, event_id: str, timeout: int = 60) -> dict:
        for _ in range(timeout):
            ev = self.get(run, event_id, wait=2)
            if ev["status"] in ("succeeded", "failed"):
                return ev
        raise TimeoutError(event_id)

    def sample(self, srun: dict, body: dict) -> httpx.Response:
        return self.http.post(
            f"{srun['actor']['endpoint']}/v1/sampling-runs/{srun['sampling_run_cuid']}/sample",
            json=body,
            headers={"Authorization": f"Bearer {srun['actor_jwt']['token']}"},
        )


def event(event_id: str, type_: str, index: int, payload: dict, run_id: str = "", step: int = 0) -> dict:
    return {
        "version": 1,
        "event_id": event_id,
        "type": f"trainer.{type_}",
        "metadata": {
            "index": index,
            "step": step,
            "timestamp": 0,
            "sdk": "test",
            "sdk_version": "0",
            "run_id": run_id,
        },
        "payload": payload,
    }


def init_payload(model_id: str, rank: int = 4) -> dict:
    return {
        "base_model": model_id,
        "lora_config": {"rank": rank, "train_mlp": True, "train_attn": True, "train_unembed": True},
        "load_optimizer": False,
    }


def ce_payload(tokens: list[int], targets: list[int] | None = None, weights=None) -> dict:
    targets = targets if targets is not None else tokens[1:] + [tokens[0]]
    return {
        "data": [
            {
                "model_input": {"chunks": [{"type": "encoded_text", "tokens": tokens}]},
                "target_ids": targets,
                "weights": weights or [1.0] * len(tokens),
            }
        ],
        "auto_shift": False,
        "loss": {"type": "cross_entropy", "config": {}},
        "gradient_accumulation": {
            "total_samples": 1,
            "total_active_tokens": len(tokens),
            "total_advantage_tokens": 0,
        },
    }


ADAM = {
    "adam_params": {
        "learning_rate": 1e-2,
        "beta1": 0.9,
        "beta2": 0.95,
        "eps": 1e-8,
        "weight_decay": 0.0,
        "grad_clip_norm": 0.0,
    }
}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_serve_cli(args: list[str], timeout: float = 120):
    """Start `trine serve ARGS` in a subprocess; wait for its connection hint. Returns (process,
    the printed text, the new API key). The caller terminates the process."""
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    proc = subprocess.Popen(
        [sys.executable, "-m", "trine.cli.main", "serve", *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=env,
    )
    lines = []
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        line = proc.stdout.readline()
        if not line:
            break
        lines.append(line)
        if "PYTRIO_API_KEY=" in line:
            break
    text = "".join(lines)
    found = re.search(r"(trine-[0-9A-Za-z]{43})", text)
    return proc, text, found.group(1) if found else None


def wait_http(url: str, key: str, tries: int = 300) -> httpx.Response:
    """GET `url` with the key once the server listens."""
    for _ in range(tries):
        try:
            return httpx.get(url, headers={"X-API-Key": key}, trust_env=False)
        except httpx.ConnectError:
            time.sleep(0.1)
    raise TimeoutError(f"{url} did not answer")


def wait_decoding(url: str, sequences: int, timeout: float = 60.0) -> None:
    """Until the server's `trine_sampling_running_sequences` gauge shows `sequences` decoding: a
    test that must act while a sample decodes waits for it instead of sleeping a guessed time."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for line in httpx.get(f"{url}/metrics", trust_env=False).text.splitlines():
            if line.startswith("trine_sampling_running_sequences") and float(line.split()[-1]) >= sequences:
                return
        time.sleep(0.02)
    raise AssertionError(f"no {sequences} sequences decoding within {timeout} s")


@contextlib.contextmanager
def tinker_env(**extra: str):
    """The environment the official tinker client needs against a loopback server: no telemetry,
    no proxy for 127.0.0.1, no model hub (plus `extra`); restored on exit."""
    env = dict(TINKER_TELEMETRY="0", NO_PROXY="127.0.0.1,localhost", HF_HUB_OFFLINE="1", **extra)
    old = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        yield
    finally:
        for k, v in old.items():
            os.environ.pop(k, None) if v is None else os.environ.__setitem__(k, v)
