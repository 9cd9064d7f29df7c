"""Bad input on the Tinker and OpenAI routes answers 4xx naming the field, never a 5xx, and never
echoes another key's ids; a reused Tinker seq_id with another body is a 409.

A real server; bodies are the official clients' (the `tinker` types and their proto encoder, the
`openai` client) mutated by hypothesis: malformed JSON, wrong types, integers and offsets past
int64, absurd tensor shapes and spans, and key A's ids sent by key B.
"""

from __future__ import annotations

import copy
import itertools
import json

import httpx
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from serverutil import serve, tinker_env

from trine.limits import MAX_SAMPLES_PER_REQUEST, MAX_TOPK_PROMPT_LOGPROBS

tinker = pytest.importorskip("tinker")
from tinker import types  # noqa: E402
from tinker.proto.request_conv import forward_backward_request_to_proto  # noqa: E402

MODEL = "tiny-llama"
TEXT = [1, 504, 3330, 314, 253, 1345, 28, 357, 314, 253, 1345, 30, 2]
BIG = 2**63
FUZZ = settings(
    max_examples=60, deadline=None, suppress_health_check=list(HealthCheck), derandomize=True, database=None
)


@pytest.fixture(scope="module")
def srv(tiny_model_dir, tmp_path_factory):
    with tinker_env(), serve(tiny_model_dir, tmp_path_factory.mktemp("home")) as handle:
        yield handle


class Plane:
    """Key A's objects (made with the official client) and raw HTTP clients for keys A and B."""

    def __init__(self, srv):
        self.sc = tinker.ServiceClient(base_url=srv.url, api_key="tml-" + srv.api_key)
        self.tc = self.sc.create_lora_training_client(base_model=MODEL, rank=4).result()
        self.model_id = self.tc.get_info().model_id
        self.session_id = self.model_id.split(":")[0]
        self.path = self.tc.save_weights_for_sampler("fuzz").result().path
        self.run_id = self.path.split("/")[2]
        self.http = {
            k: httpx.Client(base_url=srv.url + "/api/v1", timeout=60, headers={"X-API-Key": "tml-" + s})
            for k, s in (("a", srv.api_key), ("b", srv.service.store.create_key("b")[1]))
        }
        self.sampler_id = (
            self.http["a"]
            .post(
                "/create_sampling_session",
                json={
                    "session_id": self.session_id,
                    "sampling_session_seq_id": 999,
                    "model_path": self.path,
                },
            )
            .json()["sampling_session_id"]
        )
        self.seq = itertools.count(10_000)  # seq_ids no call of the model will reach
        self.next_seq = 2  # the model's next call: create_model was its seq 0, the save seq 1

    def ids(self) -> list[str]:
        return [self.model_id, self.session_id, self.run_id, self.sampler_id, self.path]

    def close(self):
        for c in self.http.values():
            c.close()
        self.sc.close("success").result()


@pytest.fixture(scope="module")
def plane(srv):
    p = Plane(srv)
    yield p
    p.close()


@pytest.fixture(scope="module")
def fb_plane(srv):
    """A model of its own whose seq_ids the protobuf fuzzer advances one accepted call at a time."""
    p = Plane(srv)
    yield p
    p.close()


