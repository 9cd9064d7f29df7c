"""The server over raw HTTP: exactly-once ordered events, isolation between keys, bad input, restart."""

from __future__ import annotations

import math
import struct

import msgpack
import pytest
from serverutil import ADAM, RawClient, ce_payload, event, init_payload, serve, start

from trine.store import Store


def floats(tensor: dict) -> list[float]:
    n = math.prod(tensor["shape"])
    return list(struct.unpack(f"<{n}f", tensor["data"]))


@pytest.fixture(scope="module")
def server(tiny_model_dir, tmp_path_factory):
    with serve(tiny_model_dir, tmp_path_factory.mktemp("home")) as srv:
        yield srv


def new_run(client: RawClient, model: str = "tiny-llama"):
    return client.started_run(model)


def test_retried_event_runs_once_and_reports_its_result(server, client):
    run, rid = new_run(client)
    fb = event("event_fb0000000001", "forward_backward", 2, ce_payload([5, 6, 7, 8]), rid)
    first = client.submit(run, fb)
    again = client.submit(run, fb)  # a client retry: same id, same body
    assert first.status_code == 202 and again.status_code < 300
    assert msgpack.unpackb(again.content)["event_id"] == "event_fb0000000001"
    done = client.wait(run, "event_fb0000000001")
    assert done["status"] == "succeeded"
    after = client.submit(run, fb)  # retried after it finished: the stored result, not a rerun
    assert msgpack.unpackb(after.content) == done
    store: Store = server.service.store
    fbs = [
        u
        for u in store.usage_events(store.key_by_secret(server.api_key).id, run_id=rid)
        if u.operation == "forward_backward"
    ]
    assert len(fbs) == 1 and fbs[0].train == 4 and fbs[0].train_loss == 4
    other = client.submit(run, event("event_fb0000000002", "forward_backward", 2, ce_payload([1, 2]), rid))
    assert other.status_code == 409 and other.json()["code"] == "index_conflict"


def test_out_of_order_events_execute_in_index_order(client):
    run, rid = new_run(client)
    # optim (index 3) arrives before the forward_backward (index 2) it must follow
    assert client.submit(run, event("event_op0000000003", "optimize_step", 3, ADAM, rid)).status_code == 202
    assert (
        client.submit(
            run, event("event_fb0000000003", "forward_backward", 2, ce_payload([3, 4, 5]), rid)
        ).status_code
        == 202
    )
    fb, op = client.wait(run, "event_fb0000000003"), client.wait(run, "event_op0000000003")
    assert fb["status"] == op["status"] == "succeeded"
    assert op["result"]["metrics"]["grad_norm"] > 0  # the step saw the gradients of index 2
    assert fb["cycle"] <= op["cycle"]
    assert set(fb["result"]) == {"loss_fn_outputs", "metrics"}  # strict PyTRIO shape
    assert set(fb["result"]["metrics"]) == {"loss_sum", "loss_mean", "token_count"}
    assert set(op["result"]) == {"metrics"}
    assert len(floats(fb["result"]["loss_fn_outputs"][0]["logprobs"])) == 3
    info = client.http.get("/api/trine/v1/events/event_op0000000003").json()
    assert info["cycle"] == op["cycle"] and info["status"] == "succeeded"


def test_another_keys_objects_answer_404(server, client):
    run, rid = new_run(client)
    srun = client.sampling_run(client.session(), "tiny-llama")
    _, secret = server.service.store.create_key("mallory")
    other = RawClient(server.url, secret)
    try:
        assert other.control("GET", f"training-runs/{rid}").status_code == 404
        assert other.control("GET", f"training-runs/{rid}/checkpoints").status_code == 404
        assert other.control("GET", f"sampling-runs/{srun['sampling_run_cuid']}").status_code == 404
        mine = other.training_run(other.session(), "tiny-llama")
        # mallory's own token, aimed at the victim's run
        r = other.submit(mine, event("event_ma0000000001", "forward_backward", 1, ce_payload([1, 2]), rid))
        assert r.status_code == 404 and r.json()["code"] == "training_run_not_found"
        r = other.http.get(
            f"{mine['actor']['endpoint']}/v1/events/event_init{rid[-6:]}",
            headers={"Authorization": f"Bearer {mine['actor_jwt']['token']}"},
        )
        assert r.status_code == 404
        mine_s = other.sampling_run(other.session(), "tiny-llama")
        r = other.http.post(
            f"{mine_s['actor']['endpoint']}/v1/sampling-runs/{srun['sampling_run_cuid']}/sample",
            json={},
            headers={"Authorization": f"Bearer {mine_s['actor_jwt']['token']}"},
        )
        assert r.status_code == 404
    finally:
        other.close()


