"""Connections that send nothing (or never finish their headers) cannot crowd out valid requests:
a header timeout drops them, a connection cap closes the oldest idle one, and each condition is
logged once, not once per connection."""
from __future__ import annotations

import logging
import socket
import time

import httpx
import pytest

from serverutil import serve
from trine.server import connections


@pytest.fixture(scope="module")
def server(tiny_model_dir, tmp_path_factory):
    with serve(tiny_model_dir, tmp_path_factory.mktemp("home"), max_connections=16, header_timeout=1.5) as srv:
        yield srv


def open_idle(url: str, n: int, partial: bytes) -> list[socket.socket]:
    host, port = url.removeprefix("http://").split(":")
    socks = []
    for _ in range(n):
        s = socket.create_connection((host, int(port)), timeout=5)
        if partial:
            s.sendall(partial)
        socks.append(s)
    return socks


def closed_by_server(s: socket.socket, wait: float) -> bool:
    s.settimeout(wait)
    try:
        return s.recv(1) == b""
    except ConnectionResetError:
        return True
    except TimeoutError:
        return False


def test_idle_connections_do_not_block_valid_requests(server, caplog):
    caplog.set_level(logging.WARNING, logger="trine.server.connections")
    before = connections.conditions.count("connection cap")
    socks = open_idle(server.url, 40, b"") + open_idle(server.url, 20, b"GET / HTTP/1.1\r\nHo")
    try:
        t0 = time.monotonic()
        with httpx.Client(base_url=server.url, trust_env=False, timeout=10) as c:
            for _ in range(3):
                assert c.get("/").status_code == 200
        assert time.monotonic() - t0 < 1.0  # well before any header timeout
        assert connections.conditions.count("connection cap") - before >= 40
        lines = [r for r in caplog.records if "open connections" in r.getMessage()]
        assert len(lines) <= 1  # one line for the condition, not one per connection
    finally:
        for s in socks:
            s.close()


def test_a_connection_without_complete_headers_is_dropped(server):
    (silent,) = open_idle(server.url, 1, b"")
    (slow,) = open_idle(server.url, 1, b"GET / HTTP/1.1\r\nHost: x\r\n")
    try:
        assert closed_by_server(silent, 5) and closed_by_server(slow, 5)
    finally:
        silent.close()
        slow.close()
    with httpx.Client(base_url=server.url, trust_env=False, timeout=10) as c:  # keep-alive still works
        assert c.get("/").status_code == 200
        time.sleep(2)  # idle between requests longer than the header timeout: governed by keep-alive
        assert c.get("/").status_code == 200
