"""Server-side custom losses through the official, unmodified `tinker` 0.38 client against a real
trine server (issue 30, item 1): `create_custom_loss` uploads the traced graph, `forward_backward_custom`
runs it in one server-side forward/backward with the gradient of the client-side two-pass path, and
every malformed or malicious graph is a 400 naming its node (never run, never a 5xx).

Float comparisons (tests/tolerance.py): the one-pass and the two-pass runs compute the same rows'
logprobs on the same weights, alone in their calls: bit for bit (kind 1). The graph runs on the
server in its interpreter and on the client in torch, and its gradient reaches the trainer in two
ways: two paths of the same math (tests/engine/test_custom_loss.py bounds them against fp64), so
the graph's values are within what SERVED_PATHS of a logprob moves them by, plus both sides' fp32
rounding of the graph (`graph_bound`), and the grad norm within SERVED_GRAD_PATHS."""

from __future__ import annotations

import copy
import dataclasses

import httpx
import numpy as np
import pytest
from tolerance import (
    EPS32,
    SERVED_GRAD_PATHS,
    SERVED_PATHS,
    assert_bitwise,
    assert_served_paths,
    assert_sum_of,
    gamma,
)

tinker = pytest.importorskip("tinker")
torch = pytest.importorskip("torch")
from tinker import types  # noqa: E402

MODEL = "tiny-llama"
TEXT = [1, 504, 3330, 314, 253, 1345, 28, 357, 314, 253, 1345, 30, 2]


def clipped_pg(logprobs, advantages, old):
    ratio = torch.exp(logprobs - old)
    loss = -torch.minimum(ratio * advantages, torch.clamp(ratio, 0.9, 1.1) * advantages).sum()
    return loss, {"custom/ratio:mean": ratio.mean(), "custom/loss:sum": loss}


RANKS = {"logprobs": 1, "advantages": 1, "old": 1}


def graph_bound(sensitivity: float, magnitude: float, lp_scale: float, n: int) -> float:
    """How far two evaluations of a graph value can be apart: `sensitivity` (sum |d value / d logp|)
    times a logprob's error between the two paths (SERVED_PATHS of their scale), plus each side's
    fp32 rounding of the graph: a few roundings per term (2 EPS32) and an n-term sum (gamma_n), of
    `magnitude` (the sum of its terms' magnitudes)."""
    return SERVED_PATHS * lp_scale * sensitivity + 2 * (2 * EPS32 + gamma(n)) * magnitude


def clipped_pg_bounds(data, outputs) -> dict[str, float]:
    """`graph_bound` of clipped_pg's reported values, from the logprobs the server reported (fp64)."""
    lps = [o["logprobs"].to_numpy().astype(np.float64) for o in outputs]
    scale = max(float(np.abs(lp).max()) for lp in lps)
    n = max(len(lp) for lp in lps)
    loss_sens = loss_mag = ratio_sens = 0.0
    for d, lp in zip(data, lps):
        adv = np.asarray(d.loss_fn_inputs["advantages"].data, dtype=np.float64)
        ratio = np.exp(lp - np.asarray(d.loss_fn_inputs["old"].data, dtype=np.float64))
        terms = np.minimum(ratio * adv, np.clip(ratio, 0.9, 1.1) * adv)
        loss_sens += float((ratio * np.abs(adv)).sum())  # d term / d logp is ratio * A where unclipped
        loss_mag += float(np.abs(terms).sum())
        ratio_sens += float(ratio.mean()) / len(data)  # a mean over datums of per-datum means
    loss = graph_bound(loss_sens, loss_mag, scale, n)
    return {
        "loss:sum": loss,
        "custom/loss:sum": loss,
        "custom/ratio:mean": graph_bound(ratio_sens, ratio_sens, scale, n),
    }


def floats(values) -> types.TensorData:
    return types.TensorData(data=list(values), dtype="float32", shape=[len(values)])


def datum(tokens, adv: float, **extra):
    n = len(tokens) - 1
    return types.Datum(
        model_input=types.ModelInput.from_ints(tokens[:-1]),
        loss_fn_inputs={
            "target_tokens": tokens[1:],
            "advantages": floats([adv] * n),
            "old": floats([-9.0 - 0.1 * i for i in range(n)]),
            **{k: floats(v) for k, v in extra.items()},
        },
    )


DATA = [datum(TEXT, 1.0), datum(TEXT[2:], -0.5, weights=[1.0] * (len(TEXT) - 3))]  # weights: not read


def usage_ops(srv) -> list[str]:
    key = srv.service.store.key_by_secret(srv.api_key)
    return [e.operation for e in srv.service.usage_events(key)]