def test_bad_credentials_get_401(server):
    bad = RawClient(server.url, "trine-nope")
    try:
        r = bad.control("POST", "service-sessions", json={"sdk_version": "x"})
        assert r.status_code == 401 and set(r.json()) >= {"code", "message"}
        r = bad.http.post(
            f"{server.url}/actor/v1/events", content=b"\x80", headers={"Authorization": "Bearer not-a-jwt"}
        )
        assert r.status_code == 401
    finally:
        bad.close()


BAD_EVENTS = {  # a status: the envelope is refused; None: its payload is (the event fails alone)
    "malformed msgpack": (b"\xc1\xff\x00garbage", 400, "invalid_request_body"),
    "not a map": (msgpack.packb([1, 2, 3]), 400, "invalid_request_body"),
    "wrong shape": ("shape", None, "validation_failed"),
    "token outside vocab": ("vocab", None, "validation_failed"),
    "nan weight": ("nan", None, "validation_failed"),
    "unknown loss": ("loss", None, "validation_failed"),
    "unknown type": ("type", 400, "validation_failed"),
    "nan learning rate": ("lr", None, "validation_failed"),
    "oversized": ("big", 413, "request_too_large"),
}


@pytest.mark.parametrize("case", list(BAD_EVENTS))
def test_bad_input_is_refused_and_the_server_keeps_serving(client, case):
    run, rid = new_run(client)
    body, status, code = BAD_EVENTS[case]
    if isinstance(body, str):
        payload = ce_payload([1, 2, 3])
        d = payload["data"][0]
        typ = "forward_backward"
        if body == "shape":
            d["target_ids"] = [1, 2]
        elif body == "vocab":
            d["model_input"]["chunks"][0]["tokens"] = [1, 49152, 3]
        elif body == "nan":
            d["weights"] = [1.0, float("nan"), 1.0]
        elif body == "loss":
            payload["loss"]["type"] = "hinge"
        elif body == "type":
            typ = "explode"
        elif body == "lr":
            typ, payload = (
                "optimize_step",
                {
                    "adam_params": {
                        "learning_rate": float("nan"),
                        "beta1": 0.9,
                        "beta2": 0.95,
                        "eps": 1e-12,
                        "weight_decay": 0.0,
                        "grad_clip_norm": 0.0,
                    }
                },
            )
        elif body == "big":
            payload["padding"] = b"x" * (65 << 20)  # over the 64 MiB event limit
        body = event(f"event_bad{rid[-9:]}", typ, 2, payload, rid)
    if status is None:  # a sound envelope: the event fails alone, and the run goes on after it
        err = client.refused(run, body)
        index = 3
    else:
        r = client.submit(run, body)
        assert r.status_code == status, r.text
        err, index = r.json(), 2  # the rejected envelope did not take index 2
    assert err["code"] == code and err["message"]
    ok = client.submit(
        run, event(f"event_ok{rid[-9:]}", "forward_backward", index, ce_payload([1, 2, 3]), rid)
    )
    assert ok.status_code == 202
    assert client.wait(run, f"event_ok{rid[-9:]}")["status"] == "succeeded"


def test_bad_sample_requests_get_400(client):
    srun = client.sampling_run(client.session(), "tiny-llama")
    good = {
        "request_id": "req_ok",
        "prompt": {"chunks": [{"type": "encoded_text", "tokens": [1, 2]}]},
        "sampling_params": {"max_tokens": 2, "temperature": 0},
        "num_samples": 1,
    }
    cases = [
        dict(good, prompt={"chunks": [{"type": "encoded_text", "tokens": [1, 10**6]}]}),
        dict(good, sampling_params={"temperature": 0}),
        dict(good, sampling_params={"max_tokens": 10**7}),
        dict(good, num_samples=0),
    ]
    for body in cases:
        r = client.sample(srun, body)
        assert r.status_code == 400 and r.json()["code"] == "validation_failed", r.text
    r = client.http.post(
        f"{srun['actor']['endpoint']}/v1/sampling-runs/{srun['sampling_run_cuid']}/sample",
        content=b"{not json",
        headers={"Authorization": f"Bearer {srun['actor_jwt']['token']}"},
    )
    assert r.status_code == 400 and r.json()["code"] == "invalid_request_body"
    assert client.sample(srun, good).status_code == 200


