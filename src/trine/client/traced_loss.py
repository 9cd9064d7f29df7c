"""Custom losses the server runs: `trine.custom_loss(fn, input_ranks)` traces a per-datum torch loss
with torch.fx into plain data (the official Tinker client's graph format), which
`TrainingClient.forward_backward_custom(data, traced)` sends with its data: one forward and one
backward on the server, instead of a forward, the loss here, and a second forward and backward.

`fn(logprobs, *inputs) -> (loss, metrics)` runs once per datum and the losses are summed: `logprobs`
is the datum's target logprobs ([T], 0 where the target is -100), each further parameter names a
`loss_fn_inputs` key, read as a tensor. Metrics are scalar tensors named `custom/<name>:sum` or
`custom/<name>:mean`. The server accepts only its allowlist of elementwise and reduction operations
(docs/protocols/tinker.md, "Custom losses") and names the node it refuses.

Invariant: importing this module imports no torch; tracing does.
"""

from __future__ import annotations

import inspect
import math
from dataclasses import dataclass, field
from typing import Any, Callable

from ..errors import ValidationError


@dataclass(frozen=True)
class TracedLoss:
    """A traced custom loss: its wire form (`name`, `inputs`, `graph`) and the traced module, so the
    same loss also runs locally (`forward_backward_custom(..., server_side=False)`)."""

    name: str
    inputs: tuple[tuple[str, int], ...]  # (name, rank), logprobs first
    graph: dict = field(repr=False)
    module: Any = field(repr=False, compare=False)  # torch.fx.GraphModule

    @property
    def input_names(self) -> tuple[str, ...]:
        return tuple(name for name, _ in self.inputs[1:])

    def wire(self) -> dict:
        """The loss's `loss_fn_config` on the PyTRIO plane."""
        return {
            "name": self.name,
            "inputs": [{"name": n, "rank": r} for n, r in self.inputs],
            "graph": self.graph,
        }

    def __call__(self, data, logprobs_list):
        """The batch-level form `forward_backward_custom` runs locally: the per-datum losses summed,
        `:mean` metrics averaged over the datums."""
        total, sums = None, {}
        for datum, logprobs in zip(data, logprobs_list, strict=True):
            inputs = [datum.loss_fn_inputs[name].to_torch() for name in self.input_names]
            loss, metrics = self.module(logprobs, *inputs)
            total = loss if total is None else total + loss
            for k, v in metrics.items():
                sums[k] = sums.get(k, 0.0) + float(v.detach())
        return total, {k: v / len(data) if k.endswith(":mean") else v for k, v in sums.items()}


def custom_loss(fn: Callable, input_ranks: dict[str, int]) -> TracedLoss:
    """Trace `fn(logprobs, *inputs) -> (loss, metrics)`; `input_ranks` gives each parameter's rank
    (0 scalar, 1 [T], 2 [T, K]; logprobs is 1)."""
    try:
        import torch.fx
    except ImportError as e:
        raise ValidationError("custom_loss needs torch installed", code="dependency.missing_torch") from e
    name = getattr(fn, "__name__", type(fn).__name__)
    params = list(inspect.signature(fn).parameters)
    if not params or params[0] != "logprobs":
        raise ValidationError(
            f"custom_loss: {name} must take logprobs first, then the loss_fn_inputs it reads"
        )
    if set(input_ranks) != set(params):
        raise ValidationError(
            f"custom_loss: input_ranks must give a rank for each parameter of {name} ({', '.join(params)}), "
            f"got {sorted(input_ranks)}"
        )
    try:
        module = torch.fx.symbolic_trace(fn)
    except Exception as e:  # noqa: BLE001 - tracing errors are the user's
        raise ValidationError(
            f"custom_loss: {name} cannot be traced by torch.fx ({e}); a custom loss cannot branch on "
            "tensor values or call libraries other than torch and math"
        ) from None
    nodes = [_node(node) for node in module.graph.nodes]
    inputs = tuple((p, int(input_ranks[p])) for p in params)
    return TracedLoss(name, inputs, {"format": 1, "nodes": nodes}, module)


def _node(node) -> dict:
    from torch.fx.node import _get_qualified_name

    if node.op == "call_function":
        target = _get_qualified_name(node.target)
        if target.startswith("_operator."):  # Python operators: named by their public module
            target = "operator." + target.removeprefix("_operator.")
    else:
        target = str(node.target)
    return {
        "op": node.op,
        "name": node.name,
        "target": target,
        "args": [_arg(a) for a in node.args],
        "kwargs": {k: _arg(a) for k, a in node.kwargs.items()},
    }


def _arg(a):
    import torch
    import torch.fx

    if isinstance(a, torch.fx.Node):
        return {"ref": a.name}
    if isinstance(a, float) and not math.isfinite(a):
        return {"float": str(a)}  # the server refuses it, naming the node
    if a is None or isinstance(a, (bool, int, float, str)):
        return a
    if isinstance(a, list):
        return [_arg(x) for x in a]
    if isinstance(a, tuple):
        return {"tuple": [_arg(x) for x in a]}
    if isinstance(a, dict):
        return {"dict": {str(k): _arg(v) for k, v in a.items()}}
    if isinstance(a, slice):
        return {"slice": [_arg(x) for x in (a.start, a.stop, a.step)]}
    if a is Ellipsis:
        return {"ellipsis": True}
    kinds = {
        torch.dtype: "dtype",
        torch.device: "device",
        torch.layout: "layout",
        torch.memory_format: "memory_format",
    }
    kind = kinds.get(type(a))
    if kind is None:
        raise ValidationError(f"custom_loss: a {type(a).__name__} argument cannot be sent to the server")
    return {kind: str(a).removeprefix("torch.")}
