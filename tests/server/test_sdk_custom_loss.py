"""Server-side custom losses through the trine SDK on the PyTRIO plane: `trine.custom_loss` traces a
per-datum loss, `forward_backward_custom(data, traced)` runs it in one server pass with the gradient
of the local two-pass path (`server_side=False`), and a graph the server refuses names its node.

Float comparisons (tests/tolerance.py): the graph runs on the server (its interpreter) and on the
client (torch), and its gradient reaches the trainer by two paths (tests/engine/test_custom_loss.py
bounds them against fp64): a graph value is within SERVED_PATHS of a logprob times its sensitivity
to the logprobs, plus both sides' fp32 rounding of the graph; the grad norm within
SERVED_GRAD_PATHS. The loss a result reports and its own metric are the one graph value: bit for bit."""

from __future__ import annotations

import dataclasses
import os

import pytest
from serverutil import serve
from tolerance import EPS32, SERVED_GRAD_PATHS, SERVED_PATHS, gamma

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


def weighted_bounds(data, outputs) -> dict[str, float]:
    """How far two evaluations of `weighted`'s values can be apart, from the reported logprobs: its
    sensitivity sum |dC/dlogp| = sum |-1.5 adv + 0.2 logp| (a mean's: 1) times a logprob's error
    between two paths (SERVED_PATHS of their scale), plus each side's fp32 rounding of the graph (2
    EPS32 a term and gamma_n a sum, of the sum of its terms' magnitudes)."""
    lps = [o["logprobs"].to_numpy().astype("float64") for o in outputs]
    delta = SERVED_PATHS * max(float(abs(lp).max()) for lp in lps)
    loss, mean = 0.0, 0.0
    for d, lp in zip(data, lps):
        active = lp != 0  # the -100 targets' logprobs are 0.0 and add nothing
        adv = d.loss_fn_inputs["adv"]
        adv = torch.tensor(getattr(adv, "data", adv), dtype=torch.float64).numpy()
        lp, adv, n = lp[active], adv[active], int(active.sum())
        rounding = 2 * (2 * EPS32 + gamma(n))
        loss += delta * float(abs(-1.5 * adv + 0.2 * lp).sum()) + rounding * float(
            abs(1.5 * adv * lp).sum() + (0.1 * lp * lp).sum()
        )
        mean += (delta + rounding * float(abs(lp).mean())) / len(data)
    return {"custom/loss:sum": loss, "custom/lp:mean": mean}


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
    bounds = weighted_bounds(data(), ref.loss_fn_outputs)
    for key in ("custom/loss:sum", "custom/lp:mean"):
        assert abs(out.metrics[key] - ref.metrics[key]) <= bounds[key], (
            key,
            out.metrics,
            ref.metrics,
            bounds,
        )
    assert out.metrics["loss_sum"] == out.metrics["custom/loss:sum"]  # kind 1: the same values, added alike
    assert 2 * one.usage().train_tokens == two.usage().train_tokens  # one pass against two
    adam = trio.AdamParams(learning_rate=1e-2)
    a, b = one.optim_step(adam).result(), two.optim_step(adam).result()
    assert a.metrics["grad_norm"] > 0
    assert abs(a.metrics["grad_norm"] - b.metrics["grad_norm"]) <= SERVED_GRAD_PATHS * b.metrics["grad_norm"]


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
