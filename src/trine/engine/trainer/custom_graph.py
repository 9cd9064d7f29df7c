"""Running a checked custom loss graph (engine/loss_graph.py) with a strict interpreter.

Every name a graph may call is looked up in `_CALLABLES`, built once from the allowlist out of the
torch, math and operator modules; a method call reads only an allowlisted attribute of a
`torch.Tensor`, and `getattr` only a tensor's ATTRIBUTES. Nothing is imported, evaluated or looked
up by a name the client chose outside those lists.

Bounds, checked while it runs: before a call, the broadcast of its tensor arguments, the sizes it
asks for (zeros, expand, repeat, ...) and the output of the same call on meta tensors (shapes only:
indexing, gathers, stacks) hold at most MAX_ELEMENTS; after it, every tensor it made does;
Python integer arithmetic stays within 2**63 (operator.pow of two integers takes an exponent of at
most 64); operator functions take only tensors and numbers (getitem also tuples and sizes), so no
string or list is ever multiplied. A call that fails raises ValueError naming the node.

`loss_and_grad` runs the loss on one datum and returns its value, its metrics and the gradient of
the loss with respect to the datum's logprobs: the trainer's single backward pass then uses that
gradient like a cross_entropy weight (engine/trainer/losses.py, "custom").
"""

from __future__ import annotations

import functools
import math
import operator
from dataclasses import dataclass

import torch

from ..loss_graph import (
    ATTRIBUTES,
    FUNCTIONS,
    MAX_ELEMENTS,
    METHODS,
    SIZED,
    Constant,
    CustomLoss,
    LossTensor,
    Ref,
    Slice,
    constant_numel,
)

_ROOTS = {"torch": torch, "math": math, "operator": operator}
_DTYPES = {
    "float32": torch.float32,
    "float64": torch.float64,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "int64": torch.int64,
    "int32": torch.int32,
    "bool": torch.bool,
}
_OTHER = {
    ("layout", "strided"): torch.strided,
    ("memory_format", "contiguous_format"): torch.contiguous_format,
    ("memory_format", "preserve_format"): torch.preserve_format,
}
_MAX_PY_INT = 1 << 63
_CREATES = frozenset({"torch.zeros", "torch.ones", "torch.full", "torch.arange"})


def _resolve(name: str):
    root, *path = name.split(".")
    return functools.reduce(getattr, path, _ROOTS[root])


_CALLABLES = {name: _resolve(name) for name in FUNCTIONS if name != "getattr"}
_VALUES = (torch.Tensor, int, float, bool, torch.dtype, torch.device, torch.Size, type(None))


class CustomLossError(ValueError):
    code = "custom_loss_failed"


@dataclass
class Result:
    loss: float
    metrics: dict[str, float]
    grad: torch.Tensor  # dloss/dlogprobs, the shape of logprobs


def input_tensor(t: LossTensor, device) -> torch.Tensor:
    dtype = torch.int64 if t.dtype == "int64" else torch.float32
    return torch.tensor(t.values, dtype=dtype, device=device).reshape(t.shape)


def run(loss: CustomLoss, logprobs: torch.Tensor, inputs: list[torch.Tensor]):
    """(loss tensor, {metric: tensor}) of `loss` on one datum; CustomLossError naming the node if
    a node fails or breaks a bound."""
    env: list = [logprobs, *inputs]
    device = logprobs.device
    for node in loss.nodes[len(env) :]:
        where = f"custom loss {loss.name!r}, node {node.name!r} ({node.target})"
        args = tuple(_value(a, env, device) for a in node.args)
        kwargs = {k: _value(v, env, device) for k, v in node.kwargs.items()}
        try:
            out = _call(node.op, node.target, args, kwargs, device)
        except CustomLossError as e:
            raise CustomLossError(f"{where}: {e}") from None
        except Exception as e:  # noqa: BLE001 - torch's own errors (shapes, dtypes) are the user's
            raise CustomLossError(f"{where} failed: {type(e).__name__}: {str(e)[:300]}") from None
        _check_out(out, where)
        env.append(out)
    value = env[loss.loss.index]
    if not isinstance(value, torch.Tensor) or value.numel() != 1 or not value.is_floating_point():
        raise CustomLossError(f"custom loss {loss.name!r} must return a scalar float tensor as its loss")
    metrics = {}
    for key, ref in loss.metrics:
        m = env[ref.index]
        if not isinstance(m, (torch.Tensor, int, float)) or (isinstance(m, torch.Tensor) and m.numel() != 1):
            raise CustomLossError(f"custom loss {loss.name!r}: metric {key!r} must be a scalar")
        metrics[key] = m
    return value.reshape(()), metrics