def json_routes(p: Plane) -> list[tuple[str, str, dict]]:
    """(method, path, a valid body) for every Tinker JSON route that takes a body."""
    ck = "/training_runs/{run}/checkpoints/sampler_weights/fuzz".format(run=p.run_id)
    model = {"model_id": p.model_id}
    return [
        ("POST", "/create_session", {"sdk_version": "0.38.0", "tags": [], "user_metadata": {}}),
        ("POST", "/session_heartbeat", {"session_id": p.session_id}),
        (
            "POST",
            "/create_model",
            {
                "session_id": p.session_id,
                "model_seq_id": 10_000,
                "base_model": MODEL,
                "lora_config": {"rank": 4, "seed": 1, "train_unembed": True},
                "optimizer_config": {"type": "adamw"},
            },
        ),
        ("POST", "/get_info", model),
        ("POST", "/optim_step", {**model, "seq_id": 1, "adam_params": {"learning_rate": 1e-3, "beta1": 0.9}}),
        ("POST", "/save_weights", {**model, "seq_id": 1, "path": "x", "ttl_seconds": 3600}),
        ("POST", "/save_weights_for_sampler", {**model, "seq_id": 1, "sampling_session_seq_id": 1}),
        ("POST", "/save_weights_external", {**model, "seq_id": 1, "path": "x"}),
        ("POST", "/load_weights", {**model, "seq_id": 1, "path": p.path, "optimizer": False}),
        ("POST", "/load_weights", {"session_id": p.session_id, "model_seq_id": 10_001, "path": p.path}),
        (
            "POST",
            "/create_sampling_session",
            {"session_id": p.session_id, "sampling_session_seq_id": 10_000, "model_path": p.path},
        ),
        (
            "POST",
            "/create_sampling_session",
            {"session_id": p.session_id, "sampling_session_seq_id": 10_001, "base_model": MODEL},
        ),
        (
            "POST",
            "/asample",
            {
                "sampling_session_id": p.sampler_id,
                "seq_id": 1,
                "num_samples": 1,
                "prompt": {"chunks": [{"type": "encoded_text", "tokens": TEXT}]},
                "sampling_params": {"max_tokens": 1, "temperature": 1.0, "top_k": -1, "seed": 1},
                "prompt_logprobs": False,
                "topk_prompt_logprobs": 0,
            },
        ),
        ("POST", "/weights_info", {"tinker_path": p.path}),
        ("POST", "/retrieve_future", {"request_id": "x", "allow_metadata_only": False}),
        ("PUT", ck + "/ttl", {"ttl_seconds": 3600}),
        ("POST", "/telemetry", {"events": [], "session_id": p.session_id}),
    ]


QUERY_ROUTES = ["/training_runs", "/checkpoints", "/sessions", "/billing/usage/events"]
QUERY_PARAMS = ["limit", "offset", "starting_on", "ending_before"]

bad_ints = st.one_of(
    st.integers(min_value=BIG, max_value=2**80),
    st.integers(min_value=-(2**80), max_value=-BIG - 1),
    st.integers(min_value=-5, max_value=-1),
)
bad_values = st.one_of(
    bad_ints,
    st.floats(),
    st.text(max_size=8),
    st.booleans(),
    st.none(),
    st.lists(st.integers(), max_size=3),
    st.dictionaries(st.text(max_size=3), st.integers(), max_size=2),
)
malformed = st.one_of(
    st.binary(max_size=40),
    st.sampled_from([b"{", b"[1, 2]", b'"x"', b"null", b"1e999", b'{"a": ' * 50, b"\xff\xfe{}"]),
)


def leaves(body: dict, prefix=()) -> list[tuple]:
    out = []
    for k, v in body.items():
        out.append(prefix + (k,))
        if isinstance(v, dict):
            out.extend(leaves(v, prefix + (k,)))
    return out


def with_value(body: dict, where: tuple, value) -> dict:
    b = copy.deepcopy(body)
    target = b
    for k in where[:-1]:
        target = target[k]
    target[where[-1]] = value
    return b


def check(r: httpx.Response, field: str | None = None, foreign: list[str] = ()) -> None:
    assert r.status_code < 500, (r.request.method, r.request.url, r.request.content[:300], r.text)
    if r.status_code >= 400:
        body = r.json()
        assert body.get("message"), r.text
        if field is not None and body.get("code") == "validation_failed":
            assert field in body["message"], (field, body)
    for secret in foreign:
        assert secret not in r.text, (secret, r.text)


