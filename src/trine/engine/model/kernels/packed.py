"""Base-weight GEMMs of few rows on CPU through MKL's packed-weight path: one of the GEMM candidates
the engine measures at its start (gemm.py), and the one a shape or row count not measured takes.

A decode step multiplies a few dozen rows by every weight of the model. MKL's plain sgemm repacks
the weight into its kernel's layout on every such call, and at these sizes the repacking costs as
much as the multiply. `cblas_sgemm_compute` on a weight packed once does not, up to `MAX_ROWS`
rows (the figures: docs/serving.md, "Memory for packed weights"). torch exposes the path as
`torch.ops.mkl._mkl_reorder_linear_weight` / `_mkl_linear` (what inductor uses for frozen CPU
linears).

Invariants
- Used only where nothing needs a gradient (the sampler's inference-mode forwards: decode steps
  and prefill chunks), for fp32 CPU tensors of at most `MAX_ROWS` rows, with torch's
  batch-invariant kernels off (they have their own fixed-shape GEMMs), and where this torch has
  MKL (`applies`; `few_rows` without the MKL check, which gemm.py's candidates share, in the
  dtypes they serve: fp32 and bf16). Everything else is `F.linear`: packed is fp32 only.
- The result is F.linear's up to float32 rounding (a different kernel, so the last bits may differ,
  as they already do between row counts).
- Packed copies take 2-9x their weight's memory (MKL adds about 10 MB of padding to each, which
  is never touched, so it is address space, not resident memory); those over `MAX_INFLATION` are
  dropped. They are made lazily, at a weight's first few-row call, while all of them fit in
  `budget_bytes()` (`TRINE_PACKED_GEMM_BYTES`, default 2 GiB; 0 turns the path off); past it,
  `linear` returns None and gemm.py takes the fastest copy-free kernel measured for the shape.
- Each owner (a module) keeps one packed copy, of the weight it last multiplied. The copy is made
  again when the weight is another tensor or was changed in place (its data pointer, shape, strides
  or version counter differ); the cache holds the weight it packed, so a freed weight's address
  cannot be reused under it.
- `_mkl_linear` takes the packed path only when the rows equal the count it is told the weight was
  packed for, else it falls back to sgemm; MKL's packed layout is valid for any count (checked
  once per process against F.linear: `available()`), so each call passes its own rows. The count
  given when packing (`PACK_ROWS`) sets the blocking MKL packs for, and so the speed, not the size
  or the result (`benchmarks/forward_rows.py --pack-rows N` measures it).
"""

from __future__ import annotations

import os
import threading
import weakref

import torch
import torch.nn.functional as F

from . import rounding

# Up to this many rows the packed path is faster than sgemm; above, within a few percent
# (`benchmarks/forward_rows.py`).
MAX_ROWS = 1024
PACK_ROWS = 256  # the row count packing is told: any is correct, this one fastest (docstring)
# A copy this many times its weight's size is dropped. MKL pads each copy by about 10 MB, so small
# weights inflate most; they still gain, and the padding is never touched (docs/serving.md, "Where
# the engine's constants come from"). The bound drops only weights so small that the padding dwarfs them.
MAX_INFLATION = 10.0
_packs: "weakref.WeakKeyDictionary[object, tuple]" = weakref.WeakKeyDictionary()
_available: bool | None = None
_lock = threading.Lock()  # the sampler's and the trainer's threads may pack at once


def budget_bytes() -> int:
    """The memory all packed copies together may take (`TRINE_PACKED_GEMM_BYTES`, default 2 GiB)."""
    return int(os.environ.get("TRINE_PACKED_GEMM_BYTES", 2 << 30))


def available() -> bool:
    """Whether this torch has MKL's packed linear and its results match F.linear for any row count."""
    global _available
    if _available is None:
        _available = _check()
    return _available


def _check() -> bool:
    mkl = getattr(torch.ops, "mkl", None)
    if not torch.backends.mkl.is_available() or not hasattr(mkl, "_mkl_linear"):
        return False
    return agrees_with_linear(prepare, run, rows=(1, 7, 65, PACK_ROWS))


