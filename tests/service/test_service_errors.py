"""Service-level hardening: reused ids with another body, ids of another key's run, events stored
before they are queued, checkpoint names that look like archives, downloads after an overwrite."""

from __future__ import annotations

import io
import sqlite3
import tarfile

import httpx
import msgpack
import pytest
from serverutil import ADAM, RawClient, ce_payload, event, serve

from trine.limits import KeyLimits

MODEL = "tiny-llama"


@pytest.fixture(scope="module")
def server(tiny_model_dir, tmp_path_factory):
    with serve(tiny_model_dir, tmp_path_factory.mktemp("home")) as srv:
        yield srv


def new_run(client: RawClient):
    return client.started_run(MODEL)


def test_a_reused_event_id_with_another_body_is_a_409(client):
    run, rid = new_run(client)
    fb = msgpack.packb(event("event_reuse0000001", "forward_backward", 2, ce_payload([5, 6, 7, 8]), rid))
    assert client.submit(run, fb).status_code in (200, 202)
    other = client.submit(run, event("event_reuse0000001", "forward_backward", 2, ce_payload([9, 9, 9]), rid))
    assert other.status_code == 409 and other.json()["code"] == "event_id_reused"
    assert "event_reuse0000001" in other.json()["message"]
    done = client.wait(run, "event_reuse0000001")
    assert done["result"]["metrics"]["token_count"] == 4  # the first body ran, once
    again = client.submit(run, fb)  # a byte-identical retry: the stored result
    assert again.status_code == 200 and msgpack.unpackb(again.content) == done


def test_another_keys_event_id_answers_as_unknown(server, client):
    run_a, rid_a = new_run(client)
    eid = "event_shared000001"
    assert (
        client.submit(run_a, event(eid, "forward_backward", 2, ce_payload([5, 6, 7, 8]), rid_a)).status_code
        < 300
    )
    _, secret_b = server.service.store.create_key("key-b")
    b = RawClient(server.url, secret_b)
    try:
        run_b, rid_b = new_run(b)
        r = b.submit(run_b, event(eid, "forward_backward", 2, ce_payload([1, 2, 3]), rid_b))
        assert r.status_code in (200, 202), r.text  # accepted as a new id: nothing says it exists
        mine = b.wait(run_b, eid)
        assert mine["event_id"] == eid and mine["result"]["metrics"]["token_count"] == 3
        assert client.wait(run_a, eid)["result"]["metrics"]["token_count"] == 4
    finally:
        b.close()


def test_a_reused_sample_request_id_with_another_body_is_a_409(client):
    srun = client.sampling_run(client.session(), MODEL)
    body = {
        "request_id": "same-id",
        "prompt": {"chunks": [{"type": "encoded_text", "tokens": [1, 2, 3]}]},
        "sampling_params": {"max_tokens": 3, "seed": 1},
    }
    first = client.sample(srun, body)
    assert first.status_code == 200
    assert client.sample(srun, body).json() == first.json()  # a retry: the stored outcome
    other = client.sample(srun, {**body, "sampling_params": {"max_tokens": 4, "seed": 1}})
    assert other.status_code == 409 and other.json()["code"] == "request_id_reused"


def test_a_failed_event_write_leaves_nothing_queued(server, client, monkeypatch):
    run, rid = new_run(client)
    store = server.service.store

    def broken(rec):
        raise sqlite3.OperationalError("disk I/O error")

    monkeypatch.setattr(store, "add_event", broken)
    r = client.submit(run, event("event_ghost0000001", "forward_backward", 2, ce_payload([5, 6, 7]), rid))
    assert r.status_code == 500
    monkeypatch.undo()
    assert store.event("event_ghost0000001") is None
    ok = client.submit(run, event("event_ghost0000002", "forward_backward", 2, ce_payload([5, 6, 7]), rid))
    assert ok.status_code in (200, 202)  # index 2 was not taken by the failed one
    assert client.wait(run, "event_ghost0000002")["status"] == "succeeded"
    usage = store.usage_events(store.key_by_secret(server.api_key).id, run_id=rid)
    assert [u.request_id for u in usage if u.operation == "forward_backward"] == ["event_ghost0000002"]


def _download(client: RawClient, checkpoint_id: str) -> dict[str, bytes]:
    info = client.control("GET", f"checkpoints/{checkpoint_id}/download-url").json()
    r = httpx.get(info["url"], trust_env=False)
    assert r.status_code == 200, r.text
    with tarfile.open(fileobj=io.BytesIO(r.content)) as tf:
        return {m.name: tf.extractfile(m).read() for m in tf.getmembers() if m.isfile()}


