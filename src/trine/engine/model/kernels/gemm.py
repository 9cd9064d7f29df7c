"""Which kernel a few-row base-weight GEMM of an inference forward takes: the candidates, and the
dispatch over the choice measured at the engine's start (gemm_choice.py).

Candidates (`CANDIDATES`), each `prepare(weight) -> handle`, `run(x, handle, bias) -> y` and the
memory a handle takes beside its weight (`extra_bytes`):
- `packed`: MKL's packed weights (packed.py);
- `onednn`: oneDNN with prepacked weights (onednn.py);
- `linear`: plain `F.linear` (sgemm), no copy.
fp32 only: bf16 variants are not candidates.

Invariants
- Only calls `packed.few_rows` admits take a candidate (inference-mode fp32 CPU GEMMs of at most
  `MAX_ROWS` rows, torch's batch-invariant kernels off: invariant.py never calls here then);
  every other call is F.linear. Every candidate's result is F.linear's up to float32 rounding.
- `mode` is "auto" or a candidate's name (`EngineConfig.gemm`), set by the engine's start, one per
  process. Forced, every admitted call takes that candidate (F.linear where it is not available).
  In auto, a call takes the candidate chosen for its weight's shape at the smallest row bucket at or
  above its row count (`BUCKETS`); a shape or bucket not measured takes `packed` where available up
  to `packed.MAX_ROWS` rows (where its packing pays), F.linear above.
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


@dataclass(frozen=True)
class Candidate:
    name: str
    available: Callable[[], bool]
    prepare: Callable[[torch.Tensor], object]
    run: Callable[[torch.Tensor, object, torch.Tensor | None], torch.Tensor]
    extra_bytes: Callable[[torch.Tensor, object], int]  # (weight, handle) -> bytes beside the weight


CANDIDATES = {
    "packed": Candidate("packed", packed.available, packed.prepare, packed.run, lambda w, h: h[0].nbytes),
    "onednn": Candidate("onednn", onednn.available, onednn.prepare, onednn.run, lambda w, h: w.nbytes),
    "linear": Candidate(
        "linear", lambda: True, lambda w: w, lambda x, w, b: F.linear(x, w, b), lambda w, h: 0
    ),
}
MODES = ("auto", *CANDIDATES)

mode = "auto"
choice: dict[tuple[int, int], dict[int, str]] = {}  # (out, in) -> bucket -> candidate (auto)


def set_choice(new_mode: str, new_choice: dict[tuple[int, int], dict[int, str]]) -> None:
    """Install the engine's mode and, in auto, its measured choice (gemm_choice.py)."""
    global mode, choice
    if new_mode not in MODES:
        raise ValueError(f"gemm: {new_mode!r} is not one of {', '.join(MODES)}")
    mode, choice = new_mode, dict(new_choice)


def bucket(rows: int) -> int | None:
    """The smallest bucket at or above `rows`; None above the largest."""
    i = bisect.bisect_left(BUCKETS, rows)
    return BUCKETS[i] if i < len(BUCKETS) else None


def path(x: torch.Tensor, weight: torch.Tensor) -> str:
    """The candidate `linear(owner, x, weight, bias)` takes (see the module docstring)."""
    if not packed.few_rows(x, weight, MAX_ROWS):
        return "linear"
    if mode == "auto":
        rows = x.numel() // x.shape[-1]
        chosen = choice.get(tuple(weight.shape), {}).get(bucket(rows))
        name = chosen or ("packed" if rows <= packed.MAX_ROWS else "linear")
    else:
        name = mode
    return name if CANDIDATES[name].available() else "linear"


def linear(owner: object, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """F.linear(x, weight, bias) through the chosen candidate, its copy of `weight` kept by `owner`."""
    name = path(x, weight)
    if name == "packed":  # its copies are kept within packed.budget_bytes() there
        return packed.linear(owner, x, weight, bias)
    if name == "onednn":
        return onednn.linear(owner, x, weight, bias)
    return F.linear(x, weight, bias)


def summary() -> str:
    """The path for the start line and /metrics: a forced candidate's name, or
    `auto(packed 20, onednn 8, linear 2)`: how many (shape, bucket) pairs each candidate won."""
    if mode != "auto":
        return mode if CANDIDATES[mode].available() else "linear"
    if not choice:
        return "auto(unmeasured)"
    counts: dict[str, int] = {}
    for per_bucket in choice.values():
        for name in per_bucket.values():
            counts[name] = counts.get(name, 0) + 1
    return "auto(" + ", ".join(f"{n} {c}" for n, c in sorted(counts.items(), key=lambda kv: -kv[1])) + ")"
