"""Checkpoints the Tinker way, with the official `tinker` 0.38 client against a real trine server:
TTL set and cleared (and collected once passed), publish/unpublish (a published checkpoint is
readable by other keys), storage usage, downloads from trine itself through signed URLs, and the
features trine refuses answering 400 with what to use instead.
"""

from __future__ import annotations

import asyncio
import io
import json
import tarfile
import time
import types as pytypes
import urllib.request
from pathlib import Path

import httpx
import pytest
from safetensors.numpy import load as load_safetensors

tinker = pytest.importorskip("tinker")
from tinker import types  # noqa: E402

MODEL = "tiny-llama"
TEXT = [1, 504, 3330, 314, 253, 1345, 28, 357, 314, 253, 1345, 30, 2]


@pytest.fixture(scope="module")
def saved(sc):
    """A trained model's sampler checkpoint and training state."""
    tc = sc.create_lora_training_client(base_model=MODEL, rank=4, seed=11).result()
    tc.forward_backward([datum()], "cross_entropy")
    tc.optim_step(types.AdamParams(learning_rate=2e-2)).result()
    return pytypes.SimpleNamespace(
        tc=tc,
        sampler=tc.save_weights_for_sampler("ckpt").result().path,
        state=tc.save_state("ckpt-state").result().path,
    )


def datum(tokens=TEXT):
    return types.Datum(
        model_input=types.ModelInput.from_ints(tokens[:-1]),
        loss_fn_inputs={"target_tokens": tokens[1:], "weights": [1.0] * (len(tokens) - 1)},
    )


def rest(srv, key=None) -> "tinker.RestClient":
    return tinker.RestClient(base_url=srv.url, api_key="tml-" + (key or srv.api_key))


def listed(srv, path: str, key=None):
    run = path.split("/")[2]
    return next(c for c in rest(srv, key).list_checkpoints(run).result().checkpoints if c.tinker_path == path)


def _trio(path: str) -> str:
    from trine.server.tinker.state import to_trio_uri

    return to_trio_uri(path)


def on_loop(srv, coro):
    return asyncio.run_coroutine_threadsafe(coro, srv.service.loop).result()


def test_ttl_is_set_cleared_and_an_expired_checkpoint_is_collected(srv, sc, monkeypatch):
    from trine.service import gc

    tc = sc.create_lora_training_client(base_model=MODEL, rank=4).result()
    path = tc.save_weights_for_sampler("short-lived").result().path
    keep = tc.save_weights_for_sampler("kept").result().path
    r = rest(srv)
    assert listed(srv, path).expires_at is None
    r.set_checkpoint_ttl_from_tinker_path(path, 3600).result()
    expires = listed(srv, path).expires_at
    assert expires is not None and 3500 < expires.timestamp() - time.time() <= 3600
    r.set_checkpoint_ttl_from_tinker_path(path, None).result()  # cleared: never expires
    assert listed(srv, path).expires_at is None
    r.set_checkpoint_ttl_from_tinker_path(path, 3600).result()
    with pytest.raises(tinker.BadRequestError, match="ttl_seconds"):
        r.set_checkpoint_ttl_from_tinker_path(path, 0).result()
    files = Path(srv.service.store.checkpoint_by_uri(_trio(path)).path)
    assert files.is_dir()
    # two hours later (a fake clock for the collector): the checkpoint and its files are gone
    monkeypatch.setattr(
        gc, "time", pytypes.SimpleNamespace(time=lambda: time.time() + 7200, monotonic=time.monotonic)
    )
    on_loop(srv, srv.service.collect_garbage())
    run = path.split("/")[2]
    paths = {c.tinker_path for c in r.list_checkpoints(run).result().checkpoints}
    assert path not in paths and keep in paths and not files.exists()
    with pytest.raises(Exception, match="not found"):
        sc.create_sampling_client(model_path=path).result().sample(
            types.ModelInput.from_ints(TEXT), 1, types.SamplingParams(max_tokens=1)
        ).result()