@pytest.fixture(scope="module")
def handle(sc):
    return sc.create_custom_loss(clipped_pg, RANKS).result()  # once per session (the client's rule)


def test_the_server_runs_the_loss_in_one_pass_with_the_two_pass_gradient(srv, sc, handle):
    assert handle.loss_id and handle.loss_id.startswith(sc.holder.get_session_id())
    one = sc.create_lora_training_client(base_model=MODEL, rank=4, seed=5).result()
    two = sc.create_lora_training_client(base_model=MODEL, rank=4, seed=5).result()
    ops = len(usage_ops(srv))
    out = one.forward_backward_custom(DATA, handle).result()
    assert len(usage_ops(srv)) == ops + 1  # one forward_backward, no separate forward
    local = dataclasses.replace(handle, loss_id=None)  # the same traced loss, run on the client
    ref = two.forward_backward_custom(DATA, local).result()
    assert "surrogate_loss:sum" in ref.metrics and "surrogate_loss:sum" not in out.metrics
    bounds = clipped_pg_bounds(DATA, ref.loss_fn_outputs)
    for k in ("loss:sum", "custom/ratio:mean", "custom/loss:sum"):
        assert abs(out.metrics[k] - ref.metrics[k]) <= bounds[k], (
            k,
            out.metrics[k],
            ref.metrics[k],
            bounds[k],
        )
    for a, b in zip(out.loss_fn_outputs, ref.loss_fn_outputs):  # kind 1: the same rows, weights, calls
        assert_bitwise(a["logprobs"].to_torch(), b["logprobs"].to_torch())
    adam = types.AdamParams(learning_rate=1e-2)
    step_one, step_two = one.optim_step(adam).result(), two.optim_step(adam).result()
    g1, g2 = step_one.metrics["grad_norm"], step_two.metrics["grad_norm"]
    assert abs(g1 - g2) <= SERVED_GRAD_PATHS * g2, (g1, g2)  # the gradient by two paths
    assert step_one.metrics["grad_norm"] > 0
    plain = [types.Datum(model_input=DATA[0].model_input, loss_fn_inputs={"target_tokens": TEXT[1:]})]
    after = [c.forward(plain, "cross_entropy").result().loss_fn_outputs[0]["logprobs"] for c in (one, two)]
    # AdamW's first step moves each weight by lr * m / sqrt(v), lr * sign(g) up to a few roundings:
    # the two gradients' rounding moves the weights in their last bits, a logprob by a few EPS32 of
    # what the step moved it, below the forward's own rounding: two paths, SERVED_PATHS. (A weight
    # whose gradient were within rounding of 0 could step either way, 2 lr apart; these data have
    # none: the two runs' gradients came out alike to the bit, on both kernel paths, when measured.)
    assert_served_paths(after[0].to_numpy(), after[1].to_numpy())


def test_forward_backward_errors_name_the_datum_or_the_node(srv, sc, handle):

    def mismatch(logprobs, x):
        return (logprobs * x).sum(), {}

    bad = sc.create_custom_loss(mismatch, {"logprobs": 1, "x": 1}).result()
    tc = sc.create_lora_training_client(base_model=MODEL, rank=4).result()
    missing = [types.Datum(model_input=DATA[0].model_input, loss_fn_inputs={"target_tokens": TEXT[1:]})]
    # the raw call skips the client's own input check: the server names the field
    with pytest.raises(Exception, match=r"data\[0\]\.loss_fn_inputs\['advantages'\] is required"):
        tc.forward_backward(missing, "custom", {"loss_id": handle.loss_id}).result()
    with pytest.raises(Exception, match="loss_id 'nope' is not a custom loss of this model's session"):
        tc.forward_backward(DATA, "custom", {"loss_id": "nope"}).result()
    short = [datum(TEXT, 1.0, x=[1.0, 2.0])]
    with pytest.raises(Exception, match=r"node 'mul' \(operator.mul\) failed: RuntimeError"):
        tc.forward_backward_custom(short, bad).result()
    assert tc.forward_backward_custom(DATA, handle).result().metrics["loss:sum"] != 0  # the client goes on
    other = tinker.ServiceClient(base_url=srv.url, api_key="tml-" + srv.api_key)
    try:  # another session of the same key cannot use it
        tc2 = other.create_lora_training_client(base_model=MODEL, rank=4).result()
        with pytest.raises(Exception, match="not a custom loss of this model's session"):
            tc2.forward_backward(DATA, "custom", {"loss_id": handle.loss_id}).result()
    finally:
        other.close("success").result()


# ---------------------------------------------------------------------------- fuzzing the graph


