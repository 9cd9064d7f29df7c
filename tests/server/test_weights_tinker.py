"""Full fine-tuning and external weights through Tinker's routes, with the official `tinker` 0.38 client
against a real trine server: `rank=0` trains every weight (as SkyRL's Tinker backend reads it), its
sampler runs its own weights, a run that does not fit the memory budget is refused naming the bytes,
its tokens are priced from the rate card's `:full` row; `save_weights_external` writes the merged model
that `trine export --merged` writes, served through `external_weights_urls`."""

from __future__ import annotations

import dataclasses
import urllib.request

import httpx
import numpy as np
import pytest
from serverutil import TEST_ENGINE, serve, tinker_env
from tolerance import assert_served_paths

tinker = pytest.importorskip("tinker")
from tinker import types  # noqa: E402

MODEL = "tiny-llama"
TEXT = [1, 504, 3330, 314, 253, 1345, 28, 357, 314, 253, 1345, 30, 2]
BUDGET = 160 << 20  # one full run of the tiny model (about 110 MB) fits, two do not


@pytest.fixture(scope="module")
def srv(tiny_model_dir, tmp_path_factory):
    engine = dataclasses.replace(TEST_ENGINE, full_ft_memory_bytes=BUDGET)
    with tinker_env(), serve(tiny_model_dir, tmp_path_factory.mktemp("home"), engine=engine) as handle:
        yield handle


@pytest.fixture(scope="module")
def sc(srv):
    c = tinker.ServiceClient(base_url=srv.url, api_key="tml-" + srv.api_key)
    yield c
    c.close("success").result()


def datum(tokens=TEXT):
    return types.Datum(
        model_input=types.ModelInput.from_ints(tokens[:-1]),
        loss_fn_inputs={"target_tokens": tokens[1:], "weights": [1.0] * (len(tokens) - 1)},
    )


def logprobs(out) -> np.ndarray:
    return np.concatenate([o["logprobs"].to_numpy() for o in out.loss_fn_outputs])


def test_rank_0_fine_tunes_every_weight_and_samples_them(srv, sc):
    tc = sc.create_lora_training_client(base_model=MODEL, rank=0).result()
    info = tc.get_info()
    assert info.lora_rank == 0 and info.is_lora is False
    base = (
        sc.create_sampling_client(base_model=MODEL)
        .result()
        .compute_logprobs(types.ModelInput.from_ints(TEXT))
    )
    losses, cycles = [], []
    for _ in range(3):
        fb = tc.forward_backward([datum()], "cross_entropy")  # submitted before waiting: pipelined
        tc.optim_step(types.AdamParams(learning_rate=1e-3))
        losses.append(fb.result().metrics["loss:sum"])
        cycles.append(fb.result().metrics["clock_cycle:unique"])
    assert losses[2] < losses[1] < losses[0]
    assert len(set(cycles)) == 3  # one clock cycle per step, as a LoRA run's
    trained = logprobs(tc.forward([datum()], "cross_entropy").result())
    sampler = tc.save_weights_and_get_sampling_client().result()
    sampled = sampler.compute_logprobs(types.ModelInput.from_ints(TEXT)).result()
    assert_served_paths(sampled[1:], trained)  # the run's own weights, not the base model's
    assert np.abs(np.array(sampled[1:]) - np.array(base.result()[1:])).max() > 0.1

    key = srv.service.store.key_by_secret(srv.api_key)
    events = [e for e in srv.service.store.usage_events(key.id) if e.operation == "forward_backward"]
    assert events and all(e.full_fine_tuning for e in events)
    card = srv.service.rate_card
    e = events[-1]
    assert card.cost(e)["train"] == pytest.approx(e.train * card.price(MODEL, full=True).train / 1e6)
    assert card.price(MODEL, full=True).train > card.price(MODEL).train  # its own row

    # a second full run does not fit the budget: refused at creation, naming the bytes (Tinker's
    # errors keep 409 for a reused seq_id: a 400 here, insufficient_memory)
    with pytest.raises(tinker.BadRequestError, match=r"insufficient_memory.*needs \d+ bytes.*\d+ of the"):
        sc.create_lora_training_client(base_model=MODEL, rank=0).result()
    sc.create_lora_training_client(base_model=MODEL, rank=4).result()  # LoRA runs still start


