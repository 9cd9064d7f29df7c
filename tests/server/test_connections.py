"""Connections that send nothing (or never finish their headers) cannot crowd out valid requests:
a header timeout drops them, a connection cap counted at accept time closes the oldest connection without a
request, a request
uvicorn cannot parse gets a JSON answer, and each condition is
logged once, not once per connection."""

from __future__ import annotations

import json
import logging
import socket
import threading
import time

import httpx
import psutil
import pytest
from serverutil import serve

from trine.server.http import connections


@pytest.fixture(scope="module")
def server(tiny_model_dir, tmp_path_factory):
    with serve(
        tiny_model_dir, tmp_path_factory.mktemp("home"), max_connections=16, header_timeout=1.5
    ) as srv:
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


def server_connections(url: str) -> int:
    """Established TCP connections whose local end is the server's port (this process serves)."""
    port = int(url.rsplit(":", 1)[1])
    return sum(
        1
        for c in psutil.Process().net_connections("tcp")
        if c.laddr and c.laddr.port == port and c.status == psutil.CONN_ESTABLISHED
    )


def test_a_burst_of_headerless_connections_keeps_the_cap_and_valid_clients_served(server):
    """300 connections that never send headers against a cap of 16: the server holds at most the
    cap (each new one closes a different old one), and every valid request during the burst is
    answered."""
    socks, failures, peak = [], 0, 0
    try:
        with httpx.Client(base_url=server.url, trust_env=False, timeout=10) as c:
            for _wave in range(6):
                socks += open_idle(server.url, 50, b"")
                time.sleep(0.05)
                peak = max(peak, server_connections(server.url))
                failures += sum(c.get("/").status_code != 200 for _ in range(3))
        assert failures == 0
        assert peak <= 16 + 2  # the cap, plus connections accepted but not yet closed this turn
        assert sum(closed_by_server(s, 0.5) for s in socks[:-16]) == len(socks) - 16
    finally:
        for s in socks:
            s.close()


def test_valid_clients_connecting_during_a_burst_are_not_closed_for_it(server):
    """While another thread opens headerless connections as fast as it can (many per accept turn),
    valid requests on fresh connections are all answered: a connection is never closed to make
    room before the server has read the headers that followed its connect."""
    stop, socks = threading.Event(), []

    def flood():
        while not stop.is_set() and len(socks) < 3000:
            socks.extend(open_idle(server.url, 25, b""))

    attacker = threading.Thread(target=flood)
    attacker.start()
    failures = 0
    try:
        for _ in range(60):
            try:
                with httpx.Client(base_url=server.url, trust_env=False, timeout=5) as c:
                    failures += c.get("/").status_code != 200
            except httpx.HTTPError:
                failures += 1
    finally:
        stop.set()
        attacker.join()
        for s in socks:
            s.close()
    assert len(socks) > 200 and failures == 0


def raw_request(url: str, data: bytes) -> bytes:
    host, port = url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=10) as s:
        s.sendall(data)
        out = b""
        while chunk := s.recv(65536):
            out += chunk
    return out


def test_oversized_headers_and_bad_content_length_get_json_answers(server):
    huge = raw_request(
        server.url, b"GET /api/v1/healthz HTTP/1.1\r\nHost: x\r\nX-API-Key: " + b"k" * (1 << 20) + b"\r\n\r\n"
    )
    head, _, body = huge.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 431")
    assert json.loads(body)["code"] == "request_header_fields_too_large"
    bad = raw_request(server.url, b"POST /api/v1/healthz HTTP/1.1\r\nHost: x\r\nContent-Length: -1\r\n\r\n")
    head, _, body = bad.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 400") and b"application/json" in head
    answer = json.loads(body)
    assert answer["code"] == "invalid_http_request" and "Content-Length" in answer["message"]
