"""Which kernel a few-row base-weight GEMM of an inference forward takes: the candidates, and the
dispatch over the choice measured at the engine's start (gemm_choice.py).

Candidates (`CANDIDATES`), each serving a dtype where `available(dtype)` (it runs in that dtype
and passes its self-check there), each `prepare(weight) -> handle`,
`run(x, handle, bias) -> y` and the memory a handle takes beside its weight (`extra_bytes`):
- `packed`: MKL's packed weights (packed.py), fp32 only;
- `onednn`: oneDNN with prepacked weights (onednn.py), fp32 and bf16;
- `transposed`: the same GEMM laid out the other way, `(weight @ x^T)^T`, no copy, any dtype: at
  8-32 rows MKL streams a large weight faster so on some CPUs, slower elsewhere (measured, like the
  rest; docs/serving.md);
- `linear`: plain `F.linear`, no copy, any dtype.

Invariants
- Only calls `admits` takes a candidate: inference-mode CPU GEMMs in one of `DTYPES` (fp32, bf16;
  input and weight of one dtype) of at most `MAX_ROWS` rows, torch's batch-invariant kernels off
  (invariant.py never calls here then); every other call is F.linear. Every candidate's result is
  F.linear's in that dtype up to its rounding (rounding.py).
- The mode and the choice are per dtype (the weight's): an fp32 and a bf16 engine in one process
  each keep their own. `mode[dtype]` is "auto" or a candidate's name (`EngineConfig.gemm`), set by
  the engine's start. Forced, every admitted call in that dtype takes that candidate (F.linear
  where it does not serve the dtype). In auto, a call takes the candidate chosen for its weight's
  dtype and shape at the smallest row bucket at or above its row count (`BUCKETS`); a dtype, shape
  or bucket not measured takes `packed` where it serves the dtype, up to `packed.MAX_ROWS` rows
  (where its packing pays), F.linear otherwise (bf16 always: packed is fp32 only).
- A candidate never takes a call in a dtype it does not serve: `path` checks `available(dtype)`
  whatever the choice says.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn.functional as F

from . import onednn, packed

# The row buckets measured: a decode step's rows (1 to max_running, 64 by default) and prefill chunks
# (min_prefill_tokens 128 up to max_batch_tokens, 2048 by default); more rows are F.linear.
BUCKETS = (1, 8, 32, 128, 512, 1024, 2048)
MAX_ROWS = BUCKETS[-1]
DTYPES = (torch.float32, torch.bfloat16)  # the dtypes whose few-row GEMMs take a candidate


def transposed(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """F.linear(x, weight, bias) as `weight @ x^T`, returned contiguous in F.linear's layout."""
    rows = x.reshape(-1, x.shape[-1])
    y = torch.mm(weight, rows.t()).t().contiguous()
    if bias is not None:
        y += bias
    return y.view(*x.shape[:-1], weight.shape[0])


@dataclass(frozen=True)
class Candidate:
    name: str
    available: Callable[[torch.dtype], bool]  # whether it serves a dtype here (runs, passes its check)
    prepare: Callable[[torch.Tensor], object]
    run: Callable[[torch.Tensor, object, torch.Tensor | None], torch.Tensor]
    extra_bytes: Callable[[torch.Tensor, object], int]  # (weight, handle) -> bytes beside the weight
    copies: bool = False  # keeps a copy of each weight (within packed.budget_bytes(), or not taken)


CANDIDATES = {
    "packed": Candidate(
        "packed",
        lambda dtype: dtype == torch.float32 and packed.available(),
        packed.prepare,
        packed.run,
        lambda w, h: h[0].nbytes,
        copies=True,
    ),
    "onednn": Candidate(
        "onednn", onednn.available, onednn.prepare, onednn.run, lambda w, h: w.nbytes, copies=True
    ),
    "transposed": Candidate("transposed", lambda dtype: True, lambda w: w, transposed, lambda w, h: 0),
    "linear": Candidate(
        "linear", lambda dtype: True, lambda w: w, lambda x, w, b: F.linear(x, w, b), lambda w, h: 0
    ),
}
MODES = ("auto", *CANDIDATES)

# Per dtype (its name, `dtype_name`): absent is auto, unmeasured.
mode: dict[str, str] = {}  # dtype -> "auto" or a candidate's name
choice: dict[str, dict[tuple[int, int], dict[int, str]]] = {}  # dtype -> (out, in) -> bucket -> candidate
# The same for the candidates that keep no copy: taken where the chosen one's copy did not fit.
copy_free: dict[str, dict[tuple[int, int], dict[int, str]]] = {}
_NAMES = {dt: str(dt).removeprefix("torch.") for dt in DTYPES}  # path() runs per GEMM: no str()


