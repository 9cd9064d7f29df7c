"""Server-side custom losses in the trainer: one forward and one backward give the gradient of the
client-side two-pass path (forward, the graph on the client, cross_entropy with weights -dC/dlogp):
the same math in another order (tolerance.py, kind 3: in fp64 they agree, in fp32 within the
two-pass path's own rounding). A graph runs in fp32 on fp32 logprobs on either side, as a client's
does, so in fp64 the two paths feed it the same values. The graph's runtime bounds and failures
name the node before any gradient moves. Graphs are traced by the official tinker client's own
tracer, as it sends them."""

from __future__ import annotations

import math

import pytest
import torch
from test_losses import random_data
from test_trainer import grads, new_trainer
from tolerance import assert_bitwise, assert_same_computation

from trine.engine.api import Forward, Loss, LossTensor, TrainDatum, parse_custom_loss
from trine.engine.model.weights import load_model
from trine.engine.trainer.custom_graph import CustomLossError

pytest.importorskip("tinker")
from tinker.lib.public_interfaces.custom_loss import encode_graph, trace_loss  # noqa: E402


def ppo_sum(logprobs, advantages, old):
    ratio = torch.exp(logprobs - old)
    loss = -torch.minimum(ratio * advantages, torch.clamp(ratio, 0.8, 1.2) * advantages).sum()
    return loss / math.sqrt(logprobs.shape[0]), {"custom/ratio:mean": ratio.mean(), "custom/n:sum": loss}


def seq_softmax(logprobs, scale):  # not elementwise: every token's gradient depends on the others
    z = torch.nn.functional.log_softmax(logprobs * scale, dim=-1)
    return -(z * torch.sigmoid(logprobs)).sum() + logprobs.logsumexp(0) * 0.1, {}


@pytest.fixture(scope="module")
def model(tiny_model_dir):
    return load_model(tiny_model_dir, "cpu")


CASES = {
    "ppo_sum": (ppo_sum, {"logprobs": 1, "advantages": 1, "old": 1}),
    "seq_softmax": (seq_softmax, {"logprobs": 1, "scale": 0}),
}


def traced(fn, ranks):
    handle = trace_loss(fn, ranks, "session")
    wire = encode_graph(handle).model_dump(mode="json")
    inputs = [x.model_dump() for x in handle.inputs]
    return handle, Loss.of_custom(parse_custom_loss(handle.name, inputs, wire, "loss-1"))


def with_inputs(data: list[TrainDatum], names) -> list[TrainDatum]:
    out = []
    for d in data:
        n = len(d.tokens)
        values = {"advantages": d.advantages, "old": d.logprobs}
        custom = {
            name: LossTensor((n,), values[name]) if name in values else LossTensor((), [0.7])
            for name in names
        }
        out.append(TrainDatum(tokens=d.tokens, target_tokens=d.target_tokens, custom_inputs=custom))
    return out


def two_pass(trainer, run, handle, data):
    """The client-side path: forward, the graph per datum, then cross_entropy with -dC/dlogp."""
    fwd = trainer.forward_backward([(run, Forward(data, Loss.parse("cross_entropy")))], backward=False)[0]
    linear, total, metrics = [], 0.0, {}
    for d, lp in zip(data, fwd.logprobs):
        x = torch.tensor(lp).requires_grad_(True)
        inputs = [
            torch.tensor(d.custom_inputs[n].values).reshape(d.custom_inputs[n].shape)
            for n in handle.input_names
        ]
        loss, values = handle.graph(x, *inputs)
        loss.backward()
        total += float(loss.detach())
        for k, v in values.items():
            metrics[k] = metrics.get(k, 0.0) + float(v.detach()) / (len(data) if k.endswith(":mean") else 1)
        linear.append(TrainDatum(tokens=d.tokens, target_tokens=d.target_tokens, weights=(-x.grad).tolist()))
    trainer.forward_backward([(run, Forward(linear, Loss.parse("cross_entropy")))])
    return total, metrics


@pytest.mark.parametrize("case", sorted(CASES))
def test_one_pass_gradient_equals_the_two_pass_gradient(model, tiny_model64, case):
    handle, loss = traced(*CASES[case])
    data = with_inputs(random_data(5, lengths=(11, 7, 16, 9)), handle.input_names)

    def compute(m):
        server, client = new_trainer(m, "r"), new_trainer(m, "r")
        res = server.forward_backward([("r", Forward(data, loss))])[0]
        total, metrics = two_pass(client, "r", handle, data)
        assert res.metrics.keys() == metrics.keys() and len(metrics) == (2 if case == "ppo_sum" else 0)
        # the loss and the metrics are the graph's values: one group, so one scalar is not its own scale
        want = {"grads": grads(client, "r"), "values": [total, *metrics.values()]}
        return want, {"grads": grads(server, "r"), "values": [res.loss_sum, *res.metrics.values()]}

    assert_same_computation(compute, model, tiny_model64)


