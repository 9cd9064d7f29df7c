"""The lifetime of a local Ray cluster that trine started (`trine serve --ray`): it stops when
trine does, however trine ends.

A normal exit (Ctrl-C, SIGTERM) stops it with `ray.shutdown()` (`stop_local_cluster`). A killed
process (SIGKILL) runs no code, so `watch_local_cluster` starts a small watchdog process first: it
waits on a pipe only trine holds, and when the pipe closes without trine saying the cluster is
stopped, it ends, SIGTERM then SIGKILL, every process whose command line names this cluster's
session directory (its GCS, raylet, log monitor and worker processes) or whose environment names
its raylet (`RAY_RAYLET_PID`, which the raylet gives every process it starts). The second test
matters: the raylet's DashboardAgent and RuntimeEnvAgent rename their command line
(`ray::DashboardAgent`), and the GCS and raylet die with trine, so the agents, orphaned, would
notice only about a minute later. Linux only (it reads /proc); elsewhere a killed trine's Ray
processes end when Ray notices (about a minute).
A cluster trine joined (`--ray auto`, `--ray ray://...`) is never stopped by trine.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import ray

_WATCHDOG = r"""
import os, signal, sys, time
session, raylet = sys.argv[1].encode(), sys.argv[2].encode()
if sys.stdin.buffer.read() == b"stopped":
    sys.exit(0)  # trine stopped the cluster itself
def read(path):
    try:
        with open(path, "rb") as f:
            return f.read()
    except OSError:
        return b""
def ours():
    me = os.getpid()
    for pid in (int(p) for p in os.listdir("/proc") if p.isdigit()):
        if pid != me and (
            session in read(f"/proc/{pid}/cmdline")
            or (raylet and b"RAY_RAYLET_PID=" + raylet in read(f"/proc/{pid}/environ").split(b"\0"))
        ):
            yield pid
for sig in (signal.SIGTERM, signal.SIGKILL):
    for pid in list(ours()):
        try:
            os.kill(pid, sig)
        except OSError:
            pass
    time.sleep(1.0)
"""

_watchdog: subprocess.Popen | None = None


def session_dir() -> str:
    """The running cluster's session directory (Ray names it uniquely per cluster start)."""
    return ray._private.worker._global_node.get_session_dir_path()  # no public API gives it


def raylet_pid() -> int | None:
    """The pid of the raylet this process started; None if Ray does not say (no public API)."""
    try:
        return ray._private.worker._global_node.all_processes["raylet"][0].process.pid
    except (AttributeError, KeyError, IndexError):
        return None


def watch_local_cluster() -> None:
    """Start the watchdog for the local cluster this process has just started (Linux only)."""
    global _watchdog
    if not Path("/proc/self/cmdline").exists():
        return
    _release()  # one watching a cluster stopped before (ray.shutdown() called directly)
    _watchdog = subprocess.Popen(
        [sys.executable, "-c", _WATCHDOG, Path(session_dir()).name, str(raylet_pid() or "")],
        stdin=subprocess.PIPE,
        start_new_session=True,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )


def stop_local_cluster() -> None:
    """Stop Ray here (a local cluster this process started goes with it) and release the watchdog."""
    if ray.is_initialized():
        ray.shutdown()
    _release()


def _release() -> None:
    """Tell the watchdog its cluster is stopped; it exits without ending anything."""
    global _watchdog
    if _watchdog is not None:
        try:
            _watchdog.stdin.write(b"stopped")
            _watchdog.stdin.close()
        except OSError:
            pass
        _watchdog.wait(10)
        _watchdog = None