def test_publish_makes_a_checkpoint_readable_by_other_keys_until_unpublished(srv, sc, saved):
    _, other_key = srv.service.store.create_key("reader")
    other = tinker.ServiceClient(base_url=srv.url, api_key="tml-" + other_key)
    prompt = types.ModelInput.from_ints(TEXT)
    try:
        with pytest.raises(Exception, match="not found"):
            other.create_sampling_client(model_path=saved.sampler).result().compute_logprobs(prompt).result()
        r = rest(srv)
        r.publish_checkpoint_from_tinker_path(saved.sampler).result()
        assert listed(srv, saved.sampler).public is True
        with pytest.raises(tinker.BadRequestError, match="already public"):
            r.publish_checkpoint_from_tinker_path(saved.sampler).result()
        theirs = (
            other.create_sampling_client(model_path=saved.sampler).result().compute_logprobs(prompt).result()
        )
        ours = sc.create_sampling_client(model_path=saved.sampler).result().compute_logprobs(prompt).result()
        assert theirs == ours  # kind 1: one checkpoint's fp32 weights, whoever reads them
        assert rest(srv, other_key).get_weights_info_by_tinker_path(saved.sampler).result().lora_rank == 4
        openai = pytest.importorskip("openai")  # the OpenAI plane serves it to them too
        done = openai.OpenAI(base_url=srv.url + "/v1", api_key=other_key, max_retries=0).completions.create(
            model=saved.sampler, prompt="hi", max_tokens=2
        )
        assert done.model == saved.sampler and done.usage.completion_tokens == 2
        with pytest.raises(Exception, match="not found"):  # only the owner changes or deletes it
            rest(srv, other_key).delete_checkpoint_from_tinker_path(saved.sampler).result()
        r.publish_checkpoint_from_tinker_path(saved.state).result()  # a published state trains others
        tc = other.create_training_client_from_state(saved.state).result()
        # kind 1: the state holds saved.tc's fp32 weights (it has not stepped since), one datum alone
        assert (
            tc.forward([datum()], "cross_entropy").result().metrics["loss:sum"]
            == saved.tc.forward([datum()], "cross_entropy").result().metrics["loss:sum"]
        )
        r.unpublish_checkpoint_from_tinker_path(saved.sampler).result()
        r.unpublish_checkpoint_from_tinker_path(saved.state).result()
        assert listed(srv, saved.sampler).public is False
        with pytest.raises(tinker.BadRequestError, match="already private"):
            r.unpublish_checkpoint_from_tinker_path(saved.sampler).result()
        with pytest.raises(Exception, match="not found"):
            other.create_sampling_client(model_path=saved.sampler).result().compute_logprobs(prompt).result()
    finally:
        other.close("success").result()


def test_storage_usage_counts_the_keys_checkpoints_on_disk(srv, saved):
    usage = (
        tinker.AdminClient(base_url=srv.url, api_key="tml-" + srv.api_key)
        .get_current_checkpoint_storage_usage()
        .result()
    )
    key = srv.service.store.key_by_secret(srv.api_key)
    on_disk = [c for c in srv.service.store.checkpoints(key.id)[0] if c.path]
    (row,) = usage.data
    assert row.checkpoint_count == len(on_disk) >= 2
    assert row.size_bytes == sum(c.size_bytes for c in on_disk) > 0
    assert row.size_gigabytes == row.size_bytes / 1e9  # kind 1: the server's one division, in fp64
    _, fresh = srv.service.store.create_key("empty")
    assert (
        tinker.AdminClient(base_url=srv.url, api_key="tml-" + fresh)
        .get_current_checkpoint_storage_usage()
        .result()
        .data
        == []
    )


def _archive_route(path: str) -> str:
    run, kind, name = path[len("tinker://") :].split("/")
    return f"/api/v1/training_runs/{run}/checkpoints/{kind}/{name}/archive"


def test_the_archive_url_downloads_the_peft_adapter_from_trine(srv, saved):
    headers = {"X-API-Key": "tml-" + srv.api_key}
    r = httpx.get(srv.url + _archive_route(saved.sampler), headers=headers)
    # what Tinker SDKs read: a 302 whose Location is the signed URL and Expires its expiry
    assert r.status_code == 302 and r.headers["location"] == r.json()["url"]
    assert r.headers["location"].startswith(srv.url + "/api/v1/") and "token=" in r.headers["location"]
    assert r.headers["expires"].endswith("GMT")
    as_json = httpx.get(
        srv.url + _archive_route(saved.sampler), params={"redirect": "false"}, headers=headers
    )
    assert as_json.status_code == 200 and set(as_json.json()) == {"url", "expires"}
    with urllib.request.urlopen(r.headers["location"]) as f:  # no API key: the URL carries its token
        raw = f.read()
    ck = srv.service.store.checkpoint_by_uri(_trio(saved.sampler))
    with tarfile.open(fileobj=io.BytesIO(raw)) as tf:
        names = tf.getnames()
        # the files at the top of the archive, as Tinker's archives hold them
        assert (
            set(names)
            == {p.name for p in Path(ck.path).iterdir()}
            >= {"adapter_config.json", "adapter_model.safetensors"}
        )
        config = json.load(tf.extractfile("adapter_config.json"))
        tensors = load_safetensors(tf.extractfile("adapter_model.safetensors").read())
    assert config["r"] == 4 and any(k.endswith("lora_A.weight") for k in tensors)
    on_disk = load_safetensors((Path(ck.path) / "adapter_model.safetensors").read_bytes())
    assert set(tensors) == set(on_disk) and all((tensors[k] == on_disk[k]).all() for k in on_disk)
    bad = r.headers["location"][:-3] + "xyz"
    assert httpx.get(bad).status_code == 401
    _, other_key = srv.service.store.create_key("stranger")
    stranger = httpx.get(srv.url + _archive_route(saved.sampler), headers={"X-API-Key": "tml-" + other_key})
    assert stranger.status_code == 404 and saved.sampler.split("/")[2] not in stranger.text


