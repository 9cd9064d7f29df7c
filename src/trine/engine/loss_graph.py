"""A custom loss as plain data: the graph the official `tinker` 0.38 client traces with torch.fx and
sends to `create_custom_loss`, checked against trine's own list of allowed operations.

The client encodes each node as `{op, name, target, args, kwargs}` (tinker/types/custom_loss_graph.py):
arguments are JSON scalars, lists, or one-key objects (`{"ref": node}`, `{"tuple": [...]}`,
`{"dict": {...}}`, `{"slice": [a, b, c]}`, `{"ellipsis": true}`, `{"float": "inf"}`, `{"dtype": ...}`,
`{"device": ...}`, `{"layout": ...}`, `{"memory_format": ...}`). `parse_custom_loss` turns that into
a `CustomLoss` of frozen dataclasses, or raises ValueError naming the first bad part
(`graph.nodes[3].target: 'os.system' is not an allowed operation`). The trainer's interpreter
(engine/trainer/custom_graph.py) maps the names below to torch callables; nothing else is callable.

Invariants
- Torch-free: the server checks a graph at `create_custom_loss` without the engine; a graph that
  passes names only operations in `FUNCTIONS` / `METHODS`, attributes in `ATTRIBUTES`, and refers
  only to earlier nodes (so it has no cycle), at most `MAX_NODES` of them.
- Constants are finite numbers, bools, None, short strings, or the named torch constants below;
  integers are bounded, and a constant size asks for at most `MAX_ELEMENTS` elements.
- Placeholders come first, one per declared input in order (`logprobs` first, rank 1); the last
  node is the output `(loss, {metric: node})`, metrics named like the client's `custom/<x>:sum|mean`.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field

MAX_NODES = 1024
MAX_INPUTS = 16
MAX_ITEMS = 64  # entries of one list, tuple or dict argument
MAX_DEPTH = 4  # nesting of list/tuple/dict arguments
MAX_STRING = 64
MAX_INT = 1 << 31
MAX_ELEMENTS = 1 << 24  # any one tensor a custom loss makes or receives (64 MiB of float32)
MAX_INPUT_ELEMENTS = 1 << 22  # one input of one datum

_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]{0,63}")
_INPUT_NAME = re.compile(r"[a-z_][a-z0-9_]{0,63}")
METRIC_KEY = re.compile(r"custom/[a-z0-9_./-]{1,64}:(sum|mean)")

_ELEMENTWISE = (
    "abs neg exp exp2 expm1 log log1p log2 log10 sqrt rsqrt square pow sigmoid tanh relu sign sin cos erf "
    "floor ceil round trunc reciprocal clamp clip clamp_min clamp_max minimum maximum where lerp "
    "logaddexp add sub mul div true_divide isfinite isnan nan_to_num logical_and logical_or logical_not "
    "eq ne lt le gt ge masked_fill"
)
_REDUCTIONS = (
    "sum mean prod amax amin max min logsumexp cumsum std var argmax argmin all any count_nonzero "
    "softmax log_softmax nansum nanmean"
)
_SHAPES = (
    "stack cat squeeze unsqueeze reshape flatten transpose gather index_select narrow select flip roll diff"
)
_CREATE = "zeros_like ones_like full_like zeros ones full arange broadcast_to numel"
FUNCTIONS = frozenset(
    [f"torch.{n}" for n in f"{_ELEMENTWISE} {_REDUCTIONS} {_SHAPES} {_CREATE}".split()]
    + [
        f"torch.nn.functional.{n}"
        for n in (
            "log_softmax softmax relu sigmoid mse_loss l1_loss smooth_l1_loss huber_loss "
            "binary_cross_entropy_with_logits kl_div normalize"
        ).split()
    ]
    + ["torch._C._nn.log_sigmoid", "torch._C._nn.softplus"]  # F.logsigmoid and F.softplus
    + [
        f"operator.{n}"
        for n in (
            "add sub mul truediv floordiv mod pow neg pos abs getitem lt le gt ge eq ne and_ or_ invert"
        ).split()
    ]
    + [f"math.{n}" for n in "sqrt exp log log1p log2 log10 floor ceil fabs pow tanh".split()]
    + ["getattr"]  # only a tensor's ATTRIBUTES
)
METHODS = frozenset(
    f"{_ELEMENTWISE} {_REDUCTIONS} squeeze unsqueeze reshape flatten transpose gather index_select narrow "
    "select flip roll diff detach clone contiguous float double half bfloat16 long int bool to type_as "
    "view view_as reshape_as expand expand_as permute t size dim numel new_zeros new_ones new_full "
    "repeat".split()
)
ATTRIBUTES = frozenset({"shape", "ndim", "dtype", "device", "T", "mT"})
# Calls whose integer arguments are sizes: checked against MAX_ELEMENTS before they run.
SIZED = frozenset(
    {"torch.zeros", "torch.ones", "torch.full", "torch.broadcast_to"}
    | {"new_zeros", "new_ones", "new_full", "expand", "repeat"}
)
DTYPES = frozenset({"float32", "float64", "float16", "bfloat16", "int64", "int32", "bool"})
LAYOUTS = frozenset({"strided"})
MEMORY_FORMATS = frozenset({"contiguous_format", "preserve_format"})


@dataclass(frozen=True)
class Ref:
    """The value of an earlier node (its index in `CustomLoss.nodes`)."""

    index: int


@dataclass(frozen=True)
class Constant:
    """A named torch constant: kind is dtype, device, layout or memory_format. A device means the
    device the loss runs on, whatever the client named."""

    kind: str
    value: str


@dataclass(frozen=True)
class Slice:
    start: object = None
    stop: object = None
    step: object = None


ELLIPSIS = Constant("ellipsis", "...")


@dataclass(frozen=True, eq=False)
class Node:
    op: str  # placeholder, call_function, call_method (the output is CustomLoss.loss / metrics)
    name: str
    target: str
    args: tuple = ()
    kwargs: dict = field(default_factory=dict)


@dataclass(frozen=True, eq=False)
class LossTensor:
    """One custom loss input of one datum: row-major values of `shape` (() for a scalar)."""

    shape: tuple[int, ...]
    values: list
    dtype: str = "float32"  # float32 or int64, as the client sent it


@dataclass(frozen=True, eq=False)
class CustomLoss:
    """A checked custom loss graph (compared by identity: one object per `create_custom_loss`)."""

    name: str
    inputs: tuple[tuple[str, int], ...]  # (name, rank), logprobs first
    nodes: tuple[Node, ...]  # the placeholders first
    loss: Ref
    metrics: tuple[tuple[str, Ref], ...]
    loss_id: str = ""

    @property
    def input_names(self) -> tuple[str, ...]:
        """The loss_fn_inputs keys the loss reads, in the order it takes them."""
        return tuple(name for name, _ in self.inputs[1:])


def parse_custom_loss(name, inputs, graph, loss_id: str = "") -> CustomLoss:
    """The `create_custom_loss` body's `name`, `inputs` and `graph` as a CustomLoss; ValueError
    naming the field otherwise."""
    if not isinstance(name, str) or not name or len(name) > 128:
        raise ValueError("name: a loss name of 1 to 128 characters")
    decl = _inputs(inputs)
    if not isinstance(graph, dict) or set(graph) - {"format", "nodes"}:
        raise ValueError("graph: an object with format and nodes")
    if graph.get("format", 1) != 1:
        raise ValueError(f"graph.format {graph.get('format')!r}: trine reads format 1")
    raw = graph.get("nodes")
    if not isinstance(raw, list) or not raw:
        raise ValueError("graph.nodes: a non-empty list of nodes")
    if len(raw) > MAX_NODES:
        raise ValueError(f"graph.nodes: {len(raw)} nodes; a custom loss has at most {MAX_NODES}")
    top = _Scope({n["name"] for n in raw if isinstance(n, dict) and isinstance(n.get("name"), str)})
    nodes: list[Node] = []
    for i, n in enumerate(raw):
        where = f"graph.nodes[{i}]"
        if not isinstance(n, dict) or not {"op", "name", "target"} <= set(n) <= {
            "op",
            "name",
            "target",
            "args",
            "kwargs",
        }:
            raise ValueError(f"{where}: an object with op, name, target, args and kwargs")
        op, nname, target = n["op"], n["name"], n["target"]
        if not isinstance(nname, str) or not _NAME.fullmatch(nname):
            raise ValueError(f"{where}.name: {str(nname)[:80]!r} is not a node name (letters, digits, _)")
        if nname in top.nodes:
            raise ValueError(f"{where}.name: {nname!r} is used by graph.nodes[{top.nodes[nname]}] already")
        if not isinstance(target, str) or len(target) > 128:
            raise ValueError(f"{where}.target: a string of at most 128 characters")
        args, kwargs = n.get("args", []), n.get("kwargs", {})
        if not isinstance(args, list) or not isinstance(kwargs, dict):
            raise ValueError(f"{where}: args is a list and kwargs an object")
        if i < len(decl):
            if op != "placeholder" or target != decl[i][0] or args or kwargs:
                raise ValueError(
                    f"{where}: input {i} is placeholder {decl[i][0]!r}, as the inputs declare "
                    f"(got {str(op)[:40]} {target[:80]!r})"
                )
        elif op == "placeholder":
            raise ValueError(f"{where}: placeholder {target[:80]!r} is not one of the declared inputs")
        elif op == "output":
            if i != len(raw) - 1:
                raise ValueError(f"{where}: the output must be the last node")
            loss, metrics = _output(args, kwargs, top.at(nname), where)
            return CustomLoss(name, decl, tuple(nodes), loss, metrics, loss_id)
        elif op in ("call_function", "call_method"):
            _check_target(op, target, where)
            scope = top.at(nname)
            decoded_args = tuple(_arg(a, scope, f"{where}.args[{k}]", 0) for k, a in enumerate(args))
            decoded_kwargs = {}
            for key, value in kwargs.items():
                if not _NAME.fullmatch(key) or key.startswith("__"):
                    raise ValueError(f"{where}.kwargs: {key[:80]!r} is not a keyword argument name")
                if key == "out":
                    raise ValueError(f"{where}.kwargs.out: writing into a tensor in place is not allowed")
                decoded_kwargs[key] = _arg(value, scope, f"{where}.kwargs.{key}", 0)
            _check_call(op, target, decoded_args, decoded_kwargs, where)
            nodes.append(Node(op, nname, target, decoded_args, decoded_kwargs))
            top.nodes[nname] = i
            continue
        elif op in ("get_attr", "call_module"):
            raise ValueError(
                f"{where}.op: {op!r} is not allowed: a custom loss reads only logprobs and its "
                "inputs, and calls functions (no captured tensors or torch.nn modules)"
            )
        else:
            raise ValueError(f"{where}.op: {str(op)[:80]!r} is not a node kind")
        nodes.append(Node("placeholder", nname, target))
        top.nodes[nname] = i
    raise ValueError(f"graph.nodes[{len(raw) - 1}]: the last node must be the output (loss, metrics)")


def _inputs(inputs) -> tuple[tuple[str, int], ...]:
    if not isinstance(inputs, list) or not inputs:
        raise ValueError("inputs: a list of {name, rank}, logprobs first")
    if len(inputs) > MAX_INPUTS:
        raise ValueError(f"inputs: {len(inputs)} inputs; a custom loss takes at most {MAX_INPUTS}")
    out = []
    for k, x in enumerate(inputs):
        if not isinstance(x, dict) or set(x) != {"name", "rank"}:
            raise ValueError(f"inputs[{k}]: an object with name and rank")
        name, rank = x["name"], x["rank"]
        if not isinstance(name, str) or not _INPUT_NAME.fullmatch(name):
            raise ValueError(f"inputs[{k}].name: {str(name)[:80]!r} is not a lowercase input name")
        if type(rank) is not int or rank not in (0, 1, 2):
            raise ValueError(f"inputs[{k}].rank: {rank!r}; a rank is 0, 1 or 2")
        if any(name == seen for seen, _ in out):
            raise ValueError(f"inputs[{k}].name: {name!r} is declared twice")
        out.append((name, rank))
    if out[0] != ("logprobs", 1):
        raise ValueError(
            "inputs[0]: logprobs with rank 1 ([T], one target per position: trine scores one "
            f"target token per position), got {out[0]}"
        )
    return tuple(out)


def _check_target(op: str, target: str, where: str) -> None:
    allowed = FUNCTIONS if op == "call_function" else METHODS
    if target in allowed:
        return
    if "__" in target:
        raise ValueError(f"{where}.target: {target[:80]!r} is a dunder name; these are never allowed")
    if op == "call_method" and target.endswith("_"):
        raise ValueError(
            f"{where}.target: method {target[:80]!r} works in place, which is not allowed; use "
            f"{target[:-1]!r}, which returns a new tensor"
        )
    kind = "an allowed operation" if op == "call_function" else "an allowed tensor method"
    raise ValueError(
        f"{where}.target: {target[:80]!r} is not {kind} (custom losses may use elementwise and "
        "reduction functions of torch, torch.nn.functional, math and operator; see the Tinker page)"
    )


def _check_call(op: str, target: str, args: tuple, kwargs: dict, where: str) -> None:
    if target == "getattr":
        if len(args) != 2 or kwargs or not isinstance(args[0], Ref) or not _one_of(args[1], ATTRIBUTES):
            raise ValueError(
                f"{where}: getattr may only read a tensor's {', '.join(sorted(ATTRIBUTES))}, got "
                f"{str(args[1:2])[:80]}"
            )
    if op == "call_method" and (not args or not isinstance(args[0], Ref)):
        raise ValueError(f"{where}.args[0]: a method call's first argument is the tensor (a node)")
    if target in SIZED:
        numel = constant_numel(target, args, kwargs)
        if numel > MAX_ELEMENTS:
            raise ValueError(
                f"{where}: {target} asks for {numel} elements; a custom loss's tensors hold at most "
                f"{MAX_ELEMENTS}"
            )


def size_args(target: str, args: tuple, kwargs: dict) -> tuple:
    """The arguments of a SIZED call that give its output's size (`repeat`'s multiply its input's)."""
    if target in ("torch.full", "torch.broadcast_to", "new_full"):
        k = 0 if target == "torch.full" else 1
        return (args[k] if len(args) > k else kwargs.get("size"),)
    if target in ("torch.zeros", "torch.ones"):
        return (args, kwargs.get("size"))
    return args[1:]  # new_zeros, new_ones, expand, repeat: after the tensor


