"""The custom loss allowlist and its strict interpreter: every allowed name is a real torch/math/
operator function or tensor method, and hand-made graphs that try to escape it (Python integers
that explode, strings multiplied, getattr off a tensor, devices) fail naming the node."""

from __future__ import annotations

import pytest
import torch

from trine.engine.loss_graph import FUNCTIONS, METHODS, parse_custom_loss
from trine.engine.trainer.custom_graph import _CALLABLES, CustomLossError, loss_and_grad, run


def test_every_allowed_name_is_a_function_or_a_tensor_method():
    assert set(_CALLABLES) == FUNCTIONS - {"getattr"}
    assert all(callable(f) for f in _CALLABLES.values())
    assert [m for m in METHODS if not callable(getattr(torch.Tensor, m, None))] == []
    assert not any("__" in name for name in FUNCTIONS | METHODS)
    assert not any(name.endswith("_") for name in METHODS)  # in-place methods


def graph(*nodes, loss="out", inputs=(("logprobs", 1), ("x", 1))):
    placeholders = [
        {"op": "placeholder", "name": n, "target": n, "args": [], "kwargs": {}} for n, _ in inputs
    ]
    out = {
        "op": "output",
        "name": "output",
        "target": "output",
        "args": [{"tuple": [{"ref": loss}, {"dict": {}}]}],
    }
    return parse_custom_loss(
        "g", [{"name": n, "rank": r} for n, r in inputs], {"nodes": placeholders + list(nodes) + [out]}
    )


def call(name, target, *args, op="call_function", **kwargs):
    return {"op": op, "name": name, "target": target, "args": list(args), "kwargs": kwargs}


R = {"ref": "logprobs"}


def test_python_values_cannot_grow_without_bound():
    lp, x = torch.zeros(3, requires_grad=True), torch.ones(3)
    cases = [
        (
            call("p", "operator.pow", 3, 30),
            call("big", "operator.pow", {"ref": "p"}, 100),
            "node 'big'.*exponent of at most 64",
        ),
        (call("p", "operator.pow", 10, 60), call("n", "torch.exp", R), "node 'p'.*beyond 2\\*\\*63"),
        (call("s", "operator.mul", "abc", 1000), call("n", "torch.exp", R), "node 's'.*got a str"),
        (call("l", "operator.mul", [1, 2], 10**6), call("n", "torch.exp", R), "node 'l'.*got a list"),
        (
            call("a", "getattr", R, "shape"),
            call("n", "getattr", {"ref": "a"}, "shape"),
            "node 'n'.*only a tensor's",
        ),
        (call("z", "torch.arange", 0, 1, 1e-9), call("n", "torch.exp", R), "node 'z'.*arange asks for"),
        (
            call("z", "torch.full", [4096, 4096], 1.0),
            call("n", "operator.mul", {"ref": "z"}, {"ref": "z"}),
            "",
        ),
    ]
    for first, second, match in cases:
        g = graph(first, second, call("out", "sum", R, op="call_method"))
        if match:
            with pytest.raises(CustomLossError, match=match):
                run(g, lp, [x])
        else:  # 16M elements exactly: allowed
            run(g, lp, [x])


def test_devices_are_the_losses_own_and_creations_land_there():
    g = graph(
        call("d", "getattr", R, "device"),
        call("z", "torch.zeros", 3, device={"device": "cuda:7"}),
        call("s", "operator.add", R, {"ref": "z"}),
        call("out", "sum", {"ref": "s"}, op="call_method"),
    )
    res = loss_and_grad(g, torch.tensor([-1.0, -2.0, -3.0]), [torch.ones(3)])
    assert res.loss == -6.0 and res.grad.tolist() == [1.0, 1.0, 1.0]


def test_indexing_and_stacking_are_bounded_by_their_shapes_before_they_run():
    idx = torch.zeros(5000, dtype=torch.long)
    lp = torch.zeros(3, requires_grad=True)
    x = torch.ones(5000, 4000)  # 20M elements would be refused as made; as an input it is read only
    rank2 = (("logprobs", 1), ("x", 2), ("i", 1))
    for node, match in (
        (call("g", "operator.getitem", {"ref": "x"}, {"ref": "i"}), "node 'g'.*20000000 elements"),
        (call("g", "torch.stack", [{"ref": "x"}] * 3), "node 'g'.*60000000 elements"),
        (call("g", "index_select", {"ref": "x"}, 0, {"ref": "i"}, op="call_method"), "20000000 elements"),
    ):
        g = graph(node, call("out", "sum", R, op="call_method"), inputs=rank2)
        with pytest.raises(CustomLossError, match=match):
            run(g, lp, [x, idx])