def test_save_weights_external_serves_what_trine_export_merged_writes(srv, sc, tmp_path):
    from trine.engine.trainer.export import export_merged

    tc = sc.create_lora_training_client(base_model=MODEL, rank=4, seed=5).result()
    tc.forward_backward([datum()], "cross_entropy")
    tc.optim_step(types.AdamParams(learning_rate=2e-2)).result()
    sampler_path = tc.save_weights_for_sampler("adapter").result().path
    external = tc.save_weights_external("hf", ttl_seconds=3600).result().path
    assert external == sampler_path.replace("/sampler_weights/adapter", "/external_weights/hf")
    with pytest.raises(Exception) as again:  # the name is taken: the client's own path, a fix it can make
        tc.save_weights_external("hf").result()
    said = str(again.value)
    assert external in said and "pick another name" in said
    assert "overwrite" not in said and "trio://" not in said
    rest = tinker.RestClient(base_url=srv.url, api_key="tml-" + srv.api_key)
    listed = rest.list_checkpoints(external.split("/")[2]).result().checkpoints
    assert {c.checkpoint_type for c in listed if c.tinker_path == external} == {"external"}

    got = rest.get_external_weights_urls(external).result()
    assert {"config.json", "model.safetensors", "tokenizer.json"} <= set(got.urls)
    out = tmp_path / "downloaded"
    out.mkdir()
    for name, url in got.urls.items():
        with urllib.request.urlopen(url) as f:
            (out / name).write_bytes(f.read())

    from trine.uris import to_trio_uri

    adapter = srv.service.store.checkpoint_by_uri(to_trio_uri(sampler_path))
    export_merged(adapter.path, tmp_path / "exported", srv.service.models[MODEL].dir)
    # kind 1: the same adapter merged by the same code, bit for bit (test_export.py: its logits)
    for f in ("model.safetensors", "config.json", "tokenizer.json"):
        assert (out / f).read_bytes() == (tmp_path / "exported" / f).read_bytes(), f
    from transformers import AutoModelForCausalLM

    AutoModelForCausalLM.from_pretrained(out)  # loads as any Hugging Face checkpoint
    rest.delete_checkpoint_from_tinker_path(external).result()
    with pytest.raises(tinker.NotFoundError):
        rest.get_external_weights_urls(external).result()


def test_the_pytrio_plane_refuses_rank_0_naming_why(srv):
    headers = {"X-API-Key": srv.api_key}
    s = httpx.post(f"{srv.url}/api/openapi/v1/service-sessions", json={}, headers=headers).json()
    r = httpx.post(
        f"{srv.url}/api/openapi/v1/service-sessions/{s['service_session_cuid']}/training-runs",
        json={"base_model": MODEL, "lora_rank": 0},
        headers=headers,
    )
    assert r.status_code == 400
    assert "its client bounds rank to 4..64" in r.json()["message"] and "full=True" in r.json()["message"]


def test_a_lora_run_that_adapts_nothing_is_refused_at_creation_on_both_planes(srv, sc):
    """train_attn, train_mlp and train_unembed all false: a LoRA run has nothing to adapt, a 400
    naming the fields when it is created (not an accepted run whose init fails later)."""
    headers = {"X-API-Key": srv.api_key}
    off = {"train_attn": False, "train_mlp": False, "train_unembed": False}
    s = httpx.post(f"{srv.url}/api/openapi/v1/service-sessions", json={}, headers=headers).json()
    r = httpx.post(
        f"{srv.url}/api/openapi/v1/service-sessions/{s['service_session_cuid']}/training-runs",
        json={"base_model": MODEL, "lora_rank": 4, **off},
        headers=headers,
    )
    assert (
        r.status_code == 400
        and "train_attn, train_mlp and train_unembed are all false" in r.json()["message"]
    )
    tinker_headers = {"X-API-Key": "tml-" + srv.api_key}
    session = httpx.post(
        f"{srv.url}/api/v1/create_session", json={"tags": [], "sdk_version": "0.38.0"}, headers=tinker_headers
    ).json()["session_id"]
    r = httpx.post(
        f"{srv.url}/api/v1/create_model",
        json={
            "session_id": session,
            "model_seq_id": 0,
            "base_model": MODEL,
            "lora_config": {"rank": 4, **off},
        },
        headers=tinker_headers,
    )
    assert r.status_code == 400 and "are all false" in r.json()["message"], r.text