@FUZZ
@given(data=st.data())
def test_mutated_json_bodies_answer_4xx_naming_the_field(plane, data):
    method, path, body = data.draw(st.sampled_from(json_routes(plane)))
    where = data.draw(st.sampled_from(leaves(body)))
    body = with_value(body, where, data.draw(bad_values))
    if "seq_id" in body and isinstance(body["seq_id"], int) and where[-1] != "seq_id":
        body["seq_id"] = next(plane.seq)  # a call no real one waits behind
    check(
        plane.http["a"].request(
            method, path, content=json.dumps(body).encode(), headers={"content-type": "application/json"}
        ),
        where[-1],
    )


@FUZZ
@given(data=st.data(), raw=malformed)
def test_malformed_bodies_and_queries_answer_4xx(plane, data, raw):
    method, path, _ = data.draw(st.sampled_from(json_routes(plane)))
    check(plane.http["a"].request(method, path, content=raw, headers={"content-type": "application/json"}))
    route = data.draw(st.sampled_from(QUERY_ROUTES))
    param = data.draw(st.sampled_from(QUERY_PARAMS))
    value = data.draw(
        st.one_of(bad_ints.map(str), st.text(max_size=12), st.sampled_from(["1e400", "2020-13-45"]))
    )
    check(plane.http["a"].get(route, params={param: value}), param)


@FUZZ
@given(data=st.data())
def test_another_keys_ids_are_never_echoed(plane, data):
    """Key B sends key A's ids in every route, valid bodies or mutated: nothing comes back that names them."""
    method, path, body = data.draw(st.sampled_from(json_routes(plane)))
    if data.draw(st.booleans()):
        where = data.draw(st.sampled_from(leaves(body)))
        body = with_value(body, where, data.draw(bad_values))
    check(plane.http["b"].request(method, path, json=body), foreign=plane.ids())
    for get in (
        f"/training_runs/{plane.run_id}",
        f"/training_runs/{plane.model_id}/checkpoints",
        f"/sessions/{plane.session_id}",
        f"/samplers/{plane.sampler_id}",
        f"/training_runs/{plane.run_id}/checkpoints/sampler_weights/fuzz/archive",
    ):
        check(plane.http["b"].get(get), foreign=plane.ids())
    check(
        plane.http["b"].delete(f"/training_runs/{plane.run_id}/checkpoints/sampler_weights/fuzz"),
        foreign=plane.ids(),
    )


# ---------------------------------------------------------------------------- protobuf bodies
def fb_request(p: Plane, seq: int, loss: str = "cross_entropy", n: int = 6):
    d = types.Datum(
        model_input=types.ModelInput.from_ints(TEXT[:n]),
        loss_fn_inputs={
            "target_tokens": TEXT[1 : n + 1],
            "weights": [1.0] * n,
            "advantages": [1.0] * n,
            "logprobs": [-1.0] * n,
        },
    )
    req = types.ForwardBackwardRequest(
        model_id=p.model_id,
        seq_id=seq,
        forward_backward_input=types.ForwardBackwardInput(data=[d], loss_fn=loss),
    )
    return forward_backward_request_to_proto(req)


int64 = st.integers(min_value=-BIG, max_value=BIG - 1)