def test_sample_request_id_is_deduplicated_and_metered_once(server, client):
    srun = client.sampling_run(client.session(), "tiny-llama")
    body = {
        "request_id": "req_dedup",
        "prompt": {"chunks": [{"type": "encoded_text", "tokens": list(range(10, 50))}]},
        "sampling_params": {"max_tokens": 3, "temperature": 1.0},
        "num_samples": 3,
    }
    a, b = client.sample(srun, body), client.sample(srun, body)
    assert a.status_code == 200 and a.content == b.content
    out = a.json()
    assert len(out["sequences"]) == 3 and all(
        len(s["logprobs"]) == len(s["tokens"]) for s in out["sequences"]
    )
    u = out["usage"]
    assert u["prompt_tokens"] == u["prefill_tokens"] + u["cached_tokens"] == 40
    assert u["sample_tokens"] == u["output_tokens"] == sum(len(s["tokens"]) for s in out["sequences"])
    store = server.service.store
    rows = store.usage_events(store.key_by_secret(server.api_key).id, run_id=srun["sampling_run_cuid"])
    assert len(rows) == 1 and rows[0].operation == "sample"
    assert (rows[0].prefill, rows[0].prefill_cached, rows[0].sample) == (
        u["prefill_tokens"],
        u["cached_tokens"],
        u["sample_tokens"],
    )


def test_restart_keeps_keys_checkpoints_usage_and_fails_what_was_running(tiny_model_dir, tmp_path):
    home = tmp_path / "home"
    srv = start(tiny_model_dir, home)
    c = RawClient(srv.url, srv.api_key)
    try:
        run, rid = new_run(c)
        assert (
            c.submit(
                run, event("event_fbr000000001", "forward_backward", 2, ce_payload([1, 2, 3]), rid)
            ).status_code
            == 202
        )
        save = event(
            "event_sav000000001",
            "save_weights",
            3,
            {"name": "keep", "overwrite": False, "visibility": "WORKSPACE"},
            rid,
        )
        assert c.submit(run, save).status_code == 202
        saved = c.wait(run, "event_sav000000001")["result"]["checkpoint"]
        # index 5 can never run before index 4 arrives: it is still queued when the server stops
        assert c.submit(run, event("event_stk000000001", "optimize_step", 5, ADAM, rid)).status_code == 202
        prompt = {
            "request_id": "req_r",
            "prompt": {"chunks": [{"type": "encoded_text", "tokens": [4, 5, 6]}]},
            "sampling_params": {"max_tokens": 4, "temperature": 0},
            "num_samples": 1,
        }
        before = c.sample(c.sampling_run(c.session(), "tiny-llama", saved["uri"]), prompt).json()
    finally:
        c.close()
        srv.stop()

    port = int(srv.url.rsplit(":", 1)[1])
    srv = start(tiny_model_dir, home, port=port)  # same address: old actor endpoints stay valid
    c = RawClient(srv.url, srv.api_key)  # the same key still works
    try:
        stuck = c.get(run, "event_stk000000001", wait=1)  # the old actor token is still valid too
        # stopped gracefully: queued work failed at the drain's deadline (a kill -9: server_restarted)
        assert stuck["status"] == "failed" and stuck["error"]["code"] == "server_shutting_down"
        assert c.get(run, "event_fbr000000001", wait=1)["status"] == "succeeded"
        r = c.submit(run, event("event_new000000001", "forward_backward", 4, ce_payload([1, 2]), rid))
        assert r.status_code == 409 and r.json()["code"] == "run_interrupted"
        cks = c.control("GET", f"training-runs/{rid}/checkpoints").json()["checkpoints"]
        assert [ck["checkpoint_uri"] for ck in cks] == [saved["uri"]]
        after = c.sample(c.sampling_run(c.session(), "tiny-llama", saved["uri"]), prompt).json()
        assert after["sequences"][0]["tokens"] == before["sequences"][0]["tokens"]
        store = srv.service.store
        ops = [u.operation for u in store.usage_events(store.key_by_secret(srv.api_key).id)]
        assert ops.count("forward_backward") == 1 and ops.count("sample") == 2
    finally:
        c.close()
        srv.stop()


