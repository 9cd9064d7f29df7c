"""Server-side custom losses through the trine SDK on the PyTRIO plane: `trine.custom_loss` traces a
per-datum loss, `forward_backward_custom(data, traced)` runs it in one server pass with the gradient
of the local two-pass path (`server_side=False`), and a graph the server refuses names its node."""

from __future__ import annotations

import dataclasses
import os

import pytest
from serverutil import serve

import trine as trio

torch = pytest.importorskip("torch")
MODEL = "tiny-llama"
TEXT = [1, 504, 3330, 314, 253, 1345, 28, 357, 314, 253, 1345, 30, 2]


@pytest.fixture(scope="module")
def service(tiny_model_dir, tmp_path_factory):
    home = tmp_path_factory.mktemp("home")
    old = os.environ.get("TRINE_HOME")
    os.environ["TRINE_HOME"] = str(home)
    try:
        with (
            serve(tiny_model_dir, home) as srv,
            trio.ServiceClient(api_key=srv.api_key, base_url=srv.url) as svc,
        ):
            yield svc
    finally:
        os.environ.pop("TRINE_HOME", None) if old is None else os.environ.__setitem__("TRINE_HOME", old)


def weighted(logprobs, adv, scale):  # every active position has a non-zero gradient
    loss = -(logprobs * adv).sum() * scale + 0.1 * (logprobs * logprobs).sum()
    return loss, {"custom/loss:sum": loss, "custom/lp:mean": logprobs.mean()}


def data():
    out = []
    for k, tokens in enumerate((TEXT, TEXT[3:])):
        n = len(tokens) - 1
        out.append(
            trio.Datum(
                model_input=trio.ModelInput.from_ints(tokens[:-1]),
                loss_fn_inputs={
                    "target_tokens": [-100] * 2 + tokens[3:],
                    "adv": [0.5 - 0.1 * i * (k + 1) for i in range(n)],
                    "scale": trio.TensorData(data=[1.5], dtype="float32", shape=[]),
                },
            )
        )
    return out


def test_one_server_pass_equals_the_local_two_pass_path(service):
    traced = trio.custom_loss(weighted, {"logprobs": 1, "adv": 1, "scale": 0})
    one = service.create_lora_training_client(MODEL, rank=4, seed=3)
    two = service.create_lora_training_client(MODEL, rank=4, seed=3)
    out = one.forward_backward_custom(data(), traced).result()
    ref = two.forward_backward_custom(data(), traced, server_side=False).result()
    for key in ("custom/loss:sum", "custom/lp:mean"):
        assert out.metrics[key] == pytest.approx(ref.metrics[key], rel=1e-5), key
    assert out.metrics["loss_sum"] == pytest.approx(out.metrics["custom/loss:sum"], rel=1e-5)
    assert 2 * one.usage().train_tokens == two.usage().train_tokens  # one pass against two
    adam = trio.AdamParams(learning_rate=1e-2)
    a, b = one.optim_step(adam).result(), two.optim_step(adam).result()
    assert a.metrics["grad_norm"] > 0
    assert a.metrics["grad_norm"] == pytest.approx(b.metrics["grad_norm"], rel=1e-5)


def test_a_refused_graph_names_its_node_and_a_plain_callable_is_not_server_side(service):
    traced = trio.custom_loss(weighted, {"logprobs": 1, "adv": 1, "scale": 0})
    graph = dict(traced.graph, nodes=list(traced.graph["nodes"]))
    graph["nodes"][3] = dict(graph["nodes"][3], target="os.system")
    bad = dataclasses.replace(traced, graph=graph)
    trainer = service.create_lora_training_client(MODEL, rank=4)
    with pytest.raises(
        trio.TrineError, match=r"graph.nodes\[3\].target: 'os.system' is not an allowed operation"
    ):
        trainer.forward_backward_custom(data(), bad).result()
    with pytest.raises(trio.ValidationError, match=r"server_side=True\) runs a traced loss"):
        trainer.forward_backward_custom(
            data(), lambda d, lps: (sum(lp.sum() for lp in lps), {}), server_side=True
        )
    with pytest.raises(trio.ValidationError, match=r"data\[0\].loss_fn_inputs\['adv'\] is required"):
        plain = [
            trio.Datum(
                model_input=d.model_input, loss_fn_inputs={"target_tokens": d.loss_fn_inputs["target_tokens"]}
            )
            for d in data()
        ]
        trainer.forward_backward_custom(plain, traced)