def loss_and_grad(loss: CustomLoss, logprobs: torch.Tensor, inputs: list[torch.Tensor]) -> Result:
    """Run `loss` on one datum's logprobs ([T], fp32) and inputs; its value, metrics and gradient."""
    with torch.enable_grad():
        x = logprobs.detach().float().requires_grad_(True)
        value, metrics = run(loss, x, inputs)
        if not value.requires_grad:
            raise CustomLossError(
                f"custom loss {loss.name!r} does not depend on logprobs: it has no gradient to train on"
            )
        try:
            (grad,) = torch.autograd.grad(value, x, allow_unused=True)
        except RuntimeError as e:  # an operation torch cannot differentiate
            raise CustomLossError(f"custom loss {loss.name!r} has no gradient: {str(e)[:300]}") from None
    if grad is None:
        grad = torch.zeros_like(x)
    return Result(
        float(value.detach()), {k: float(torch.as_tensor(v).detach()) for k, v in metrics.items()}, grad
    )


def _value(a, env: list, device):
    if isinstance(a, Ref):
        return env[a.index]
    if isinstance(a, Constant):
        if a.kind == "dtype":
            return _DTYPES[a.value]
        if a.kind == "device":
            return device
        if a.kind == "ellipsis":
            return Ellipsis
        return _OTHER[(a.kind, a.value)]
    if isinstance(a, Slice):
        return slice(*(_value(x, env, device) for x in (a.start, a.stop, a.step)))
    if isinstance(a, tuple):
        return tuple(_value(x, env, device) for x in a)
    if isinstance(a, list):
        return [_value(x, env, device) for x in a]
    if isinstance(a, dict):
        return {k: _value(v, env, device) for k, v in a.items()}
    return a


def _call(op: str, target: str, args: tuple, kwargs: dict, device):
    _check_sizes(target, args, kwargs)
    if op == "call_method":
        assert target in METHODS
        if not isinstance(args[0], torch.Tensor):
            raise CustomLossError(f"method {target} is called on a {type(args[0]).__name__}, not a tensor")
        _check_meta(lambda a, k: getattr(a[0], target)(*a[1:], **k), args, kwargs)
        return getattr(args[0], target)(*args[1:], **kwargs)
    if target == "getattr":
        obj, name = args
        if not isinstance(obj, torch.Tensor) or name not in ATTRIBUTES:
            raise CustomLossError(f"getattr reads only a tensor's {', '.join(sorted(ATTRIBUTES))}")
        return getattr(obj, name)
    fn = _CALLABLES[target]
    if target.startswith(("operator.", "math.")):
        _check_python_operands(target, args)
        _check_meta(lambda a, k: fn(*a, **k), args, kwargs)
        out = fn(*args, **kwargs)
        if isinstance(out, int) and abs(out) >= _MAX_PY_INT:
            raise CustomLossError("the integer result is beyond 2**63")
        return out
    if target in _CREATES:  # made on the device the loss runs on, like its inputs
        _check_meta(lambda a, k: fn(*a, **k), args, {**kwargs, "device": "meta"}, always=True)
        kwargs = {**kwargs, "device": device}
    else:
        _check_meta(lambda a, k: fn(*a, **k), args, kwargs)
    return fn(*args, **kwargs)


def _check_meta(call, args: tuple, kwargs: dict, always: bool = False) -> None:
    """Run `call` on meta tensors (shapes, no data, nothing allocated) and refuse an output over
    MAX_ELEMENTS: this bounds indexing, gathers and the like exactly. Calls meta cannot run (their
    shape depends on values, as a boolean mask's) keep the bounds of `_check_sizes`."""
    if not always and not any(isinstance(a, torch.Tensor) for a in _flat_values((args, kwargs))):
        return
    try:
        out = call(_to_meta(args), _to_meta(kwargs))
    except Exception:  # noqa: BLE001 - not shape-computable on meta: the real call decides
        return
    for x in _flat_values(out):
        if isinstance(x, torch.Tensor) and x.numel() > MAX_ELEMENTS:
            raise CustomLossError(
                f"it would make a tensor of {x.numel()} elements; the most is {MAX_ELEMENTS}"
            )