def agrees_with_linear(prepare, run, rows: tuple[int, ...], dtype: torch.dtype = torch.float32) -> bool:
    """Whether a prepacked path (`prepare(weight) -> handle`, `run(x, handle, bias)`) gives
    F.linear's result in `dtype`, up to that dtype's rounding, for each row count in `rows` (a
    once-per-process check of this torch's kernels; gemm.py's candidates share it). fp32: within
    1e-4 (relative and absolute); bf16: within rounding.linear_bound of bf16 F.linear."""
    try:
        with torch.inference_mode():
            gen = torch.Generator().manual_seed(0)
            w, b = torch.randn(96, 80, generator=gen).to(dtype), torch.randn(96, generator=gen).to(dtype)
            handle = prepare(w)
            for m in rows:
                x = torch.randn(m, 80, generator=gen).to(dtype)
                got, want = run(x, handle, b), F.linear(x, w, b)
                if got.dtype != want.dtype or got.shape != want.shape:
                    return False
                if dtype == torch.float32:
                    if not torch.allclose(got, want, rtol=1e-4, atol=1e-4):
                        return False
                elif not bool(
                    ((got.float() - want.float()).abs() <= rounding.linear_bound(x, w, b, want)).all()
                ):
                    return False
    except (RuntimeError, AttributeError):
        return False
    return True


def weight_key(weight: torch.Tensor) -> tuple:
    """What a prepacked copy of `weight` was made from: its data pointer, shape, strides and version
    counter (an in-place change bumps it), so another or a changed weight gets a new copy."""
    return (weight.data_ptr(), tuple(weight.shape), weight.stride(), weight._version)


def prepare(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """`weight` packed by MKL, with the contiguous weight `_mkl_linear` also reads."""
    w = weight.detach().contiguous()
    return torch.ops.mkl._mkl_reorder_linear_weight(w, PACK_ROWS), w


def run(x: torch.Tensor, handle: tuple, bias: torch.Tensor | None) -> torch.Tensor:
    """x [..., in] times the packed weight (`prepare`'s handle), plus `bias`."""
    pack, w = handle
    rows = x.reshape(-1, x.shape[-1])
    return torch.ops.mkl._mkl_linear(rows, pack, w, bias, rows.shape[0]).view(*x.shape[:-1], w.shape[0])


def few_rows(
    x: torch.Tensor,
    weight: torch.Tensor,
    max_rows: int = MAX_ROWS,
    dtypes: tuple[torch.dtype, ...] = (torch.float32,),
) -> bool:
    """Whether `linear(x, weight)` is a few-row inference GEMM a prepacked weight may serve: the
    conditions of the module docstring but this torch's MKL, up to `max_rows` rows and in one of
    `dtypes` (gemm.py's candidates share them, up to its own bound and in its own dtypes)."""
    return (
        x.device.type == "cpu"
        and x.dtype == weight.dtype
        and x.dtype in dtypes
        and 0 < x.numel() // x.shape[-1] <= max_rows
        and not (torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad))
        and not weight.is_inference()  # no version counter: an in-place change could not be seen
    )


def applies(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether `linear(x, weight)` may take the packed path (see the module docstring)."""
    return few_rows(x, weight) and available()


def linear(
    owner: object, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None
) -> torch.Tensor | None:
    """F.linear(x, weight, bias) with `weight` packed once for `owner` (callers check `applies`);
    None where its copy did not fit (remembered: the caller takes a copy-free path)."""
    packed = _packed(owner, weight)
    return None if packed is None else run(x, (packed, weight), bias)


def _packed(owner: object, weight: torch.Tensor) -> torch.Tensor | None:
    """`owner`'s packed copy of `weight`, made now if it has none of this weight; None if the copy
    did not fit the budget (remembered: that weight stays on F.linear)."""
    key = weight_key(weight)
    held = _packs.get(owner)
    if held is not None and held[0] == key:
        return held[2]
    with _lock:
        return _pack(owner, weight, key)


def _pack(owner: object, weight: torch.Tensor, key: tuple) -> torch.Tensor | None:
    w = weight.detach() if weight.is_contiguous() else weight.detach().contiguous()
    budget = budget_bytes()
    others = sum(p.nbytes for o, (_, _, p) in _packs.items() if o is not owner and p is not None)
    packed = None
    if others + w.nbytes <= budget:  # the copy is larger still: worth trying only if the weight fits
        packed = torch.ops.mkl._mkl_reorder_linear_weight(w, PACK_ROWS)
        if packed.nbytes > MAX_INFLATION * w.nbytes or others + packed.nbytes > budget:
            packed = None
    _packs[owner] = (key, weight.detach(), packed)
    return packed