def constant_numel(target: str, args: tuple, kwargs: dict) -> int:
    """The product of the positive integers among a SIZED call's size arguments."""
    out = 1
    for value in _flat(size_args(target, args, kwargs)):
        if isinstance(value, int) and not isinstance(value, bool) and value > 0:
            out *= value
    return out


def _flat(value):
    if isinstance(value, (list, tuple)):
        for v in value:
            yield from _flat(v)
    else:
        yield value


@dataclass
class _Scope:
    """What a node's arguments may refer to: the nodes before it (name -> index)."""

    names: set  # every node name of the graph, to tell a later node from an unknown one
    nodes: dict = field(default_factory=dict)
    me: str = ""

    def at(self, me: str) -> "_Scope":
        return _Scope(self.names, self.nodes, me)


def _arg(value, scope: _Scope, where: str, depth: int):
    if depth > MAX_DEPTH:
        raise ValueError(f"{where}: arguments nest at most {MAX_DEPTH} deep")
    if value is None or isinstance(value, bool):
        return value
    if isinstance(value, int):
        if abs(value) > MAX_INT:
            raise ValueError(f"{where}: integer {value} is beyond +-{MAX_INT}")
        return value
    if isinstance(value, float):
        if not math.isfinite(value):
            raise ValueError(f"{where}: {value} is not a finite number")
        return value
    if isinstance(value, str):
        if len(value) > MAX_STRING:
            raise ValueError(f"{where}: a string of at most {MAX_STRING} characters")
        return value
    if isinstance(value, list):
        return [_arg(v, scope, f"{where}[{k}]", depth + 1) for k, v in enumerate(_items(value, where))]
    if not isinstance(value, dict) or len(value) != 1:
        raise ValueError(f"{where}: not an encoded argument (a scalar, a list or a one-key object)")
    ((kind, body),) = value.items()
    if kind == "ref":
        if not isinstance(body, str) or body not in scope.nodes:
            if isinstance(body, str) and body == scope.me:
                what = "itself (a cycle)"
            elif isinstance(body, str) and body in scope.names:
                what = f"node {body!r}, which comes later (a cycle or an out-of-order graph)"
            else:
                what = f"{str(body)[:80]!r}, which is no node of the graph"
            raise ValueError(f"{where}: refers to {what}; a node may use only the nodes before it")
        return Ref(scope.nodes[body])
    if kind == "tuple" and isinstance(body, list):
        return tuple(_arg(v, scope, f"{where}[{k}]", depth + 1) for k, v in enumerate(_items(body, where)))
    if kind == "dict" and isinstance(body, dict):
        if any(not isinstance(k, str) or len(k) > MAX_STRING for k in body):
            raise ValueError(f"{where}: dict keys are strings of at most {MAX_STRING} characters")
        return {k: _arg(v, scope, f"{where}.{k}", depth + 1) for k, v in _items(body, where).items()}
    if kind == "slice" and isinstance(body, list) and len(body) == 3:
        parts = [_arg(v, scope, f"{where}.slice[{k}]", depth + 1) for k, v in enumerate(body)]
        if not all(p is None or isinstance(p, (int, Ref)) for p in parts):
            raise ValueError(f"{where}: slice bounds are integers, nodes or null")
        return Slice(*parts)
    if kind == "ellipsis" and body is True:
        return ELLIPSIS
    if kind == "float":
        raise ValueError(f"{where}: {str(body)[:20]} is not a finite number; use a large finite value")
    names = {"dtype": DTYPES, "layout": LAYOUTS, "memory_format": MEMORY_FORMATS}
    if kind in names and _one_of(body, names[kind]):
        return Constant(kind, body)
    if kind == "device" and isinstance(body, str) and len(body) <= MAX_STRING:
        return Constant("device", "")  # the loss runs where the trainer puts it
    raise ValueError(f"{where}: {{{str(kind)[:20]!r}: ...}} is not an encoded argument trine accepts")


