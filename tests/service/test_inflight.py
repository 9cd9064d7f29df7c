"""Inflight samplers end to end: the official `tinker` client's `kind="inflight"`, the trine SDK's
inflight sampling client, and each token's weights version, on a real server with a tiny model."""

from __future__ import annotations

import time

import httpx
import numpy as np
import pytest
from serverutil import serve, tinker_env

import trine as trio

tinker = pytest.importorskip("tinker")
from tinker import types  # noqa: E402
from tinker.proto import tinker_public_pb2 as pb  # noqa: E402

MODEL = "tiny-llama"
TEXT = [1, 504, 3330, 314, 253, 1345, 28, 357, 314, 253, 1345, 30, 2]
WEIGHTS_VERSIONS_FIELD = 1000  # trine's extension field of SampledSequence


@pytest.fixture(scope="module")
def srv(tiny_model_dir, tmp_path_factory):
    home = tmp_path_factory.mktemp("home")
    with tinker_env(TRINE_HOME=str(home)), serve(tiny_model_dir, home) as handle:
        yield handle


@pytest.fixture(scope="module")
def sc(srv):
    c = tinker.ServiceClient(base_url=srv.url, api_key="tml-" + srv.api_key)
    yield c
    c.close("success").result()


def sft(tc, steps: int) -> None:
    d = types.Datum(
        model_input=types.ModelInput.from_ints(TEXT[:-1]),
        loss_fn_inputs={"target_tokens": TEXT[1:], "weights": [1.0] * (len(TEXT) - 1)},
    )
    for _ in range(steps):
        tc.forward_backward([d], "cross_entropy")
        tc.optim_step(types.AdamParams(learning_rate=2e-2))


GREEDY = types.SamplingParams(max_tokens=8, temperature=0.0)


def greedy(sampler) -> list[int]:
    return list(sampler.sample(types.ModelInput.from_ints(TEXT[:4]), 1, GREEDY).result().sequences[0].tokens)


def raw_versions(srv, session_id: str, seq: int) -> list[list[int]]:
    """Sample through the raw Tinker routes; each sequence's weights versions (trine's extension)."""
    headers = {"X-API-Key": "tml-" + srv.api_key}
    r = httpx.post(
        f"{srv.url}/api/v1/asample",
        headers=headers,
        json={
            "sampling_session_id": session_id,
            "seq_id": seq,
            "num_samples": 2,
            "prompt": {"chunks": [{"type": "encoded_text", "tokens": TEXT[:4]}]},
            "sampling_params": {"max_tokens": 5, "temperature": 0.0},
        },
    )
    assert r.status_code == 200, r.text
    for _ in range(100):
        res = httpx.post(
            f"{srv.url}/api/v1/retrieve_future",
            json={"request_id": r.json()["request_id"]},
            headers=headers,
            timeout=60,
        )
        if res.status_code == 200:
            break
        time.sleep(0.1)
    msg = pb.SampleResponse()
    msg.ParseFromString(res.content)
    from google.protobuf import unknown_fields

    out = []
    for s in msg.sequences:
        fields = [f for f in unknown_fields.UnknownFieldSet(s) if f.field_number == WEIGHTS_VERSIONS_FIELD]
        out.append(np.frombuffer(fields[0].data, dtype=np.int32).tolist() if fields else None)
    return out


def test_an_inflight_client_follows_a_later_inflight_save_and_a_snapshot_does_not(srv, sc):
    tc = sc.create_lora_training_client(base_model=MODEL, rank=8, seed=11).result()
    inflight = tc.save_weights_and_get_sampling_client(kind="inflight").result()
    snapshot = tc.save_weights_and_get_sampling_client().result()
    before = greedy(inflight)
    assert greedy(snapshot) == before
    sft(tc, 8)
    assert greedy(inflight) == before  # no inflight save yet: the target has not moved
    later = tc.save_weights_and_get_sampling_client(kind="inflight").result()
    trained = greedy(tc.save_weights_and_get_sampling_client().result())  # the post-training output
    assert trained != before
    assert greedy(inflight) == trained == greedy(later)
    assert greedy(snapshot) == before
    # trine's extension: each token's version, in a field the official client ignores
    assert raw_versions(srv, inflight._sampling_session_id, 900) == [[2] * 5] * 2
    assert raw_versions(srv, snapshot._sampling_session_id, 900) == [None, None]


