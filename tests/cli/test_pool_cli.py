"""`trine serve --ray/--replicas` as a user runs them; Ray stays out of a server without --ray."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

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


def descendants(root: int) -> set[int]:
    """`root`'s living descendants, from /proc (Linux)."""
    parent = {}
    for pid in (int(p) for p in os.listdir("/proc") if p.isdigit()):
        try:
            stat = Path(f"/proc/{pid}/stat").read_bytes()
        except OSError:
            continue
        parent[pid] = int(stat.rsplit(b")", 1)[1].split()[1])
    found, grew = {root}, True
    while grew:
        more = {pid for pid, pp in parent.items() if pp in found and pid not in found}
        found |= more
        grew = bool(more)
    return found - {root}


def alive(pid: int) -> bool:
    """Running (a zombie has ended: only its exit status is left)."""
    try:
        return Path(f"/proc/{pid}/stat").read_bytes().rsplit(b")", 1)[1].split()[0] != b"Z"
    except OSError:
        return False


@pytest.mark.slow
@pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="reads /proc (Linux)")
def test_kill_9_of_serve_leaves_no_ray_process_after_10_s(tiny_model_dir, tmp_path):
    """The local Ray cluster's processes, its DashboardAgent and RuntimeEnvAgent among them (they
    rename their command line), end within 10 s of a SIGKILL of `trine serve --ray`."""
    pytest.importorskip("ray")
    port = free_port()
    args = ["--model", str(tiny_model_dir), "--port", str(port), "--home", str(tmp_path), "--ray"]
    proc, text, key = run_serve_cli([*args, "--quiet"], timeout=300)
    try:
        wait_http(f"http://127.0.0.1:{port}/health", key, tries=1200)
        ray_procs = descendants(proc.pid)
        names = {Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")[0] for pid in ray_procs}
        assert {b"ray::DashboardAgent", b"ray::RuntimeEnvAgent"} <= names, names
    finally:
        proc.kill()
        proc.wait(10)
    killed = time.monotonic()
    while any(alive(pid) for pid in ray_procs) and time.monotonic() - killed < 10:
        time.sleep(0.2)
    left = {pid: Path(f"/proc/{pid}/cmdline").read_bytes()[:60] for pid in ray_procs if alive(pid)}
    assert not left, f"alive {time.monotonic() - killed:.0f} s after kill -9: {left}"