def mutate_proto(msg, data) -> str:
    """Change one part of the message to something absurd; returns what was changed."""
    d = msg.data[0]
    t = d.loss_fn_inputs[data.draw(st.sampled_from(["weights", "target_tokens", "advantages"]))]
    what = data.draw(st.sampled_from(["shape", "sparse", "dtype", "dense", "span", "tokens", "config"]))
    if what == "shape":
        del t.shape[:]
        t.shape.extend(data.draw(st.lists(int64, max_size=3)))
    elif what == "sparse":
        del t.shape[:]
        t.shape.extend(data.draw(st.lists(st.one_of(int64, st.integers(0, 8)), min_size=2, max_size=2)))
        t.ClearField("dense")
        t.sparse_csr.values = data.draw(st.binary(max_size=32))
        t.sparse_csr.crow_indices = np.asarray(
            data.draw(st.lists(int64, max_size=4)), dtype=np.int64
        ).tobytes()
        t.sparse_csr.col_indices = np.asarray(
            data.draw(st.lists(int64, max_size=4)), dtype=np.int64
        ).tobytes()
    elif what == "dtype":
        t.dtype = data.draw(st.integers(0, 9))
    elif what == "dense":
        t.dense = data.draw(st.binary(max_size=64))
    elif what == "span":
        span = d.loss_fn_input_spans.add()
        run = span.sampled_tokens if data.draw(st.booleans()) else span.prompt_tokens
        run.sequence_id, run.offset, run.length = (
            data.draw(st.text(max_size=5)),
            data.draw(int64),
            data.draw(int64),
        )
        if data.draw(st.booleans()):
            msg.loss_fn = "stable_reinforce"
    elif what == "tokens":
        d.model_input[0].encoded_text.tokens = data.draw(st.binary(max_size=32))
    else:
        key = data.draw(st.sampled_from(["clip_low_threshold", "clip_high_threshold", "beta", "x"]))
        if data.draw(st.booleans()):
            msg.loss_fn_config_v2[key].text = data.draw(st.text(max_size=5))
        else:
            msg.loss_fn_config[key] = data.draw(st.floats(width=32))
        msg.loss_fn = data.draw(st.sampled_from(["ppo", "cispo", "importance_sampling", "dro", "nope"]))
    return what


@settings(
    max_examples=40, deadline=None, suppress_health_check=list(HealthCheck), derandomize=True, database=None
)
@given(data=st.data())
def test_absurd_forward_backward_protos_fail_as_user_errors(fb_plane, data):
    """Every mutated batch is a 4xx or a future that fails as the user's error (or trains); never a
    5xx, never a server-category failure. Each accepted call takes the model's next seq_id."""
    p = fb_plane
    msg = fb_request(p, p.next_seq)
    what = mutate_proto(msg, data)
    r = p.http["a"].post(
        "/forward_backward",
        content=msg.SerializeToString(),
        headers={"content-type": "application/x-protobuf"},
    )
    check(r)
    if r.status_code == 200:
        p.next_seq += 1
        out = p.http["a"].post(
            "/retrieve_future",
            json={"request_id": r.json()["request_id"]},
            headers={"accept": "application/x-protobuf"},
        )
        assert out.status_code == 200, out.text
        if out.headers["content-type"].startswith("application/json"):
            assert out.json().get("category") == "user", (what, out.text)


# ---------------------------------------------------------------------------- seq_id reuse
def test_a_reused_seq_id_with_another_body_is_a_409_and_never_trains_silently(srv, plane):
    tc = plane.sc.create_lora_training_client(base_model=MODEL, rank=4).result()
    mid = tc.get_info().model_id
    headers = {"content-type": "application/x-protobuf"}
    first, second = (
        forward_backward_request_to_proto(
            types.ForwardBackwardRequest(
                model_id=mid,
                seq_id=1,
                forward_backward_input=types.ForwardBackwardInput(
                    data=[
                        types.Datum(
                            model_input=types.ModelInput.from_ints(toks[:-1]),
                            loss_fn_inputs={"target_tokens": toks[1:]},
                        )
                    ],
                    loss_fn="cross_entropy",
                ),
            )
        ).SerializeToString()
        for toks in (TEXT, TEXT[3:])
    )
    a = plane.http["a"].post("/forward_backward", content=first, headers=headers)
    assert a.status_code == 200
    b = plane.http["a"].post("/forward_backward", content=second, headers=headers)
    assert b.status_code == 409 and b.headers["x-should-retry"] == "false", b.text
    assert "seq_id" in b.json()["message"]
    again = plane.http["a"].post("/forward_backward", content=first, headers=headers)  # a retry joins
    assert again.status_code == 200 and again.json()["request_id"] == a.json()["request_id"]
    opt = {"model_id": mid, "seq_id": 2, "adam_params": {"learning_rate": 1e-3}}
    assert plane.http["a"].post("/optim_step", json=opt).status_code == 200
    r = plane.http["a"].post("/optim_step", json={**opt, "adam_params": {"learning_rate": 5e-1}})
    assert r.status_code == 409
    sample = {
        "sampling_session_id": plane.sampler_id,
        "seq_id": 77,
        "num_samples": 1,
        "prompt": {"chunks": [{"type": "encoded_text", "tokens": TEXT}]},
        "sampling_params": {"max_tokens": 1},
    }
    assert plane.http["a"].post("/asample", json=sample).status_code == 200
    other = {**sample, "prompt": {"chunks": [{"type": "encoded_text", "tokens": TEXT[:4]}]}}
    assert plane.http["a"].post("/asample", json=other).status_code == 409


