"""Bad input that used to get a 500 (or a half-done write) gets a 4xx before anything is queued;
body limits count the bytes actually read; a 500 keeps the connection; no error names a server
file path; public routes answer nothing per key."""

from __future__ import annotations

import json
import shutil
import socket
from pathlib import Path

import httpx
import msgpack
import pytest
from fastapi import APIRouter
from serverutil import ADAM, RawClient, ce_payload, event, init_payload, serve

MODEL = "tiny-llama"
BIG = 2**64 - 1  # fits MessagePack's uint64, not a 64-bit SQLite integer


boom = APIRouter()


@boom.get("/test/boom")
def _boom():
    raise RuntimeError("/very/secret/server/path exploded")


@pytest.fixture(scope="module")
def server(tiny_model_dir, tmp_path_factory):
    with serve(tiny_model_dir, tmp_path_factory.mktemp("home"), routers=(boom,)) as srv:
        yield srv


def new_run(client: RawClient):
    return client.started_run(MODEL, wait=False)


def assert_4xx(r: httpx.Response, *words: str):
    assert 400 <= r.status_code < 500, (r.status_code, r.text)
    body = r.json()
    assert set(body) >= {"code", "message"}
    for w in words:
        assert w in body["message"], body["message"]


@pytest.mark.parametrize("field, value", [("index", BIG), ("index", 2**63), ("step", BIG), ("step", -1)])
def test_out_of_range_event_metadata_is_refused_and_leaves_no_trace(server, client, field, value):
    run, rid = new_run(client)
    eid = f"event_range{rid[-6:]}"
    ev = event(eid, "forward_backward", 2, ce_payload([5, 6, 7]), rid)
    ev["metadata"][field] = value
    assert_4xx(client.submit(run, ev), f"metadata.{field}")
    assert server.service.store.event(eid) is None
    ok = event(eid, "forward_backward", 2, ce_payload([5, 6, 7]), rid)
    assert client.submit(run, ok).status_code in (200, 202)  # the index and the id are still free
    assert client.wait(run, eid)["status"] == "succeeded"


@pytest.mark.parametrize(
    "payload, words",
    [
        ({"name": "w", "ttl_seconds": 10**15}, ["ttl_seconds"]),
        ({"name": "w", "ttl_seconds": 0}, ["ttl_seconds"]),
    ],
)
def test_save_ttl_is_range_checked_and_listing_keeps_working(client, payload, words):
    run, rid = new_run(client)
    err = client.refused(run, event(f"event_save{rid[-8:]}", "save_weights", 2, payload, rid))
    assert all(w in err["message"] for w in words), err
    r = client.control("GET", "checkpoints")
    assert r.status_code == 200


def test_adam_params_must_be_finite_and_sane(client):
    run, rid = new_run(client)
    bad = (("learning_rate", 1e300), ("eps", 2.0), ("eps", 0.0), ("beta1", 1.0), ("weight_decay", -1.0))
    for i, (name, value) in enumerate(bad):
        adam = {"adam_params": {**ADAM["adam_params"], name: value}}
        err = client.refused(run, event(f"event_adam0000000{i}", "optimize_step", 2 + i, adam, rid))
        assert name in err["message"], err
    # eps 0 used to be accepted: a zero gradient then stepped its weight by 0/0, and every later
    # step of the run failed on a NaN loss. The run still trains.
    fb = event("event_adam00000009", "forward_backward", 2 + len(bad), ce_payload([5, 6, 7]))
    assert client.submit(run, fb).is_success
    assert client.wait(run, "event_adam00000009")["status"] == "succeeded"