def test_per_file_urls_through_the_official_clients_resource(srv, saved):
    async def urls():
        from tinker._client import AsyncTinker

        client = AsyncTinker(base_url=srv.url, api_key="tml-" + srv.api_key)
        run, kind, name = saved.sampler[len("tinker://") :].split("/")
        try:
            return await client.weights.get_external_weights_urls(
                model_id=run, checkpoint_id=f"{kind}/{name}"
            )
        finally:
            await client.close()

    got = asyncio.run(urls())
    ck = Path(srv.service.store.checkpoint_by_uri(_trio(saved.sampler)).path)
    assert set(got.urls) == {p.name for p in ck.iterdir()}
    for name, url in got.urls.items():
        with urllib.request.urlopen(url) as f:
            assert f.read() == (ck / name).read_bytes()
    with pytest.raises(tinker.NotFoundError, match="not found"):  # no external weights of that name
        rest(srv).get_external_weights_urls(
            saved.sampler.replace("/sampler_weights/", "/external_weights/")
        ).result()


def test_refused_features_name_what_to_use_and_keep_the_client_going(srv, sc):
    tc = sc.create_lora_training_client(base_model=MODEL, rank=4).result()
    with pytest.raises(Exception, match="age_encryption_recipients: trine does not encrypt"):
        tc.save_weights_external("hf", age_encryption_recipients=["age1xyz"]).result()
    assert (
        tc.forward_backward([datum()], "cross_entropy").result().metrics["loss:sum"] > 0
    )  # its seq_id was kept
    with pytest.raises(
        Exception, match="sent DimuonParams, but this model was made with the adamw optimizer"
    ):
        tc.optim_step(types.DimuonParams(learning_rate=1e-3)).result()
    tc.optim_step(types.AdamParams(learning_rate=1e-3)).result()
    with pytest.raises(tinker.BadRequestError, match="copy_weights .*not supported.*publish"):
        rest(srv).copy_weights("tinker://x/weights/y", "project").result()
    sampler = tc.save_weights_and_get_sampling_client().result()
    for chunk, words in (
        (types.ImageChunk(data=b"x", format="png", expected_tokens=1), "tiny-llama is a text-only model"),
        (types.DmelChunk(dmel=b"x" * 4), "audio .dmel. chunks are not supported"),
    ):
        prompt = types.ModelInput(chunks=[types.EncodedTextChunk(tokens=TEXT[:3]), chunk])
        with pytest.raises(Exception, match=words):
            sampler.sample(prompt, 1, types.SamplingParams(max_tokens=1)).result()
    from trine.server.tinker.refused import REFUSED

    headers = {"X-API-Key": "tml-" + srv.api_key}
    for method, path, feature, _ in REFUSED:
        r = httpx.request(
            method, srv.url + "/api/v1" + path.replace("{session_id}", "s"), headers=headers, json={}
        )
        assert r.status_code == 400 and r.json()["code"] == "not_supported", (method, path, r.text)
        assert feature in r.json()["message"] and "use " in r.json()["message"]


def test_tinker_errors_name_tinker_paths(srv, sc):
    tc = sc.create_lora_training_client(base_model=MODEL, rank=4).result()
    path = tc.save_state("taken").result().path
    with pytest.raises(Exception) as e:
        tc.save_state("taken").result()
    assert path in str(e.value) and "trio://" not in str(e.value)
    r = httpx.post(
        f"{srv.url}/api/v1/weights_info",
        json={"tinker_path": "tinker://nope/weights/x"},
        headers={"X-API-Key": "tml-" + srv.api_key},
    )
    assert r.status_code == 404 and "tinker://" in r.json()["message"] and "trio://" not in r.text