# ---------------------------------------------------------------------------- the requests that answered 500
def regressions(p: Plane) -> list[tuple[str, str, object, str]]:
    """(method, path, JSON body or query, the field the 4xx must name): each answered 500 before."""
    sample = {
        "sampling_session_id": p.sampler_id,
        "seq_id": 1,
        "num_samples": 1,
        "prompt": {"chunks": [{"type": "encoded_text", "tokens": TEXT}]},
    }
    cases = [
        ("GET", route, {"offset": str(v)}, "offset")
        for route in ("/training_runs", "/checkpoints", "/sessions")
        for v in (BIG, 2**64)
    ]
    cases += [
        ("POST", "/asample", {**sample, "sampling_params": v}, "sampling_params") for v in ("x", 1, True, [1])
    ]
    cases += [
        ("POST", route, {"model_id": p.model_id, "seq_id": BIG, **extra}, "seq_id")
        for route, extra in (
            ("/optim_step", {"adam_params": {"learning_rate": 1e-3}}),
            ("/save_weights", {"path": "x"}),
            ("/save_weights_for_sampler", {"sampling_session_seq_id": 1}),
            ("/load_weights", {"path": p.path}),
        )
    ]
    cases += [("POST", "/sessions/{fresh}/finish", {"reason": v}, "reason") for v in ("x", 3, {"type": []})]
    cases += [
        (
            "POST",
            "/create_sampling_session",
            {"session_id": p.session_id, "sampling_session_seq_id": 5, "base_model": v},
            "base_model",
        )
        for v in (BIG, [1], True)
    ]
    return cases


def test_the_requests_that_answered_500_answer_4xx_naming_the_field(plane):
    for method, path, payload, field in regressions(plane):
        if "{fresh}" in path:
            path = path.format(fresh=plane.http["a"].post("/create_session", json={}).json()["session_id"])
        r = (
            plane.http["a"].get(path, params=payload)
            if method == "GET"
            else plane.http["a"].post(path, json=payload)
        )
        assert 400 <= r.status_code < 500 and field in r.json()["message"], (path, payload, r.text)


def test_absurd_sparse_shapes_are_refused_before_anything_is_allocated(plane):
    for shape in ([10**9, 10**9], [2**40, 3], [-1, -6], [BIG - 1, 2]):
        msg = fb_request(plane, next(plane.seq))
        t = msg.data[0].loss_fn_inputs["weights"]
        del t.shape[:]
        t.shape.extend(shape)
        t.ClearField("dense")
        t.sparse_csr.values, t.sparse_csr.crow_indices, t.sparse_csr.col_indices = b"", bytes(8), b""
        from trine.server.tinker import to_api

        with pytest.raises(Exception, match=r"loss_fn_inputs\['weights'\]: shape"):
            to_api.forward_backward_body(msg)