def test_a_custom_loss_shares_a_call_with_other_runs_and_shared_prefixes(model, tiny_model64):
    handle, loss = traced(*CASES["ppo_sum"])
    prompt = list(range(40, 72))  # a 32-token prompt shared by a group: the custom rows stay plain
    base = random_data(6, lengths=(8, 8, 8))
    group = [
        TrainDatum(
            tokens=prompt + d.tokens,
            target_tokens=[-100] * 32 + d.target_tokens,
            logprobs=[-1.0] * 32 + d.logprobs,
            advantages=[0.0] * 32 + d.advantages,
        )
        for d in base
    ]
    data = with_inputs(group, handle.input_names)
    ce = random_data(7)

    def compute(m):  # batched with another run or alone: another order of the same sums (kind 3)
        mixed, alone = new_trainer(m, "c", "e"), new_trainer(m, "c", "e")
        mixed.forward_backward([("c", Forward(data, loss)), ("e", Forward(ce, Loss.parse("cross_entropy")))])
        alone.forward_backward([("c", Forward(data, loss))])
        alone.forward_backward([("e", Forward(ce, Loss.parse("cross_entropy")))])
        return {r: grads(alone, r) for r in ("c", "e")}, {r: grads(mixed, r) for r in ("c", "e")}

    assert_same_computation(compute, model, tiny_model64)


def test_runtime_bounds_and_failures_name_the_node_before_any_gradient_moves(model):
    def outer(logprobs, x):
        return (x[:, None] * x[None, :]).sum() + logprobs.sum(), {}

    def mismatch(logprobs, x):
        return (logprobs * x).sum(), {}

    def constant(logprobs, x):
        return (x * 2).sum(), {}

    trainer = new_trainer(model, "r")
    before = grads(trainer, "r")
    d = random_data(8, lengths=(6,))[0]
    for fn, x, match in (
        (outer, LossTensor((5000,), [1.0] * 5000), "node 'mul'.*broadcast to 25000000 elements"),
        (mismatch, LossTensor((4,), [1.0] * 4), "data\\[0\\]: custom loss.*node 'mul'.*RuntimeError"),
        (constant, LossTensor((6,), [1.0] * 6), "does not depend on logprobs"),
    ):
        _, loss = traced(fn, {"logprobs": 1, "x": 1})
        datum = TrainDatum(tokens=d.tokens, target_tokens=d.target_tokens, custom_inputs={"x": x})
        with pytest.raises(CustomLossError, match=match):
            trainer.forward_backward([("r", Forward([datum], loss))])
    assert_bitwise(grads(trainer, "r"), before)  # nothing was added, not even a rounding


def test_a_graph_failing_only_on_real_logprobs_fails_its_entry_alone(model, tiny_model64):
    def by_value(logprobs, x):  # indices from the logprobs: in range for the dry run's zeros only
        return (x.gather(0, (logprobs * -1000).long()) * logprobs).sum(), {}

    _, loss = traced(by_value, {"logprobs": 1, "x": 1})
    d = random_data(9, lengths=(6,))[0]
    datum = TrainDatum(
        tokens=d.tokens, target_tokens=d.target_tokens, custom_inputs={"x": LossTensor((6,), [1.0] * 6)}
    )
    ce = random_data(10)

    def compute(m):
        mixed, alone = new_trainer(m, "c", "e"), new_trainer(m, "c", "e")
        before = grads(mixed, "c")
        bad, good = mixed.forward_backward(
            [("c", Forward([datum], loss)), ("e", Forward(ce, Loss.parse("cross_entropy")))]
        )
        alone.forward_backward([("e", Forward(ce, Loss.parse("cross_entropy")))])
        assert "node 'gather'" in bad.error and "RuntimeError" in bad.error and good.error == ""
        assert_bitwise(grads(mixed, "c"), before)  # the failed datum added nothing
        return {"e": grads(alone, "e")}, {"e": grads(mixed, "e")}  # batched or alone (kind 3)

    assert_same_computation(compute, model, tiny_model64)