def _one_of(value, names: frozenset) -> bool:
    """`value` is one of `names` (never hashes a client's list or object)."""
    return isinstance(value, str) and value in names


def _items(value, where: str):
    if len(value) > MAX_ITEMS:
        raise ValueError(
            f"{where}: {len(value)} entries; a list, tuple or dict argument has at most {MAX_ITEMS}"
        )
    return value


def _output(args: list, kwargs: dict, scope: _Scope, where: str):
    if len(args) != 1 or kwargs:
        raise ValueError(f"{where}.args: the output has one argument, (loss, metrics)")
    out = _arg(args[0], scope, f"{where}.args[0]", 0)
    if not (isinstance(out, (tuple, list)) and len(out) == 2 and isinstance(out[0], Ref)):
        raise ValueError(f"{where}.args[0]: the loss returns (loss, metrics) with loss a tensor node")
    metrics = out[1]
    if not isinstance(metrics, dict):
        raise ValueError(f"{where}.args[0][1]: the metrics are a dict of tensor nodes")
    for key, value in metrics.items():
        if not METRIC_KEY.fullmatch(key):
            raise ValueError(
                f"{where}.args[0][1]: metric {key[:80]!r} must be named custom/<name>:sum or "
                "custom/<name>:mean in lowercase"
            )
        if not isinstance(value, Ref):
            raise ValueError(f"{where}.args[0][1].{key}: a metric is a tensor node")
    return out[0], tuple(metrics.items())