def base_body(sc) -> dict:
    from tinker.lib.public_interfaces.custom_loss import encode_graph, trace_loss

    handle = trace_loss(clipped_pg, RANKS, sc.holder.get_session_id())
    return {
        "session_id": handle.session_id,
        "custom_loss_seq_id": 1000,
        "name": handle.name,
        "inputs": [x.model_dump() for x in handle.inputs],
        "graph": encode_graph(handle).model_dump(mode="json"),
        "type": "create_custom_loss",
    }


def node(op, name, target, *args, **kwargs):
    return {"op": op, "name": name, "target": target, "args": list(args), "kwargs": kwargs}


def fn(name, target, *args, **kwargs):
    return node("call_function", name, target, *args, **kwargs)


def ref(name):
    return {"ref": name}


def insert(body, k, new):
    """`new` as graph node k (after the three placeholders), its value unused."""
    body["graph"]["nodes"].insert(k, new)


MALFORMED = [
    # (what, mutate(body), node index the message names, words it contains)
    (
        "an unknown function",
        lambda b: insert(b, 3, fn("evil", "os.system", "rm -rf /")),
        3,
        "'os.system' is not an allowed operation",
    ),
    ("a builtin", lambda b: insert(b, 3, fn("evil", "eval", "1")), 3, "'eval' is not an allowed operation"),
    ("a dunder function", lambda b: insert(b, 3, fn("evil", "__import__", "os")), 3, "dunder"),
    (
        "a dunder method",
        lambda b: insert(b, 3, node("call_method", "evil", "__reduce_ex__", ref("old"), 2)),
        3,
        "dunder",
    ),
    (
        "getattr of a dunder",
        lambda b: insert(b, 3, fn("evil", "getattr", ref("old"), "__class__")),
        3,
        "getattr may only read",
    ),
    (
        "getattr of data",
        lambda b: insert(b, 3, fn("evil", "getattr", ref("old"), "grad_fn")),
        3,
        "getattr may only read",
    ),
    (
        "an unknown method",
        lambda b: insert(b, 3, node("call_method", "evil", "numpy", ref("old"))),
        3,
        "not an allowed tensor method",
    ),
    (
        "an in-place method",
        lambda b: insert(b, 3, node("call_method", "evil", "add_", ref("logprobs"), 1.0)),
        3,
        "in place",
    ),
    (
        "an out= keyword",
        lambda b: insert(b, 3, fn("evil", "torch.exp", ref("old"), out=ref("logprobs"))),
        3,
        "kwargs.out",
    ),
    (
        "a module call",
        lambda b: insert(b, 3, node("call_module", "evil", "linear", ref("old"))),
        3,
        "'call_module' is not allowed",
    ),
    (
        "a captured tensor",
        lambda b: insert(b, 3, node("get_attr", "evil", "weight")),
        3,
        "'get_attr' is not allowed",
    ),
    (
        "a huge shape",
        lambda b: insert(b, 3, fn("evil", "torch.zeros", 1 << 20, 1 << 20)),
        3,
        "asks for 1099511627776 elements",
    ),
    (
        "a huge expand",
        lambda b: insert(b, 3, node("call_method", "evil", "expand", ref("old"), 1 << 16, 1 << 16)),
        3,
        "elements",
    ),
    ("a huge integer", lambda b: insert(b, 3, fn("evil", "operator.mul", ref("old"), 10**30)), 3, "beyond"),
    (
        "a cycle",
        lambda b: insert(b, 3, fn("evil", "torch.exp", ref("evil"))),
        3,
        "refers to itself (a cycle)",
    ),
    (
        "a later node",
        lambda b: insert(b, 3, fn("evil", "torch.exp", ref("exp"))),
        3,
        "node 'exp', which comes later",
    ),
    (
        "an unknown node",
        lambda b: insert(b, 3, fn("evil", "torch.exp", ref("ghost"))),
        3,
        "'ghost', which is no node",
    ),
    (
        "a NaN constant",
        lambda b: insert(b, 3, fn("evil", "operator.mul", ref("old"), {"float": "nan"})),
        3,
        "not a finite number",
    ),
    (
        "an infinite constant",
        lambda b: insert(b, 3, fn("evil", "torch.clamp", ref("old"), max={"float": "inf"})),
        3,
        "not a finite number",
    ),
    ("a list as a node name", lambda b: insert(b, 3, fn("evil", "torch.exp", {"ref": ["x"]})), 3, "no node"),
    (
        "a list as a dtype",
        lambda b: insert(b, 3, fn("evil", "torch.exp", {"dtype": ["x"]})),
        3,
        "not an encoded",
    ),
    (
        "a list attribute",
        lambda b: insert(b, 3, fn("evil", "getattr", ref("old"), ["shape"])),
        3,
        "getattr may",
    ),
    (
        "an unknown encoding",
        lambda b: insert(b, 3, fn("evil", "torch.exp", {"pickle": "gASV"})),
        3,
        "not an encoded argument",
    ),
    (
        "a bad dtype",
        lambda b: insert(b, 3, node("call_method", "evil", "to", ref("old"), {"dtype": "object"})),
        3,
        "not an encoded argument",
    ),
    (
        "a deep argument",
        lambda b: insert(b, 3, fn("evil", "torch.stack", [[[[[[ref("old")]]]]]])),
        3,
        "nest at most",
    ),
    ("a long list", lambda b: insert(b, 3, fn("evil", "torch.stack", [ref("old")] * 100)), 3, "at most 64"),
    (
        "a duplicate name",
        lambda b: insert(b, 3, fn("old", "torch.exp", ref("logprobs"))),
        3,
        "is used by graph.nodes[2]",
    ),
    (
        "a stray placeholder",
        lambda b: insert(b, 3, node("placeholder", "extra", "extra")),
        3,
        "not one of the declared inputs",
    ),
    ("a renamed input", lambda b: b["graph"]["nodes"][1].update(target="adv"), 1, "placeholder 'advantages'"),
    (
        "an unknown node kind",
        lambda b: insert(b, 3, node("call_anything", "evil", "x")),
        3,
        "not a node kind",
    ),
    (
        "a method on a constant",
        lambda b: insert(b, 3, node("call_method", "evil", "exp", 1.0)),
        3,
        "first argument is the tensor",
    ),
    (
        "an output before the end",
        lambda b: insert(b, 3, node("output", "output", "output", ref("old"))),
        3,
        "must be the last node",
    ),
    (
        "a bad metric name",
        lambda b: b["graph"]["nodes"][-1]["args"][0]["tuple"][1]["dict"].update({"loss:sum": ref("exp")}),
        -1,
        "custom/<name>:sum",
    ),
    (
        "a bad node name",
        lambda b: insert(b, 3, fn("x; import os", "torch.exp", ref("old"))),
        3,
        "not a node name",
    ),
]