def test_wire_integers_and_floats_are_range_checked(client):
    run, rid = new_run(client)
    bad_tokens = ce_payload([5, 6, 7])
    bad_tokens["data"][0]["target_ids"] = [6, 7, BIG]
    err = client.refused(run, event(f"event_tok{rid[-9:]}", "forward_backward", 2, bad_tokens, rid))
    assert "target_ids" in err["message"]
    lora = init_payload(run["model_id"])
    lora["lora_config"]["seed"] = BIG
    run2 = client.training_run(client.session(), MODEL)
    assert "seed" in client.refused(run2, event("event_seed00000001", "init_run", 1, lora))["message"]
    srun = client.sampling_run(client.session(), MODEL)
    base = {
        "request_id": "r1",
        "prompt": {"chunks": [{"type": "encoded_text", "tokens": [1, 2, 3]}]},
        "num_samples": 1,
    }
    for params, word in (
        ({"max_tokens": BIG}, "max_tokens"),
        ({"max_tokens": 2, "seed": BIG}, "seed"),
        ({"max_tokens": 2, "stop_token_ids": [BIG]}, "stop_token_ids"),
        ({"max_tokens": 2, "top_k": BIG}, "top_k"),
        ({"max_tokens": 2, "top_k": 0}, "top_k must be an integer >= 1 (-1: off), got 0"),
        ({"max_tokens": 2, "stop": ["x"] * 100_000}, "stop strings"),
        ({"max_tokens": 2, "stop": ["ok", ""]}, "sampling_params.stop: stop strings must be non-empty"),
    ):
        assert_4xx(client.sample(srun, {**base, "sampling_params": params}), word)
    body = json.dumps({**base, "sampling_params": {"max_tokens": 2, "temperature": float("inf")}})
    r = client.http.post(
        f"{srun['actor']['endpoint']}/v1/sampling-runs/{srun['sampling_run_cuid']}/sample",
        content=body,
        headers={"Authorization": f"Bearer {srun['actor_jwt']['token']}"},
    )
    assert_4xx(r, "temperature")
    tiny = client.sample(srun, {**base, "sampling_params": {"max_tokens": 3, "temperature": 1e-300}})
    greedy = client.sample(
        srun, {**base, "request_id": "r2", "sampling_params": {"max_tokens": 3, "temperature": 0.0}}
    )
    assert tiny.json()["sequences"][0]["tokens"] == greedy.json()["sequences"][0]["tokens"]


def test_control_plane_integers_are_range_checked(client):
    for path in ("checkpoints", "training-runs", "service-sessions"):
        assert_4xx(client.control("GET", f"{path}?offset={BIG}"), "offset")
        assert client.control("GET", f"{path}?offset={2**63 - 1}").status_code == 200
    session = client.session()
    for field, value in (("seed", BIG), ("lora_rank", BIG), ("seed", -1)):
        r = client.control(
            "POST",
            f"service-sessions/{session}/training-runs",
            json={"base_model": MODEL, "lora_rank": 4, field: value},
        )
        assert_4xx(r, field)


def test_deeply_nested_json_gets_400(client):
    nested = ("[" * 100_000 + "]" * 100_000).encode()
    session = client.session()
    r = client.control(
        "POST",
        f"service-sessions/{session}/close",
        content=b'{"status": ' + nested + b"}",
        headers={"Content-Type": "application/json"},
    )
    assert_4xx(r)
    r = client.control(
        "POST",
        "service-sessions",
        content=b'{"user_metadata": ' + nested + b"}",
        headers={"Content-Type": "application/json"},
    )
    assert_4xx(r)
    srun = client.sampling_run(client.session(), MODEL)
    r = client.http.post(
        f"{srun['actor']['endpoint']}/v1/sampling-runs/{srun['sampling_run_cuid']}/sample",
        content=nested,
        headers={"Authorization": f"Bearer {srun['actor_jwt']['token']}"},
    )
    assert_4xx(r)
    run, rid = new_run(client)
    deep = msgpack.packb({"a": 1})
    for _ in range(5000):
        deep = b"\x91" + deep  # a one-element array around it
    assert_4xx(client.submit(run, deep))


def test_chunked_control_bodies_obey_the_limit(server, client):
    before = server.service.store.sessions(server.service.store.key_by_secret(server.api_key).id, 1000, 0)[1]

    def chunks():
        yield b'{"sdk_version": "'
        for _ in range(3):
            yield b"x" * (1 << 20)
        yield b'"}'

    r = client.control(
        "POST", "service-sessions", content=chunks(), headers={"Content-Type": "application/json"}
    )
    assert r.status_code == 413 and r.json()["code"] == "request_too_large"
    after = server.service.store.sessions(server.service.store.key_by_secret(server.api_key).id, 1000, 0)[1]
    assert after == before
    assert client.control("GET", "checkpoints").status_code == 200  # the server keeps serving


def _raw_requests(url: str, paths: list[str]) -> list[bytes]:
    """Send the requests one after another on ONE connection; return each raw response."""
    host, port = url.removeprefix("http://").split(":")
    out = []
    with socket.create_connection((host, int(port)), timeout=10) as sock:
        f = sock.makefile("rb")
        for path in paths:
            sock.sendall(f"GET {path} HTTP/1.1\r\nHost: x\r\n\r\n".encode())
            status = f.readline()
            length = 0
            while (line := f.readline()) not in (b"\r\n", b""):
                if line.lower().startswith(b"content-length:"):
                    length = int(line.split(b":")[1])
            out.append(status + f.read(length))
    return out


