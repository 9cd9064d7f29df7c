"""Base-weight GEMMs of few rows on CPU through oneDNN with weights prepacked once.

torch exposes oneDNN's inner-product primitive as `torch.ops.mkldnn._reorder_linear_weight` (the
weight, reordered into the kernel's blocked layout for a given row count) and
`torch.ops.mkldnn._linear_pointwise` (what inductor's freezing path uses for CPU linears). One of
the GEMM candidates the engine measures at its start (gemm.py).

Invariants
- The same conditions as MKL's packed path (packed.py: inference-mode few-row CPU GEMMs, torch's
  batch-invariant kernels off), in fp32 or bf16; the result is F.linear's in that dtype up to its
  rounding (rounding.py; checked once per process and dtype: `available(dtype)`, and per shape and
  row bucket where the choice is measured). A dtype whose check fails is never served.
- The row count given when reordering is a hint for blocking; a reordered weight is correct for
  any row count (checked by `available()`).
- Each owner keeps one reordered copy, of the weight it last multiplied, made again when the weight
  is another tensor or was changed in place (as packed.py's). The copies take about their weight's
  size each and, together, at most `packed.budget_bytes()`; past it, `linear` says so (None).
"""

from __future__ import annotations

import threading
import weakref

import torch

from . import packed

PACK_ROWS = 64  # the row count the reorder is told: a blocking hint, never a correctness matter
_copies: "weakref.WeakKeyDictionary[object, tuple]" = weakref.WeakKeyDictionary()
DTYPES = (torch.float32, torch.bfloat16)  # the dtypes it may serve, where `available(dtype)`
_available: dict[torch.dtype, bool] = {}  # dtype -> its check's answer, once per process
_lock = threading.Lock()


def available(dtype: torch.dtype = torch.float32) -> bool:
    """Whether this torch has oneDNN's prepacked linear in `dtype` and it matches F.linear there."""
    got = _available.get(dtype)
    if got is None:
        got = _available[dtype] = _check(dtype)
    return got


def _check(dtype: torch.dtype) -> bool:
    ops = getattr(torch.ops, "mkldnn", None)
    if (
        dtype not in DTYPES
        or not torch.backends.mkldnn.is_available()
        or not hasattr(ops, "_linear_pointwise")
    ):
        return False
    return packed.agrees_with_linear(prepare, run, rows=(1, 7, 65, 300), dtype=dtype)


def prepare(weight: torch.Tensor) -> torch.Tensor:
    """`weight` reordered for oneDNN (an opaque mkldnn tensor of the weight's size)."""
    w = weight.detach() if weight.is_contiguous() else weight.detach().contiguous()
    return torch.ops.mkldnn._reorder_linear_weight(w, PACK_ROWS)


def run(x: torch.Tensor, handle: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """x [..., in] times the reordered weight, plus `bias`."""
    rows = x.reshape(-1, x.shape[-1])
    out = torch.ops.mkldnn._linear_pointwise(rows, handle, bias, "none", [], "")
    return out.view(*x.shape[:-1], out.shape[-1])


def linear(
    owner: object, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None
) -> torch.Tensor | None:
    """F.linear(x, weight, bias) with `weight` reordered once for `owner` (callers check the path);
    None where the copy does not fit the budget (remembered: the caller takes a copy-free path)."""
    key = packed.weight_key(weight)
    held = _copies.get(owner)
    if held is None or held[0] != key:
        with _lock:
            others = sum(n for o, (_, _, _, n) in _copies.items() if o is not owner)
            fits = others + weight.nbytes <= packed.budget_bytes()
            held = (key, weight.detach(), prepare(weight) if fits else None, weight.nbytes if fits else 0)
            _copies[owner] = held  # holds the weight: a freed weight's address is not reused under it
    return None if held[2] is None else run(x, held[2], bias)