def dtype_name(dtype: torch.dtype) -> str:
    """`float32`, `bfloat16`: the key of a dtype's mode and choice."""
    return _NAMES.get(dtype) or str(dtype).removeprefix("torch.")


def set_choice(
    new_mode: str,
    new_choice: dict[tuple[int, int], dict[int, str]],
    dtype: torch.dtype = torch.float32,
    new_copy_free: dict[tuple[int, int], dict[int, str]] | None = None,
) -> None:
    """Install the mode of engines in `dtype` and, in auto, their measured choice and copy-free
    choice (gemm_choice.py); the other dtypes' are kept."""
    if new_mode not in MODES:
        raise ValueError(f"gemm: {new_mode!r} is not one of {', '.join(MODES)}")
    key = dtype_name(dtype)
    mode[key], choice[key], copy_free[key] = new_mode, dict(new_choice), dict(new_copy_free or {})


def reset() -> None:
    """Every dtype back to auto, unmeasured."""
    mode.clear()
    choice.clear()
    copy_free.clear()


def bucket(rows: int) -> int | None:
    """The smallest bucket at or above `rows`; None above the largest."""
    i = bisect.bisect_left(BUCKETS, rows)
    return BUCKETS[i] if i < len(BUCKETS) else None


def admits(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether `linear(owner, x, weight, bias)` may take a candidate (the module docstring)."""
    return packed.few_rows(x, weight, MAX_ROWS, DTYPES)


def path(x: torch.Tensor, weight: torch.Tensor) -> str:
    """The candidate `linear(owner, x, weight, bias)` takes (see the module docstring)."""
    if not admits(x, weight):
        return "linear"
    dtype = weight.dtype
    key = dtype_name(dtype)
    name = mode.get(key, "auto")
    if name == "auto":
        name = _measured(choice, x, weight) or default(x.numel() // x.shape[-1])
    return name if CANDIDATES[name].available(dtype) else "linear"


def _measured(table: dict, x: torch.Tensor, weight: torch.Tensor) -> str | None:
    """`table`'s (`choice`'s or `copy_free`'s) candidate for this call's dtype, weight shape and row
    bucket; None where that was not measured."""
    rows = x.numel() // x.shape[-1]
    return table.get(dtype_name(weight.dtype), {}).get(tuple(weight.shape), {}).get(bucket(rows))


def default(rows: int) -> str:
    """The candidate a call of `rows` rows takes where nothing was measured (the module docstring),
    and in fp32 the one a measurement keeps unless another is measurably faster
    (gemm_choice.incumbent)."""
    return "packed" if rows <= packed.MAX_ROWS else "linear"


def linear(owner: object, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """F.linear(x, weight, bias) through the chosen candidate, its copy of `weight` kept by `owner`;
    where that copy does not fit packed.budget_bytes(), through the copy-free choice."""
    name = path(x, weight)
    if name == "packed" or name == "onednn":
        y = (packed if name == "packed" else onednn).linear(owner, x, weight, bias)
        if y is not None:
            return y
        name = _copy_free_path(x, weight)
    if name == "transposed":
        return transposed(x, weight, bias)
    return F.linear(x, weight, bias)


def _copy_free_path(x: torch.Tensor, weight: torch.Tensor) -> str:
    """The copy-free candidate measured fastest for this call's shape and bucket, else F.linear."""
    if mode.get(dtype_name(weight.dtype), "auto") != "auto":
        return "linear"
    return _measured(copy_free, x, weight) or "linear"


def summary(dtype: torch.dtype = torch.float32) -> str:
    """The path of engines in `dtype`, for the start line and /metrics: a forced candidate's name
    (F.linear's where it does not serve the dtype), or `auto(packed 20, onednn 8, linear 2)`: how
    many (shape, bucket) pairs each candidate won."""
    key = dtype_name(dtype)
    forced = mode.get(key, "auto")
    if forced != "auto":
        return forced if CANDIDATES[forced].available(dtype) else "linear"
    if not choice.get(key):
        return "auto(unmeasured)"
    counts: dict[str, int] = {}
    for per_bucket in choice[key].values():
        for name in per_bucket.values():
            counts[name] = counts.get(name, 0) + 1
    return "auto(" + ", ".join(f"{n} {c}" for n, c in sorted(counts.items(), key=lambda kv: -kv[1])) + ")"