def test_every_route_the_client_can_call_is_served_or_refused_by_name(srv):
    """Every `/api/v1/...` path in the official client's source answers as a route (a result, a 4xx
    about the request, or a 400 `not_supported`), never the server's bare 404/405 route error."""
    import re

    root = Path(tinker.__file__).parent
    paths = set()
    for f in root.rglob("*.py"):
        if f.name.endswith("_test.py"):
            continue
        paths |= set(re.findall(r'f?"(/api/v1/[^"]+)"', f.read_text()))
    # a checkpoint id is two segments (`weights/<name>`); every other parameter one
    paths = {
        re.sub(r"\{([^}]+)\}", lambda m: "weights/x" if m[1] == "checkpoint_id" else "x", p) for p in paths
    }
    assert len(paths) > 40  # the scan found the client's routes
    headers = {"X-API-Key": "tml-" + srv.api_key}
    missing = []
    with httpx.Client(base_url=srv.url, headers=headers, timeout=60) as http:
        for path in sorted(paths):
            codes = (
                {http.request(m, path, json={}).json().get("code") for m in ("GET", "POST", "PUT", "DELETE")}
                if path != "/api/v1/retrieve_future"
                else {"ok"}
            )
            if codes <= {"not_found", "method_not_allowed"}:
                missing.append(path)
    assert missing == []


# ---------------------------------------------------------------------------- refusals
def test_a_refused_save_takes_its_seq_id_and_the_client_goes_on(sc):
    """A save whose body is refused (ttl_seconds 0) fails alone: its seq_id is taken by a failed
    placeholder, so the client's next call does not wait for it."""
    tc = sc.create_lora_training_client(base_model=MODEL, rank=4, seed=3).result()
    with pytest.raises(Exception, match="ttl_seconds"):
        tc.save_state("short", ttl_seconds=0).result(timeout=60)
    assert tc.forward_backward([datum()], "cross_entropy").result(timeout=60).metrics


def test_load_state_of_another_lora_shape_is_refused_by_name(sc):
    eight = sc.create_lora_training_client(base_model=MODEL, rank=8, seed=1).result()
    path = eight.save_state("rank8").result().path
    four = sc.create_lora_training_client(base_model=MODEL, rank=4, seed=1).result()
    with pytest.raises(Exception, match="lora_rank") as e:
        four.load_state(path).result(timeout=60)
    assert "create_training_client_from_state" in str(e.value)
    assert four.forward_backward([datum()], "cross_entropy").result(timeout=60).metrics


def _post(srv, route: str, body: dict) -> httpx.Response:
    return httpx.post(
        f"{srv.url}/api/v1/{route}", json=body, headers={"X-API-Key": "tml-" + srv.api_key}, trust_env=False
    )


def test_a_sampling_seq_id_reused_for_another_model_is_refused(srv, saved):
    session = _post(srv, "create_session", {}).json()["session_id"]
    first = {"session_id": session, "sampling_session_seq_id": 0, "base_model": MODEL}
    a = _post(srv, "create_sampling_session", first)
    assert a.status_code == 200 and _post(srv, "create_sampling_session", first).json() == a.json()  # a retry
    other = _post(srv, "create_sampling_session", {**first, "base_model": None, "model_path": saved.sampler})
    assert other.is_client_error and "sampling_session_seq_id 0" in other.json()["message"], other.text
    negative = _post(srv, "create_sampling_session", {**first, "sampling_session_seq_id": -1})
    assert negative.status_code == 400 and "sampling_session_seq_id" in negative.json()["message"]


def test_both_path_forms_are_read_on_every_plane(srv, saved):
    trio = _trio(saved.state)
    info = _post(srv, "weights_info", {"tinker_path": trio})  # trine's own form on the Tinker plane
    assert info.status_code == 200, info.text
    by_uri = httpx.get(
        f"{srv.url}/api/openapi/v1/training-runs/by-checkpoint-uri",
        params={"checkpoint_uri": saved.state},  # Tinker's form on the PyTRIO control plane
        headers={"Authorization": f"Bearer {srv.api_key}"},
        trust_env=False,
    )
    assert by_uri.status_code == 200 and by_uri.json()["lora_rank"] == 4, by_uri.text


def test_checkpoint_pages_count_only_what_they_list(srv, sc, saved):
    saved.tc.save_weights_and_get_sampling_client()  # an in-memory snapshot: not a listed checkpoint
    client = rest(srv)
    total = client.list_user_checkpoints(limit=1000).result().cursor.total_count
    pages = [client.list_user_checkpoints(limit=1, offset=i).result() for i in range(total + 1)]
    assert all(len(p.checkpoints) == 1 for p in pages[:total]) and not pages[total].checkpoints
