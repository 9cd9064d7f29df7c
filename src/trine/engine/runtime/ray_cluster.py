"""The lifetime of a local Ray cluster that trine started (`trine serve --ray`): it stops when
trine does, however trine ends.

A normal exit (Ctrl-C, SIGTERM) stops it with `ray.shutdown()` (`stop_local_cluster`). A killed
process (SIGKILL) runs no code, so `watch_local_cluster` starts a small watchdog process first: it
waits on a pipe only trine holds, and when the pipe closes without trine saying the cluster is
stopped, it ends, SIGTERM then SIGKILL, every process whose command line names this cluster's
session directory (its GCS, raylet, log monitor and worker processes), whose parent is its raylet,
or whose environment names it (`RAY_RAYLET_PID`, which the raylet gives every process it starts).
The watchdog notes those processes every second while trine lives, and ends the ones it noted as
well (the same pid and start time): the raylet's DashboardAgent and RuntimeEnvAgent rename their
command line (`ray::DashboardAgent`, which may blank their environment too), and the GCS and raylet
die with trine, so the agents, orphaned and unrecognisable by then, would notice only about a
minute later. Linux only (it reads /proc); elsewhere a killed trine's Ray
processes end when Ray notices (about a minute).
A cluster trine joined (`--ray auto`, `--ray ray://...`) is never stopped by trine.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import ray

_WATCHDOG = r"""
import os, select, signal, sys, time
session, raylet = sys.argv[1].encode(), sys.argv[2].encode()
def read(path):
    try:
        with open(path, "rb") as f:
            return f.read()
    except OSError:
        return b""
def stat(pid):  # (parent pid, start time) or None
    fields = read(f"/proc/{pid}/stat").rsplit(b")", 1)[-1].split()
    return (fields[1], fields[19]) if len(fields) > 19 else None
def ours():
    me = os.getpid()
    for pid in (int(p) for p in os.listdir("/proc") if p.isdigit()):
        st = stat(pid)
        if pid != me and st and (
            session in read(f"/proc/{pid}/cmdline")
            or (raylet and st[0] == raylet)
            or (raylet and b"RAY_RAYLET_PID=" + raylet in read(f"/proc/{pid}/environ").split(b"\0"))
        ):
            yield pid, st[1]
known = {}  # pid -> start time, seen while trine lived: the agents hide their names later
while not select.select([sys.stdin], [], [], 1.0)[0]:
    known.update(ours())
if sys.stdin.buffer.read() == b"stopped":
    sys.exit(0)  # trine stopped the cluster itself
for sig in (signal.SIGTERM, signal.SIGKILL):
    known.update(ours())
    for pid, started in list(known.items()):
        if stat(pid) is not None and stat(pid)[1] == started:  # the same process, not a reused pid
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