def test_a_500_keeps_the_connection_and_names_no_path(server):
    first, second, third = _raw_requests(server.url, ["/test/boom", "/", "/test/boom"])
    assert first.startswith(b"HTTP/1.1 500") and b"internal_error" in first
    assert b"/very/secret" not in first
    assert second.startswith(b"HTTP/1.1 200") and third.startswith(b"HTTP/1.1 500")


def test_checkpoint_errors_name_the_uri_not_the_file(server, client):
    run, rid = new_run(client)
    assert (
        client.submit(run, event("event_ckpt00000001", "save_state", 2, {"name": "gone"}, rid)).status_code
        < 300
    )
    uri = client.wait(run, "event_ckpt00000001")["result"]["checkpoint"]["uri"]
    path = Path(server.service.store.checkpoint_by_uri(uri).path)
    shutil.rmtree(path)  # the files vanished behind the server's back
    path.mkdir()
    restored = client.training_run(client.session(), MODEL)
    init = init_payload(restored["model_id"])
    init["checkpoint_uri"] = uri
    assert client.submit(restored, event("event_ckpt00000002", "init_run", 1, init)).status_code < 300
    failed = client.wait(restored, "event_ckpt00000002")
    assert failed["status"] == "failed" and uri in failed["error"]["message"], failed
    assert str(server.home) not in failed["error"]["message"]


def test_public_routes_answer_nothing_per_key(server):
    with httpx.Client(base_url=server.url, trust_env=False) as anon:
        root = anon.get("/").json()
        assert set(root) == {"service", "models", "console"}
        assert anon.get("/api/sdk/bootstrap").status_code == 200
        assert anon.post("/api/telemetry/event", json={"x": 1}).status_code == 204
        for path in (
            "/api/openapi/v1/checkpoints",
            "/api/openapi/v1/training-runs",
            "/api/trine/v1/usage",
            "/api/models",
        ):
            assert anon.get(path).status_code == 401


def _routes(routes, prefix=""):
    """(path, methods, param names) of every endpoint, through included routers at any depth."""
    from starlette.routing import Route

    for r in routes:
        inner = getattr(r, "original_router", None)  # fastapi's included router
        if inner is not None:
            yield from _routes(inner.routes, prefix + (r.include_context.prefix or ""))
        elif isinstance(r, Route):
            yield prefix + r.path, set(r.methods or ()) - {"HEAD"}, list(r.param_convertors)


def test_every_route_but_the_listed_public_ones_needs_a_key(server):
    """Walk every route the app serves: without a key, only the public ones (docs/serving.md,
    "Security") answer anything but 401 — and they return nothing of any key's."""
    app = server._server.config.app
    seen = {}
    with httpx.Client(base_url=server.url, trust_env=False) as anon:
        for path, methods, params in _routes(app.routes):
            url = path
            for name in params:
                url = url.replace("{" + name + ":path}", "x").replace("{" + name + "}", "x")
            for method in sorted(methods):
                r = anon.request(method, url, content=b"{}", headers={"content-type": "application/json"})
                seen[(method, path)] = r.status_code
    assert len(seen) > 60  # the walk reached the included routers
    public = sorted(
        (m, p, st)
        for (m, p), st in seen.items()
        if st != 401
        and not p.startswith("/test/")  # /test/: this module's own router
        and not (p.endswith("{path:path}") and st == 404)
    )  # OpenAI's unknown-route answer
    assert public == PUBLIC, "\n".join(map(str, public))


# The public routes (no key; nothing per key). The console's pages are a static shell; its data
# routes need the key like every other, and so does every Tinker route (the SDK always sends it).
PUBLIC = sorted(
    [
        ("GET", "/", 200),
        ("GET", "/api/sdk/bootstrap", 200),
        ("GET", "/health", 200),  # status and free disk space, for orchestrators
        ("GET", "/metrics", 200),
        ("POST", "/api/telemetry/event", 204),
        ("GET", "/console", 200),
        ("GET", "/console/{page:path}", 200),
        ("GET", "/console/static/{name}", 404),  # the shipped assets (no asset is named "x")
    ]
)