def test_openai_top_k_past_int64_is_a_400(srv):
    """top_k's range is limits.SAMPLING_BOUNDS' (-1 off, or >= 1); OpenAI's plane also takes 0 as off."""
    openai = pytest.importorskip("openai")
    client = openai.OpenAI(base_url=srv.url + "/v1", api_key=srv.api_key, max_retries=0)
    for off in (0, -1):
        client.completions.create(model=MODEL, prompt="hi", max_tokens=1, extra_body={"top_k": off})
    with pytest.raises(openai.BadRequestError, match=r"top_k.*must be an integer >= 1 \(-1: off\)"):
        client.completions.create(model=MODEL, prompt="hi", max_tokens=1, extra_body={"top_k": -2})
    for huge in (BIG, 2**64):
        with pytest.raises(openai.BadRequestError, match="top_k"):
            client.chat.completions.create(
                model=MODEL,
                messages=[{"role": "user", "content": "hi"}],
                max_tokens=1,
                extra_body={"top_k": huge},
            )
        with pytest.raises(openai.BadRequestError, match="top_k"):
            client.completions.create(model=MODEL, prompt="hi", max_tokens=1, extra_body={"top_k": huge})


def test_openai_routes_never_echo_another_keys_checkpoints(srv, plane):
    openai = pytest.importorskip("openai")
    _, key_b = srv.service.store.create_key("openai-b")
    client = openai.OpenAI(base_url=srv.url + "/v1", api_key=key_b, max_retries=0)
    trio_uri = plane.path.replace("tinker://", "trio://").replace("/sampler_weights/", "/weights/")
    for model in (plane.path, trio_uri):
        with pytest.raises(openai.NotFoundError) as e:
            client.completions.create(model=model, prompt="hi", max_tokens=1)
        assert not any(i in str(e.value.body) for i in plane.ids() + [trio_uri])
        with pytest.raises(openai.NotFoundError) as e:
            client.models.retrieve(model)
        assert not any(i in str(e.value.body) for i in plane.ids() + [trio_uri])


def test_json_types_are_strict_where_the_official_client_sends_booleans_and_integers(plane):
    """`"yes"` is not true and `"0"` is not 0: a body of the wrong JSON type is refused naming its
    field, never coerced into a different request."""
    cases = [
        (
            "/save_weights",
            {"model_id": plane.model_id, "seq_id": plane.next_seq, "path": "strict", "overwrite": "yes"},
            "overwrite",
        ),
        (
            "/create_model",
            {"session_id": plane.session_id, "model_seq_id": "0", "base_model": "x"},
            "model_seq_id",
        ),
        ("/asample", {"sampling_session_id": plane.sampler_id, "seq_id": "1", "num_samples": 1}, "seq_id"),
    ]
    for path, body, field in cases:
        r = plane.http["a"].post(path, json=body)
        if path == "/save_weights":  # a numbered call: it takes its seq_id, and its future fails
            assert r.status_code == 200, r.text
            plane.next_seq += 1
            failed = _settled(plane, r.json()["request_id"]).json()
            assert failed.get("category") == "user" and field in failed["error"], failed
            continue
        assert 400 <= r.status_code < 500 and field in r.json()["message"], (path, r.text)


def _settled(plane, request_id: str) -> httpx.Response:
    while True:
        r = plane.http["a"].post("/retrieve_future", json={"request_id": request_id})
        if r.status_code != 408:
            return r


@pytest.mark.parametrize(
    "field, value, bound",
    [
        ("num_samples", 0, "greater than or equal to 1"),
        ("num_samples", MAX_SAMPLES_PER_REQUEST + 1, f"less than or equal to {MAX_SAMPLES_PER_REQUEST}"),
        ("topk_prompt_logprobs", -1, "greater than or equal to 0"),
        (
            "topk_prompt_logprobs",
            MAX_TOPK_PROMPT_LOGPROBS + 1,
            f"less than or equal to {MAX_TOPK_PROMPT_LOGPROBS}",
        ),
    ],
)
def test_asample_counts_out_of_range_are_refused_naming_the_field_and_its_range(plane, field, value, bound):
    body = {"sampling_session_id": plane.sampler_id, "seq_id": 7, "num_samples": 1, field: value}
    body["prompt"] = {"chunks": [{"type": "encoded_text", "tokens": [1, 2, 3]}]}
    body["sampling_params"] = {"max_tokens": 1}
    r = plane.http["a"].post("/asample", json=body)
    assert r.status_code == 400, r.text
    assert r.json()["message"] == f"{field}: Input should be {bound}", r.text