@pytest.mark.parametrize("what,mutate,index,words", MALFORMED, ids=[m[0] for m in MALFORMED])
def test_malformed_graphs_are_a_400_naming_the_node(srv, sc, what, mutate, index, words):
    body = base_body(sc)
    mutate(body)
    index = index % len(body["graph"]["nodes"])
    r = httpx.post(
        f"{srv.url}/api/v1/create_custom_loss", json=body, headers={"X-API-Key": "tml-" + srv.api_key}
    )
    assert r.status_code == 400, r.text
    assert r.json()["code"] == "invalid_custom_loss"
    assert f"graph.nodes[{index}]" in r.json()["message"] and words in r.json()["message"], r.text


def test_garbage_bodies_never_5xx_and_valid_ones_join_retries(srv, sc):
    url, headers = f"{srv.url}/api/v1/create_custom_loss", {"X-API-Key": "tml-" + srv.api_key}
    good = base_body(sc)
    too_many = copy.deepcopy(good)
    too_many["graph"]["nodes"][3:3] = [fn(f"n{i}", "torch.exp", ref("old")) for i in range(1100)]
    for body in (
        {**good, "graph": {"nodes": [1, 2, 3]}},
        {**good, "graph": "x"},
        {**good, "graph": {"nodes": []}},
        {**good, "inputs": [{"name": "logprobs", "rank": 2}]},
        {**good, "inputs": [{"name": "Logprobs", "rank": 1}]},
        {**good, "graph": {"format": 2, "nodes": good["graph"]["nodes"]}},
        {**good, "graph": {"nodes": [{**n, "name": ["x"]} for n in good["graph"]["nodes"]]}},
        {**good, "graph": {"nodes": good["graph"]["nodes"][:-1]}},
        too_many,
        {**good, "session_id": "not-a-session"},
        [1, 2],
    ):
        r = httpx.post(url, json=body, headers=headers)
        assert 400 <= r.status_code < 500, r.text
    first = httpx.post(url, json=good, headers=headers)
    again = httpx.post(url, json=good, headers=headers)
    assert first.status_code == again.status_code == 200 and first.json() == again.json()
    other = {**good, "name": "renamed"}
    assert httpx.post(url, json=other, headers=headers).status_code == 409


