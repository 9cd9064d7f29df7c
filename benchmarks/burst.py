"""Connection-burst benchmark: thousands of connections that never finish their headers, in
waves, while a valid client keeps sending requests on new connections.

Starts `trine serve` (the real CLI, SmolLM2-135M-Instruct unless `--model`) on 127.0.0.1 with
`--max-connections`, then opens `--connections` sockets in `--waves` waves; each sends nothing
(or, for every other one, half a request line) and is held until the server closes it. A valid
client sends `GET /` on a fresh connection every `--every` seconds (timeout `--timeout`) from
before the first wave until `--settle` seconds after the last one. Everything stops by itself.

Reported (`--json`): valid_requests_failed (goal 0), valid_requests, valid_p99_s, max_open_fds
(the server process's descriptors, sampled every 50 ms), fds_before, connections_opened,
closed_by_server.

    .venv/bin/python benchmarks/burst.py [--json] [--connections 10500] [--waves 3] [--max-connections 1024]
"""

from __future__ import annotations

import argparse
import json
import os
import select
import socket
import subprocess
import sys
import tempfile
import threading
import time

import httpx
from report import record  # benchmarks/report.py


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


VALID_CLIENT = r"""
import json, sys, threading, time
import httpx
url, timeout, every = sys.argv[1], float(sys.argv[2]), float(sys.argv[3])
stop = threading.Event()
threading.Thread(target=lambda: (sys.stdin.readline(), stop.set()), daemon=True).start()
out = []
while not stop.is_set():
    t = time.perf_counter()
    try:
        ok = httpx.get(url + "/", timeout=timeout, trust_env=False).status_code == 200
    except httpx.HTTPError:
        ok = False
    out.append(time.perf_counter() - t if ok else None)
    time.sleep(every)
print(json.dumps(out))
"""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def open_fds(pid: int) -> int:
    try:
        return len(os.listdir(f"/proc/{pid}/fd"))
    except OSError:
        return 0


def reap(held: list[socket.socket]) -> tuple[list[socket.socket], int]:
    """Close the sockets the server closed; returns the rest and how many were closed."""
    poller = select.poll()
    by_fd = {s.fileno(): s for s in held}
    for fd in by_fd:
        poller.register(fd, select.POLLIN | select.POLLHUP | select.POLLERR)
    gone = set()
    for fd, _ in poller.poll(0):
        s = by_fd[fd]
        try:
            if s.recv(1, socket.MSG_DONTWAIT) == b"":
                gone.add(fd)
        except BlockingIOError:
            pass
        except OSError:
            gone.add(fd)
    for fd in gone:
        by_fd[fd].close()
    return [s for fd, s in by_fd.items() if fd not in gone], len(gone)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None)
    ap.add_argument("--connections", type=int, default=10500)
    ap.add_argument("--waves", type=int, default=3)
    ap.add_argument("--max-connections", type=int, default=1024)
    ap.add_argument("--every", type=float, default=0.05)
    ap.add_argument("--timeout", type=float, default=5.0)
    ap.add_argument("--settle", type=float, default=3.0)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    with tempfile.TemporaryDirectory() as home:
        cmd = [
            sys.executable,
            "-m",
            "trine.cli.main",
            "serve",
            "--home",
            home,
            "--port",
            str(port),
            "--quiet",
            "--log-level",
            "warning",
            "--max-connections",
            str(args.max_connections),
        ]
        if args.model:
            cmd += ["--model", args.model]
        server = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        try:
            result = burst(server, url, port, args)
        finally:
            server.terminate()
            server.wait(60)
    record(result)  # benchmarks/results/burst.jsonl
    print(json.dumps(result) if args.json else "\n".join(f"{k}: {v}" for k, v in result.items()))


def burst(server: subprocess.Popen, url: str, port: int, args) -> dict:
    deadline = time.monotonic() + 600
    while time.monotonic() < deadline:
        try:
            if httpx.get(url + "/", timeout=2, trust_env=False).status_code == 200:
                break
        except httpx.HTTPError:
            time.sleep(0.5)
    fds_before = open_fds(server.pid)
    stop = threading.Event()
    peak = [fds_before]

    def sample_fds():
        while not stop.is_set():
            peak[0] = max(peak[0], open_fds(server.pid))
            time.sleep(0.05)

    # the valid client runs in its own process, so the burst loop here does not slow it down
    valid_proc = subprocess.Popen(
        [sys.executable, "-c", VALID_CLIENT, url, str(args.timeout), str(args.every)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    threads = [threading.Thread(target=sample_fds, daemon=True)]
    for t in threads:
        t.start()
    held: list[socket.socket] = []
    opened = closed = 0
    per_wave = args.connections // args.waves
    for w in range(args.waves):
        for i in range(per_wave):
            try:
                s = socket.create_connection(("127.0.0.1", port), timeout=5)
            except OSError:
                continue
            opened += 1
            if i % 2:
                s.sendall(b"GET / HTTP/1.1\r\nHo")
            held.append(s)
            if len(held) % 1000 == 0:
                held, n = reap(held)
                closed += n
        held, n = reap(held)
        closed += n
        log(f"wave {w + 1}: {opened} opened, {closed} closed by the server, server fds peak {peak[0]}")
    time.sleep(args.settle)
    held, n = reap(held)
    closed += n
    stop.set()
    for t in threads:
        t.join(args.timeout + 5)
    out, _ = valid_proc.communicate("stop\n", timeout=args.timeout + 30)
    valid = json.loads(out)
    for s in held:
        s.close()
    ok = sorted(v for v in valid if v is not None)
    return {
        "valid_requests_failed": sum(1 for v in valid if v is None),
        "valid_requests": len(valid),
        "valid_p99_s": ok[min(len(ok) - 1, int(0.99 * len(ok)))] if ok else float("nan"),
        "max_open_fds": peak[0],
        "fds_before": fds_before,
        "connections_opened": opened,
        "closed_by_server": closed,
        "max_connections": args.max_connections,
    }


if __name__ == "__main__":
    main()