def test_checkpoint_download_supports_range(server, client):
    run, rid = new_run(client)
    client.submit(
        run, event("event_dl0000000001", "save_state", 2, {"name": "dl", "visibility": "WORKSPACE"}, rid)
    )
    ck = client.wait(run, "event_dl0000000001")["result"]["checkpoint"]
    info = client.control("GET", f"checkpoints/{ck['checkpoint_cuid']}/download-url").json()
    import httpx

    full = httpx.get(info["url"], trust_env=False)
    assert full.status_code == 200 and full.content[257:262] == b"ustar"  # a tar archive
    part = httpx.get(info["url"], headers={"Range": "bytes=100-"}, trust_env=False)
    assert part.status_code == 206 and part.content == full.content[100:]
    assert part.headers["content-range"] == f"bytes 100-{len(full.content) - 1}/{len(full.content)}"
    assert httpx.get(info["url"].split("?")[0] + "?token=x", trust_env=False).status_code == 401


def test_usage_api_is_mounted_and_scoped_to_the_key(server, client):
    srun = client.sampling_run(client.session(), "tiny-llama")
    body = {
        "request_id": "req_usage",
        "prompt": {"chunks": [{"type": "encoded_text", "tokens": [7, 8, 9]}]},
        "sampling_params": {"max_tokens": 2, "temperature": 0},
        "num_samples": 1,
    }
    assert client.sample(srun, body).status_code == 200
    mine = client.http.get("/api/trine/v1/usage/events", params={"run_id": srun["sampling_run_cuid"]}).json()
    assert [e["operation"] for e in mine["events"]] == ["sample"]
    _, secret = server.service.store.create_key("someone-else")
    other = RawClient(server.url, secret)
    try:
        theirs = other.http.get(
            "/api/trine/v1/usage/events", params={"run_id": srun["sampling_run_cuid"]}
        ).json()
        assert theirs["events"] == []
    finally:
        other.close()


def test_long_samples_stream_keepalive_whitespace(server, client, monkeypatch):
    from trine.server.pytrio import routes_actor

    monkeypatch.setattr(routes_actor, "KEEPALIVE_AFTER", 0.0)
    monkeypatch.setattr(routes_actor, "KEEPALIVE_EVERY", 0.001)
    srun = client.sampling_run(client.session(), "tiny-llama")
    body = {
        "request_id": "req_keepalive",
        "prompt": {"chunks": [{"type": "encoded_text", "tokens": [3, 4]}]},
        "sampling_params": {"max_tokens": 12, "temperature": 0},
        "num_samples": 2,
    }
    r = client.sample(srun, body)
    assert r.status_code == 200 and r.text.startswith(" ")  # whitespace first, then the JSON
    assert len(r.json()["sequences"]) == 2


def test_session_close_ends_its_runs(client):
    session = client.session()
    run = client.training_run(session, "tiny-llama")
    rid = run["training_run_cuid"]
    # a queued event that can never run (index 2 is missing): close must fail it, not leave it hanging
    assert client.submit(run, event(f"event_q{rid[-11:]}", "optimize_step", 3, ADAM, rid)).status_code == 202
    for _ in range(2):  # close is idempotent
        r = client.control("POST", f"service-sessions/{session}/close", json={"status": "ENDED"})
        assert r.status_code == 200 and r.json()["status"] == "ENDED"
    assert client.get(run, f"event_q{rid[-11:]}", wait=1)["error"]["code"] == "run_ended"
    assert client.control("GET", f"training-runs/{rid}").json()["status"] == "ENDED"
    r = client.submit(run, event(f"event_z{rid[-11:]}", "init_run", 1, init_payload(run["model_id"]), rid))
    assert r.status_code == 409 and r.json()["code"] == "run_ended"
    r = client.control("POST", f"service-sessions/{session}/training-runs", json={"base_model": "tiny-llama"})
    assert r.status_code == 409 and r.json()["code"] == "service_session_closed"


