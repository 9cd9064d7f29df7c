"""`trine serve --ray/--replicas` as a user runs them; Ray stays out of a server without --ray."""

from __future__ import annotations

import subprocess
import sys

import pytest
from click.testing import CliRunner
from serverutil import free_port, run_serve_cli, wait_http

from trine.cli.main import main


def test_replicas_need_ray_and_nothing_of_ray_loads_without_it(tmp_path):
    out = CliRunner().invoke(main, ["serve", "--replicas", "2", "--home", str(tmp_path)])
    assert out.exit_code != 0 and "--replicas" in out.output and "--ray" in out.output
    code = (
        "import sys; import trine.cli.main, trine.cli.serve, trine.server.app, trine.service, "
        "trine.engine.runtime.local; "
        "print(sorted(m for m in sys.modules if m == 'ray' or m.startswith('ray.')))"
    )
    loaded = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert loaded.stdout.strip() == "[]"


@pytest.mark.slow
def test_serve_with_two_ray_replicas(tiny_model_dir, tmp_path):
    pytest.importorskip("ray")
    port = free_port()
    proc, text, key = run_serve_cli(
        [
            "--model",
            str(tiny_model_dir),
            "--port",
            str(port),
            "--home",
            str(tmp_path),
            "--ray",
            "--replicas",
            "2",
        ],
        timeout=300,
    )
    try:
        assert "2 Ray replica(s) per model" in text, text
        r = wait_http(f"http://127.0.0.1:{port}/api/models", key, tries=1200)
        assert r.status_code == 200 and r.json()["items"][0]["name"] == "tiny-llama"
    finally:
        proc.terminate()
        proc.wait(60)