def _to_meta(value):
    if isinstance(value, torch.Tensor):
        return torch.empty(value.shape, dtype=value.dtype, device="meta")
    if isinstance(value, list):
        return [_to_meta(v) for v in value]
    if isinstance(value, tuple) and not isinstance(value, torch.Size):  # a structseq becomes a tuple
        return tuple(_to_meta(v) for v in value)
    if isinstance(value, dict):
        return {k: _to_meta(v) for k, v in value.items()}
    return value


def _flat_values(value):
    if isinstance(value, (list, tuple)) and not isinstance(value, torch.Size):
        for v in value:
            yield from _flat_values(v)
    elif isinstance(value, dict):
        for v in value.values():
            yield from _flat_values(v)
    else:
        yield value


def _check_python_operands(target: str, args: tuple) -> None:
    allowed = (torch.Tensor, int, float, bool)
    if target == "operator.getitem":
        allowed += (tuple, list, torch.Size)
        if not isinstance(args[0], allowed):
            raise CustomLossError(f"cannot index a {type(args[0]).__name__}")
        return
    for a in args:
        if not isinstance(a, allowed):
            raise CustomLossError(f"takes tensors and numbers, got a {type(a).__name__}")
    if target in ("operator.pow", "math.pow") and all(isinstance(a, int) for a in args) and abs(args[1]) > 64:
        raise CustomLossError("an integer power takes an exponent of at most 64")


def _check_sizes(target: str, args: tuple, kwargs: dict) -> None:
    shapes = [a.shape for a in (*args, *kwargs.values()) if isinstance(a, torch.Tensor)]
    if len(shapes) > 1:
        try:
            numel = math.prod(torch.broadcast_shapes(*shapes))
        except RuntimeError:
            numel = 0  # not broadcast together (cat, stack, gather): the call checks its own shapes
        if numel > MAX_ELEMENTS:
            raise CustomLossError(f"its arguments broadcast to {numel} elements; the most is {MAX_ELEMENTS}")
    if target in SIZED:
        numel = constant_numel(target, args, kwargs)
        if target == "repeat":
            numel *= args[0].numel()
        if numel > MAX_ELEMENTS:
            raise CustomLossError(f"it asks for {numel} elements; the most is {MAX_ELEMENTS}")
    if target == "torch.arange":
        numel = _arange_numel(args, kwargs)
        if numel > MAX_ELEMENTS:
            raise CustomLossError(f"arange asks for {numel} elements; the most is {MAX_ELEMENTS}")


def _arange_numel(args: tuple, kwargs: dict) -> float:
    named = dict(zip(("end",) if len(args) == 1 else ("start", "end", "step"), args))
    bounds = {
        "start": 0,
        "step": 1,
        **named,
        **{k: kwargs[k] for k in ("start", "end", "step") if k in kwargs},
    }
    try:
        return math.ceil(abs((float(bounds["end"]) - float(bounds["start"])) / float(bounds["step"])))
    except (KeyError, TypeError, ValueError, ZeroDivisionError, OverflowError):
        return 0  # not numbers: torch refuses the call


def _check_out(out, where: str) -> None:
    items = out if isinstance(out, (tuple, list)) and not isinstance(out, torch.Size) else (out,)
    if isinstance(out, (tuple, list)) and len(items) > 64:
        raise CustomLossError(f"{where}: returned {len(items)} values")
    for x in items:
        if not isinstance(x, _VALUES):
            raise CustomLossError(f"{where}: returned a {type(x).__name__}, which a custom loss cannot hold")
        if isinstance(x, torch.Tensor) and x.numel() > MAX_ELEMENTS:
            raise CustomLossError(
                f"{where}: made a tensor of {x.numel()} elements; the most is {MAX_ELEMENTS}"
            )
        if isinstance(x, int) and not isinstance(x, bool) and abs(x) >= _MAX_PY_INT:
            raise CustomLossError(f"{where}: the integer result is beyond 2**63")
