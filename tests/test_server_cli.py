"""`trine serve` and `trine keys` as a user runs them."""
from __future__ import annotations

import os
import re
import socket
import subprocess
import sys
import time

import httpx
from click.testing import CliRunner

from trine.cli.keys import keys
from trine.store import Store


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_keys_create_list_revoke(tmp_path):
    runner = CliRunner()
    out = runner.invoke(keys, ["create", "--name", "ci", "--home", str(tmp_path)])
    assert out.exit_code == 0
    secret = out.stdout.strip().splitlines()[0]
    rec = Store(tmp_path).key_by_secret(secret)
    assert rec is not None and rec.name == "ci"
    listed = runner.invoke(keys, ["list", "--home", str(tmp_path)]).stdout
    assert rec.id in listed and secret not in listed
    assert runner.invoke(keys, ["revoke", rec.id, "--home", str(tmp_path)]).exit_code == 0
    assert Store(tmp_path).key_by_secret(secret) is None
    assert runner.invoke(keys, ["create", "--name", " ", "--home", str(tmp_path)]).exit_code != 0


def test_fresh_serve_creates_a_key_and_prints_how_to_connect(tiny_model_dir, tmp_path):
    port = free_port()
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    proc = subprocess.Popen([sys.executable, "-m", "trine.cli.main", "serve", "--model", str(tiny_model_dir),
                             "--port", str(port), "--home", str(tmp_path), "--threads", "1"],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    try:
        lines = []
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            line = proc.stdout.readline()
            if not line:
                break
            lines.append(line)
            if "PYTRIO_API_KEY=" in line:
                break
        text = "".join(lines)
        key = re.search(r"(trine-[0-9A-Za-z]{43})", text).group(1)
        assert f"PYTRIO_BASE_URL=http://127.0.0.1:{port}" in text and "tiny-llama" in text
        for _ in range(200):
            try:
                r = httpx.get(f"http://127.0.0.1:{port}/api/openapi/v1/api-key/verify",
                              headers={"X-API-Key": key}, trust_env=False)
                break
            except httpx.ConnectError:
                time.sleep(0.1)
        assert r.status_code == 200 and r.json()["api_key_name"] == "default"
    finally:
        proc.terminate()
        proc.wait(30)
