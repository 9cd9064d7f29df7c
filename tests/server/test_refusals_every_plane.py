"""Refusals look alike on every plane (issue 51, item 4): a draining server's 503 carries
Retry-After on the OpenAI and Tinker planes as on PyTRIO's; a full disk (or less free than the
reserve) is 507 `disk_full` on the OpenAI routes as elsewhere, never a 500; new sessions and runs
are refused while draining and below the reserve like other writes, leaving no row; and no answer
names a server path (`base_model` is the model's name)."""

from __future__ import annotations

import json

import httpx
import pytest
from serverutil import RawClient, serve

from trine.diskspace import DiskFull

MODEL = "tiny-llama"


@pytest.fixture(scope="module")
def server(tiny_model_dir, tmp_path_factory):
    with serve(tiny_model_dir, tmp_path_factory.mktemp("home")) as srv:
        yield srv


@pytest.fixture
def draining(server):
    gate = server.service.gate
    gate.drain(20)
    yield server
    gate.draining = False


@pytest.fixture
def below_reserve(server):
    gate = server.service.gate
    old = gate.reserve_bytes
    gate.reserve_bytes = 1 << 62  # more than any disk has free
    yield server
    gate.reserve_bytes = old


def openai_chat(srv) -> httpx.Response:
    return httpx.post(
        f"{srv.url}/v1/chat/completions",
        json={"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2},
        headers={"Authorization": f"Bearer {srv.api_key}"},
        timeout=60,
    )


def tinker_session(srv) -> httpx.Response:
    return httpx.post(
        f"{srv.url}/api/v1/create_session",
        json={"sdk_version": "0.38.0", "tags": [], "user_metadata": {}},
        headers={"X-API-Key": "tml-" + srv.api_key},
        timeout=60,
    )


def pytrio_session(srv) -> httpx.Response:
    return RawClient(srv.url, srv.api_key).control("POST", "service-sessions", json={"sdk_version": "t"})


def sessions(srv) -> int:
    key = srv.service.authenticate(srv.api_key)
    return srv.service.store.sessions(key.id, limit=None)[1]


def assert_no_server_path(srv, text: str) -> None:
    for path in (srv.service.store.home, *(m.dir for m in srv.service.models.values())):
        assert str(path) not in text and str(path.resolve()) not in text, text


def test_a_draining_server_says_when_to_come_back_on_every_plane(draining):
    srv = draining
    before = sessions(srv)
    oai = openai_chat(srv)
    assert oai.status_code == 503 and oai.json()["error"]["code"] == "server_shutting_down", oai.text
    assert int(oai.headers["retry-after"]) > 0
    for r in (tinker_session(srv), pytrio_session(srv)):  # new sessions are refused like other writes
        assert r.status_code == 503 and r.json()["code"] == "server_shutting_down", r.text
        assert int(r.headers["retry-after"]) > 0
    assert sessions(srv) == before  # a refused one leaves no row


def test_new_runs_are_refused_while_draining(server):
    client = RawClient(server.url, server.api_key)
    session = client.session()
    server.service.gate.drain(20)
    try:
        body = {"base_model": MODEL, "lora_rank": 4, "train_mlp": True, "train_attn": True}
        body.update(train_unembed=True, source_checkpoint_uri="", restore_optimizer=False)
        r = client.control("POST", f"service-sessions/{session}/training-runs", json=body)
        assert r.status_code == 503 and "retry-after" in r.headers, r.text
        sampler = {"base_model": MODEL, "source_checkpoint_uri": ""}
        r = client.control("POST", f"service-sessions/{session}/sampling-runs", json=sampler)
        assert r.status_code == 503 and "retry-after" in r.headers, r.text
    finally:
        server.service.gate.draining = False


def test_below_the_disk_reserve_every_plane_answers_507(below_reserve):
    srv = below_reserve
    before = sessions(srv)
    oai = openai_chat(srv)
    assert oai.status_code == 507, oai.text
    assert oai.json()["error"]["code"] == "disk_full" and "internal" not in oai.text, oai.text
    assert_no_server_path(srv, oai.text)
    for r in (tinker_session(srv), pytrio_session(srv)):
        assert r.status_code == 507 and r.json()["code"] == "disk_full", r.text
        assert_no_server_path(srv, r.text)
        assert "data dir" in r.json()["message"], r.text  # where, by name
    assert sessions(srv) == before


def test_a_full_disk_during_an_openai_request_is_507_not_500(server, monkeypatch):
    sampling = server.service.sampling

    async def full(*args, **kw):
        raise DiskFull(server.service.store.path, "database write", free=0)

    monkeypatch.setattr(sampling.records, "finished", full)
    r = openai_chat(server)
    assert r.status_code == 507 and r.json()["error"]["code"] == "disk_full", r.text
    assert_no_server_path(server, r.text)


def test_base_model_is_the_models_name_on_every_plane(server):
    client = RawClient(server.url, server.api_key)
    session = client.session()
    run = client.training_run(session, MODEL)
    assert run["base_model"] == MODEL and run["model_alias"] == MODEL, run
    rid = run["training_run_cuid"]
    got = client.control("GET", f"training-runs/{rid}").json()
    assert got["base_model"] == MODEL, got
    srun = client.sampling_run(session, MODEL)
    assert srun["base_model"] == MODEL, srun
    got = client.control("GET", f"sampling-runs/{srun['sampling_run_cuid']}").json()
    assert got["base_model"] == MODEL, got
    # the one path on purpose: model_id, the official client's local tokenizer id (protocol section 9)
    for body in (run, got):
        text = json.dumps({k: v for k, v in body.items() if k != "model_id"})
        assert_no_server_path(server, text)
    pytrio_key = {"X-API-Key": server.api_key}
    tinker_key = {"X-API-Key": "tml-" + server.api_key}
    for path, headers in (
        ("/console/api/server", pytrio_key),
        ("/v1/models", {"Authorization": f"Bearer {server.api_key}"}),
        ("/api/v1/get_server_capabilities", tinker_key),
    ):
        r = httpx.get(server.url + path, headers=headers)
        assert r.status_code == 200, (path, r.text)
        assert_no_server_path(server, r.text)