def test_tinker_kind_is_checked(srv, sc):
    tc = sc.create_lora_training_client(base_model=MODEL, rank=4).result()
    r = httpx.post(
        f"{srv.url}/api/v1/save_weights_for_sampler",
        headers={"X-API-Key": "tml-" + srv.api_key},
        json={
            "model_id": tc.get_info().model_id,
            "seq_id": 1,
            "sampling_session_seq_id": 0,
            "kind": "sometimes",
        },
    )
    fut = httpx.post(
        f"{srv.url}/api/v1/retrieve_future",
        headers={"X-API-Key": "tml-" + srv.api_key},
        json={"request_id": r.json()["request_id"]},
        timeout=60,
    )
    assert "kind 'sometimes'" in fut.text and "inflight" in fut.text


@pytest.fixture(scope="module")
def service(srv):
    with trio.ServiceClient(api_key=srv.api_key, base_url=srv.url) as svc:
        yield svc


def sdk_sft(trainer, tokenizer, steps: int) -> None:
    ids = tokenizer.encode("Inflight samplers follow the run.", add_special_tokens=False)
    d = trio.Datum(model_input=trio.ModelInput.from_ints(ids[:-1]), loss_fn_inputs={"target_tokens": ids[1:]})
    for _ in range(steps):
        trainer.forward_backward([d])
        trainer.optim_step(trio.AdamParams(learning_rate=2e-2))


def test_the_sdk_inflight_client_follows_saves_and_reports_each_tokens_version(service):
    trainer = service.create_lora_training_client(MODEL, rank=8, seed=12)
    tokenizer = trainer.get_tokenizer()
    prompt = trio.ModelInput.from_ints(tokenizer.encode("Inflight", add_special_tokens=False))
    params = trio.SamplingParams(max_tokens=6, temperature=0.0)
    inflight = trainer.inflight_sampling_client()
    snapshot = trainer.save_weights_and_get_sampling_client()
    first = inflight.sample(prompt, sampling_params=params).result().sequences[0]
    assert first.weights_versions == [1] * 6
    fixed = snapshot.sample(prompt, sampling_params=params).result().sequences[0]
    assert fixed.weights_versions is None and fixed.tokens == first.tokens
    sdk_sft(trainer, tokenizer, 6)
    newer = trainer.inflight_sampling_client()
    after = inflight.sample(prompt, sampling_params=params).result().sequences[0]
    assert after.weights_versions == [2] * 6 and after.tokens != first.tokens
    assert newer.sample(prompt, sampling_params=params).result().sequences[0].tokens == after.tokens
    assert snapshot.sample(prompt, sampling_params=params).result().sequences[0].tokens == first.tokens


def test_a_save_during_a_generation_moves_its_remaining_tokens_to_the_new_version(service):
    trainer = service.create_lora_training_client(MODEL, rank=8, seed=13)
    tokenizer = trainer.get_tokenizer()
    inflight = trainer.inflight_sampling_client()
    prompt = trio.ModelInput.from_ints(tokenizer.encode("A long generation", add_special_tokens=False))
    for max_tokens in (400, 1500, 3000):  # until the save lands while the sample is decoding
        params = trio.SamplingParams(max_tokens=max_tokens, temperature=1.0, seed=1, stop=[])
        pending = inflight.sample(prompt, sampling_params=params)
        time.sleep(0.3)
        trainer.inflight_sampling_client()
        versions = pending.result().sequences[0].weights_versions
        assert len(versions) == max_tokens and versions == sorted(versions)
        if versions[0] < versions[-1]:
            break
    else:
        pytest.fail("the inflight save never landed while a sample was decoding")
    assert versions[-1] == versions[0] + 1