def test_checkpoint_names_w_and_w_tar_and_overwrites(server, client):
    run, rid = new_run(client)
    ids = {}
    for i, name in enumerate(("w", "w.tar"), start=2):
        eid = f"event_wtar{rid[-6:]}{i}"
        client.submit(run, event(eid, "save_weights", i, {"name": name}, rid))
        ids[name] = client.wait(run, eid)["result"]["checkpoint"]["checkpoint_cuid"]
    first = {name: _download(client, ck) for name, ck in ids.items()}
    assert all(any(k.endswith("adapter_model.safetensors") for k in files) for files in first.values())
    # train one step, overwrite "w": its download now serves the new weights
    client.submit(run, event(f"event_wtar{rid[-6:]}4", "forward_backward", 4, ce_payload([5, 6, 7, 8]), rid))
    client.submit(run, event(f"event_wtar{rid[-6:]}5", "optimize_step", 5, ADAM, rid))
    client.submit(
        run, event(f"event_wtar{rid[-6:]}6", "save_weights", 6, {"name": "w", "overwrite": True}, rid)
    )
    new_id = client.wait(run, f"event_wtar{rid[-6:]}6")["result"]["checkpoint"]["checkpoint_cuid"]
    weights = lambda files: next(v for k, v in files.items() if k.endswith("adapter_model.safetensors"))
    assert weights(_download(client, new_id)) != weights(first["w"])
    for ck in (new_id, ids["w.tar"]):
        r = client.control("DELETE", f"checkpoints/{ck}")
        assert r.status_code == 200, r.text
    leftovers = [p for p in server.home.rglob("*") if ".tmp-" in p.name]
    assert leftovers == []


@pytest.fixture(scope="module")
def limited(tiny_model_dir, tmp_path_factory):
    """max_adapters=1, and per-key limits small enough to reach in a test (a rank-4 run of the tiny
    model holds about 3.6 MB of adapter state, a rank-64 one about 57 MB)."""
    limits = KeyLimits(live_runs=3, adapter_bytes=20 << 20, queued_tokens=20)
    with serve(tiny_model_dir, tmp_path_factory.mktemp("home"), max_adapters=1, key_limits=limits) as srv:
        yield srv


def test_a_just_saved_sampler_stays_available_while_it_is_spilled(limited):
    """max_adapters=1: every new temporary save evicts (spills) the previous one; samplers of the
    evicted snapshot wait for the spill and load it from disk, never answering 'unavailable'."""
    from concurrent.futures import ThreadPoolExecutor

    c = RawClient(limited.url, limited.api_key)
    try:
        run, rid = new_run(c)
        uris = []
        for i in range(2, 5):
            eid = f"event_spill{rid[-5:]}{i}"
            c.submit(
                run,
                event(
                    eid,
                    "save_weights",
                    i,
                    {"name": f"temp-{i}", "visibility": "TEMPORARY", "ttl_seconds": 600},
                    rid,
                ),
            )
            uris.append(c.wait(run, eid)["result"]["checkpoint"]["uri"])
        samplers = [c.sampling_run(c.session(), MODEL, uri=u) for u in uris]
        body = lambda i: {
            "request_id": f"s{i}",
            "sampling_params": {"max_tokens": 2},
            "prompt": {"chunks": [{"type": "encoded_text", "tokens": [1, 2, 3]}]},
        }
        with ThreadPoolExecutor(6) as pool:
            codes = list(pool.map(lambda i: c.sample(samplers[i % 3], body(i)).status_code, range(12)))
        assert codes == [200] * 12
    finally:
        c.close()


def test_per_key_limits_answer_429_naming_the_limit(limited):
    _, secret = limited.service.store.create_key("limited")
    c = RawClient(limited.url, secret)
    try:
        session = c.session()
        create = lambda rank: c.control(
            "POST", f"service-sessions/{session}/training-runs", json={"base_model": MODEL, "lora_rank": rank}
        )
        big = create(64)
        assert big.status_code == 429 and "adapter_bytes" in big.json()["message"]
        runs = [create(4).json() for _ in range(3)]
        full = create(4)
        assert full.status_code == 429 and "live_runs" in full.json()["message"]
        # queued tokens: events behind an index gap wait; past 20 tokens the key is refused
        run = runs[0]
        rid = run["training_run_cuid"]
        assert (
            c.submit(
                run,
                event(f"event_q{rid[-6:]}003", "forward_backward", 3, ce_payload(list(range(5, 17))), rid),
            ).status_code
            == 202
        )
        r = c.submit(
            run, event(f"event_q{rid[-6:]}004", "forward_backward", 4, ce_payload(list(range(5, 17))), rid)
        )
        assert r.status_code == 429 and "queued_tokens" in r.json()["message"]
        # closing the session ends its runs: the key may create runs again
        assert c.control("POST", f"service-sessions/{session}/close", json={}).status_code == 200
        again = c.control(
            "POST",
            f"service-sessions/{c.session()}/training-runs",
            json={"base_model": MODEL, "lora_rank": 4},
        )
        assert again.status_code == 200
    finally:
        c.close()