def test_random_mutations_of_a_graph_are_accepted_or_refused_never_a_5xx(srv, sc):
    """Seeded random edits of a real graph (values swapped for other JSON values, nodes duplicated
    or moved): every answer is a 200 or a 4xx, every 400 names the graph or an input, and every
    accepted graph trains or fails as the user's error (never the engine's)."""
    import random

    rng = random.Random(30)
    url, headers = f"{srv.url}/api/v1/create_custom_loss", {"X-API-Key": "tml-" + srv.api_key}
    junk = [
        {"ref": [1]},
        {"dtype": {}},
        {"slice": [[], {}, None]},
        {"dict": {"a": {"ref": {}}}},
        None,
        True,
        -1,
        2**40,
        1.5,
        "",
        "x" * 100,
        "os.system",
        "__class__",
        [],
        {},
        {"ref": "old"},
        {"float": "nan"},
        {"tuple": [{"ref": "exp"}] * 3},
        {"dtype": "float32"},
        [[[[[1]]]]],
    ]
    codes, accepted = [], []
    with httpx.Client(timeout=30) as http:
        for i in range(300):
            body = base_body(sc)
            body["custom_loss_seq_id"] = 5000 + i
            nodes = body["graph"]["nodes"]
            k = rng.randrange(len(nodes))
            move = rng.randrange(4)
            if move == 0:
                nodes[k][rng.choice(["op", "name", "target"])] = rng.choice(junk)
            elif move == 1 and nodes[k]["args"]:
                nodes[k]["args"][rng.randrange(len(nodes[k]["args"]))] = rng.choice(junk)
            elif move == 2:
                nodes.insert(rng.randrange(len(nodes)), copy.deepcopy(nodes[k]))
            else:
                nodes.insert(rng.randrange(len(nodes)), nodes.pop(k))
            r = http.post(url, json=body, headers=headers)
            codes.append(r.status_code)
            assert r.status_code == 200 or 400 <= r.status_code < 500, r.text
            if r.status_code == 400:
                assert "graph" in r.json()["message"] or "inputs" in r.json()["message"], r.text
            else:
                accepted.append(f"{body['session_id']}:loss:{body['custom_loss_seq_id']}")
    assert codes.count(400) > 150 and accepted  # the edits mostly break the graph, each refused by name
    tc = sc.create_lora_training_client(base_model=MODEL, rank=4).result()
    futures = [tc.forward_backward(DATA, "custom", {"loss_id": loss_id}) for loss_id in accepted]
    failed = 0
    for f in futures:
        try:
            f.result()
        except tinker.RequestFailedError as e:  # the user's error, naming the datum and the node
            assert "internal" not in str(e) and "custom_loss_failed" in str(e) and "data[0]" in str(e), str(e)
            failed += 1
    assert 0 < failed < len(accepted)


def test_a_session_keeps_a_bounded_number_of_losses(srv, sc):
    from trine.server.tinker.custom_losses import MAX_LOSSES_PER_SESSION

    headers = {"X-API-Key": "tml-" + srv.api_key}
    sid = httpx.post(f"{srv.url}/api/v1/create_session", json={"sdk_version": "t"}, headers=headers).json()[
        "session_id"
    ]
    body = {**base_body(sc), "session_id": sid}
    with httpx.Client(base_url=srv.url, headers=headers, timeout=30) as http:
        for seq in range(MAX_LOSSES_PER_SESSION):
            assert (
                http.post("/api/v1/create_custom_loss", json={**body, "custom_loss_seq_id": seq}).status_code
                == 200
            )
        r = http.post(
            "/api/v1/create_custom_loss", json={**body, "custom_loss_seq_id": MAX_LOSSES_PER_SESSION}
        )
        assert r.status_code == 400 and r.json()["code"] == "too_many_custom_losses", r.text
        again = http.post("/api/v1/create_custom_loss", json={**body, "custom_loss_seq_id": 0})
        assert again.status_code == 200  # a retry of a kept loss still joins it


def test_a_loss_may_read_the_target_tokens(sc):
    def nll_of_real_tokens(logprobs, target_tokens):
        return -(logprobs * (target_tokens > 0).float()).sum(), {}

    handle = sc.create_custom_loss(nll_of_real_tokens, {"logprobs": 1, "target_tokens": 1}).result()
    tc = sc.create_lora_training_client(base_model=MODEL, rank=4).result()
    plain = [types.Datum(model_input=DATA[0].model_input, loss_fn_inputs={"target_tokens": TEXT[1:]})]
    out = tc.forward_backward_custom(plain, handle).result()
    # kind 2: the graph's fp32 sum of the reported logprobs (every target is a real token, so the
    # mask's products are exact)
    assert_sum_of(out.metrics["loss:sum"], -out.loss_fn_outputs[0]["logprobs"].to_numpy(), torch.float32)