def test_openai_errors_before_the_routes_keep_openais_shape(server):
    """The body limit, unknown methods and content encodings answer on /v1 as the OpenAI routes do:
    {"error": {"message", "type", "param", "code"}}; elsewhere trine's {"code", "message"}."""
    url = server.url
    with httpx.Client(
        trust_env=False, timeout=60, headers={"Authorization": f"Bearer {server.api_key}"}
    ) as c:
        big = _raw(
            server, b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 1099511627776\r\n\r\n"
        )
        assert big.startswith("HTTP/1.1 413") and '{"error": {"message": "body: ' in big, big
        options = c.request("OPTIONS", url + "/v1/chat/completions")
        assert options.status_code == 405 and options.json()["error"]["code"] == "method_not_allowed"
        get = c.get(url + "/v1/chat/completions")
        assert get.status_code == 405 and get.headers["allow"] == "POST", get.text
        assert "takes POST" in get.json()["error"]["message"]
        assert c.head(url + "/v1/models").status_code == 200
        zipped = c.post(url + "/v1/completions", headers={"content-encoding": "gzip"}, content=b"\x1f\x8b")
        assert zipped.status_code == 415 and "Content-Encoding 'gzip'" in zipped.json()["error"]["message"]
        pytrio = c.post(url + "/api/v1/sample", headers={"content-encoding": "gzip"}, content=b"\x1f\x8b")
        assert pytrio.status_code == 415 and pytrio.json()["code"] == "unsupported_content_encoding"


def _raw(server, request: bytes) -> str:
    """What the server first answers to these bytes on a fresh connection."""
    host, port = server.url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=10) as s:
        s.sendall(request)
        answer = b""
        while b"\r\n\r\n" not in answer or len(answer.split(b"\r\n\r\n", 1)[1]) < _length(answer):
            chunk = s.recv(4096)
            if not chunk:
                break
            answer += chunk
        return answer.decode()


def _length(answer: bytes) -> int:
    """The Content-Length an answer's headers declare."""
    for line in answer.split(b"\r\n\r\n", 1)[0].split(b"\r\n"):
        if line.lower().startswith(b"content-length:"):
            return int(line.split(b":", 1)[1])
    return 0


def test_a_body_that_stalls_gets_a_408(server, monkeypatch):
    from trine.server.http import middleware

    monkeypatch.setattr(middleware, "BODY_IDLE_SECONDS", 0.5)
    answer = _raw(
        server,
        b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nAuthorization: "
        b"Bearer " + server.api_key.encode() + b'\r\nContent-Length: 100\r\n\r\n{"model"',
    )
    assert answer.startswith("HTTP/1.1 408") and "request_timeout" in answer


@pytest.mark.parametrize(
    "body, param",
    [
        ({"model": MODEL, "prompt": "\ud800", "max_tokens": 2}, "prompt"),
        ({"model": MODEL, "prompt": ["ok", "a\udfffb"], "max_tokens": 2}, "prompt[1]"),
        ({"model": MODEL, "messages": [{"role": "user", "content": [{"type": "text", "text": "\ud800"}]}]},
         "messages[0].content[0].text"),
    ],
)  # fmt: skip
def test_text_with_a_lone_surrogate_is_refused_naming_where(server, body, param):
    route = "/v1/chat/completions" if "messages" in body else "/v1/completions"
    raw = json.dumps(body).encode()  # ensure_ascii: the surrogate goes as a \\udxxx escape
    r = httpx.post(
        server.url + route,
        content=raw,
        headers={"Authorization": f"Bearer {server.api_key}", "content-type": "application/json"},
        trust_env=False,
        timeout=60,
    )
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param and "surrogate" in r.json()["error"]["message"]


@pytest.mark.parametrize("key", ["\u00b2", "\uff11", "\u0663"])  # superscript 2, full-width 1, Arabic 3
def test_logit_bias_keys_must_be_ascii_token_ids(server, key):
    r = httpx.post(
        server.url + "/v1/completions",
        json={"model": MODEL, "prompt": "hi", "max_tokens": 2, "logit_bias": {key: 1}},
        headers={"Authorization": f"Bearer {server.api_key}"},
        trust_env=False,
        timeout=60,
    )
    assert r.status_code == 400 and r.json()["error"]["param"] == "logit_bias", r.text


def test_max_completion_tokens_is_named_as_sent(server):
    r = httpx.post(
        server.url + "/v1/chat/completions",
        json={
            "model": MODEL,
            "messages": [{"role": "user", "content": "hi"}],
            "max_completion_tokens": 2**62,
        },
        headers={"Authorization": f"Bearer {server.api_key}"},
        trust_env=False,
        timeout=60,
    )
    assert r.status_code == 400 and r.json()["error"]["param"] == "max_completion_tokens", r.text


def test_a_sampling_run_without_a_model_names_the_field(client):
    r = client.control("POST", f"service-sessions/{client.session()}/sampling-runs", json={})
    assert r.status_code == 400 and "base_model: required" in r.json()["message"], r.text
