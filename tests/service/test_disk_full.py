"""A full disk (issue 32, item 2): coded `disk_full` errors (507) naming the path and its free bytes
for database writes and checkpoint saves, a free-space reserve checked before work is accepted,
free space in /health and /metrics, and an event whose lower index never arrives answered in time.
The disk is not filled: the write functions are made to fail as a full disk makes them fail."""

from __future__ import annotations

import errno
import sqlite3
import time

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families
from serverutil import ADAM, RawClient, ce_payload, event, serve

from trine.engine.runtime import cycle

MODEL = "tiny-llama"


class FullDatabase:
    """A sqlite3 connection whose writes fail as on a full disk (reads still work)."""

    def __init__(self, db: sqlite3.Connection):
        self.db = db

    def execute(self, sql: str, args: tuple = ()):
        if sql.lstrip().upper().startswith(("INSERT", "UPDATE", "DELETE")):
            raise sqlite3.OperationalError("database or disk is full")
        return self.db.execute(sql, args)

    def close(self) -> None:
        self.db.close()


@pytest.fixture(scope="module")
def server(tiny_model_dir, tmp_path_factory):
    with serve(tiny_model_dir, tmp_path_factory.mktemp("home"), missing_index_seconds=1.0) as srv:
        yield srv


@pytest.fixture()
def client(server):
    c = RawClient(server.url, server.api_key)
    yield c
    c.close()


def assert_disk_full(r: httpx.Response, path, named: str = "the server's data dir") -> None:
    """A 507 naming where, by name: never the server's absolute path (issue 51; the operator's log
    has it)."""
    assert r.status_code == 507, r.text
    body = r.json()
    assert body["code"] == "disk_full"
    assert named in body["message"] and "bytes free" in body["message"], body
    assert str(path) not in body["message"], body


def test_a_full_database_is_a_507_naming_it_and_the_server_keeps_serving(server, client):
    run, rid = client.started_run(MODEL)
    store = server.service.store
    real = store._db
    store._db = FullDatabase(real)
    try:
        refused = client.submit(
            run, event("event_full00000001", "forward_backward", 2, ce_payload([5, 6]), rid)
        )
        assert_disk_full(refused, store.path)
        assert client.control("GET", "training-runs").status_code == 200  # reads still answer
    finally:
        store._db = real
    # the refused event took no index: index 2 is free for the next event
    r = client.submit(run, event("event_full00000002", "forward_backward", 2, ce_payload([5, 6]), rid))
    assert r.status_code < 300, r.text
    assert client.wait(run, "event_full00000002")["status"] == "succeeded"


def test_a_sample_finished_on_a_full_disk_is_answered_and_metered_later(server, client):
    srun = client.sampling_run(client.session(), MODEL)
    body = {
        "request_id": "full-1",
        "prompt": {"chunks": [{"type": "encoded_text", "tokens": [1, 2, 3]}]},
        "num_samples": 1,
        "sampling_params": {"max_tokens": 3, "temperature": 0.0},
    }
    store = server.service.store
    real = store._db
    store._db = FullDatabase(real)
    try:
        first = client.sample(srun, body)
        assert first.status_code == 200, first.text  # the compute is not thrown away
        again = client.sample(srun, body)  # a retry gets the same outcome, metered once
        assert again.json()["sequences"] == first.json()["sequences"]
    finally:
        store._db = real
    assert client.sample(srun, {**body, "request_id": "full-2"}).status_code == 200
    key = server.service.authenticate(server.api_key)
    metered = [u.request_id for u in store.usage_events(key.id) if u.request_id.startswith("full-")]
    assert sorted(metered) == ["full-1", "full-2"]


def test_a_checkpoint_save_on_a_full_disk_fails_as_disk_full(server, client, monkeypatch):
    run, rid = client.started_run(MODEL)

    def no_space(final, write):
        raise OSError(errno.ENOSPC, "No space left on device", str(final))

    monkeypatch.setattr(cycle, "save_dir", no_space)
    payload = {"name": "full-state", "visibility": "WORKSPACE"}
    r = client.submit(run, event("event_fullsave0001", "save_state", 2, payload, rid))
    assert r.status_code < 300, r.text
    ev = client.wait(run, "event_fullsave0001")
    assert ev["status"] == "failed", ev
    text = str(ev)
    assert "disk_full" in text and "full-state" in text and "bytes free" in text
    assert "internal_error" not in text
    assert str(server.service.store.home) not in text  # no server path (issue 51)


def test_the_disk_reserve_refuses_work_before_it_writes(tiny_model_dir, tmp_path):
    home = tmp_path / "home"
    with serve(tiny_model_dir, home) as srv:
        c = RawClient(srv.url, srv.api_key)
        run = c.training_run(c.session(), MODEL)
        srun = c.sampling_run(c.session(), MODEL)
        srv.service.gate.reserve_bytes = 1 << 62  # more than any disk has free
        from serverutil import init_payload

        r = c.submit(run, event("event_resv00000001", "init_run", 1, init_payload(run["model_id"])))
        assert_disk_full(r, home)
        assert "reserve" in r.json()["message"]
        assert_disk_full(c.control("POST", "service-sessions", json={"sdk_version": "t"}), home)
        s = c.sample(
            srun,
            {
                "request_id": "r",
                "prompt": {"chunks": [{"type": "encoded_text", "tokens": [1, 2]}]},
                "num_samples": 1,
                "sampling_params": {"max_tokens": 2},
            },
        )
        assert_disk_full(s, home)
        c.close()


def test_health_and_metrics_report_free_space(server):
    h = httpx.get(f"{server.url}/health", trust_env=False)
    assert h.status_code == 200 and h.json()["status"] == "ok"
    assert h.json()["free_bytes"]["data_dir"] > 0 and h.json()["free_bytes"]["checkpoint_dir"] > 0
    m = httpx.get(f"{server.url}/metrics", trust_env=False)
    assert m.status_code == 200 and m.headers["content-type"].startswith("text/plain")
    samples = {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for fam in text_string_to_metric_families(m.text)
        for s in fam.samples
    }
    assert samples[("trine_disk_free_bytes", (("dir", "data_dir"),))] > 0
    assert samples[("trine_shutting_down", ())] == 0


def test_an_index_whose_predecessor_never_arrives_fails_naming_it(server, client):
    run, rid = client.started_run(MODEL)
    r = client.submit(run, event("event_gap000000003", "forward_backward", 3, ce_payload([5, 6]), rid))
    assert r.status_code < 300, r.text
    started = time.monotonic()
    ev = client.wait(run, "event_gap000000003")
    assert time.monotonic() - started < 10
    assert ev["status"] == "failed" and "event_index_missing" in str(ev), ev
    assert "index 2 " in str(ev)
    # the gap filled, index 3 is free again
    for i, eid in ((2, "event_gap000000002"), (3, "event_gap00000003b")):
        assert (
            client.submit(run, event(eid, "forward_backward", i, ce_payload([5, 6]), rid)).status_code < 300
        )
    assert client.wait(run, "event_gap00000003b")["status"] == "succeeded"
    opt = client.submit(run, event("event_gap000000004", "optimize_step", 4, ADAM, rid))
    assert opt.status_code < 300, opt.text