def test_temporary_weights_spill_to_disk_and_expire(tiny_model_dir, tmp_path):
    with serve(tiny_model_dir, tmp_path / "home", max_adapters=1) as srv:
        c = RawClient(srv.url, srv.api_key)
        run, rid = new_run(c)
        uris = []
        for i in range(3):  # 3 temporary snapshots, room for 1 in memory: older ones go to disk
            c.submit(
                run,
                event(f"event_t{i}{rid[-10:]}", "forward_backward", 2 + 2 * i, ce_payload([1, 2, 3]), rid),
            )
            c.submit(
                run,
                event(
                    f"event_s{i}{rid[-10:]}",
                    "save_weights",
                    3 + 2 * i,
                    {"name": f"tmp-{i}", "visibility": "TEMPORARY", "ttl_seconds": 3600},
                    rid,
                ),
            )
            uris.append(c.wait(run, f"event_s{i}{rid[-10:]}")["result"]["checkpoint"]["uri"])
        prompt = {
            "prompt": {"chunks": [{"type": "encoded_text", "tokens": [4, 5]}]},
            "sampling_params": {"max_tokens": 3, "temperature": 0},
            "num_samples": 1,
        }
        session = c.session()
        for i, uri in enumerate(uris):  # every snapshot still samples, from memory or from disk
            r = c.sample(c.sampling_run(session, "tiny-llama", uri), {**prompt, "request_id": f"req_{i}"})
            assert r.status_code == 200, r.text
        spilled = [ck for ck in srv.service.store.checkpoints(visibility="TEMPORARY")[0] if ck.path]
        assert spilled  # written out when they left memory
        # past its TTL a temporary checkpoint is collected, and its sampler says so
        srv.service.store.update_checkpoint(spilled[0].id, expires_at=0.0)
        import asyncio

        asyncio.run_coroutine_threadsafe(srv.service.collect_garbage(), srv.service.loop).result(30)
        srun = c.sampling_run(session, "tiny-llama", uris[-1])
        assert srv.service.store.checkpoint(spilled[0].id) is None
        gone = next(u for u in uris if u == spilled[0].uri)
        r = c.control("GET", "training-runs/by-checkpoint-uri", params={"checkpoint_uri": gone})
        assert r.status_code == 404
        assert c.sample(srun, {**prompt, "request_id": "req_last"}).status_code == 200
        c.close()


def test_renew_gives_working_actor_credentials_to_the_owner_only(server, client):
    session = client.session()
    trun = client.training_run(session, "tiny-llama")
    srun = client.sampling_run(session, "tiny-llama")
    for run, kind in ((trun, "training"), (srun, "sampling")):
        r = client.control("POST", f"{kind}-runs/{run[f'{kind}_run_cuid']}/renew")
        assert r.status_code == 200, r.text
        renewed = r.json()
        assert renewed[f"{kind}_run_cuid"] == run[f"{kind}_run_cuid"]
        assert renewed["service_session_cuid"] == session and renewed["actor_jwt"]["token"]
        run.update(actor=renewed["actor"], actor_jwt=renewed["actor_jwt"])
    ok = client.submit(
        trun, event("event_renewed1", "forward_backward", 1, ce_payload([1, 2, 3]), trun["training_run_cuid"])
    )
    assert ok.status_code == 202, ok.text
    sample = {
        "request_id": "req_renewed",
        "num_samples": 1,
        "sampling_params": {"max_tokens": 1},
        "prompt": {"chunks": [{"type": "encoded_text", "tokens": [1, 2]}]},
    }
    assert client.sample(srun, sample).status_code == 200
    _, secret = server.service.store.create_key("renew-stranger")
    stranger = RawClient(server.url, secret)
    try:
        assert stranger.control("POST", f"training-runs/{trun['training_run_cuid']}/renew").status_code == 404
        assert stranger.control("POST", f"sampling-runs/{srun['sampling_run_cuid']}/renew").status_code == 404
    finally:
        stranger.close()
