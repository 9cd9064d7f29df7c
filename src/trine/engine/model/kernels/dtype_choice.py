"""The model dtype `--dtype auto` runs on a CPU, chosen by measurement on this machine at the
engine's start and cached on disk beside the GEMM choice (gemm_choice.py).

bfloat16 halves the bytes a forward reads and, on CPUs with bf16 dot products (AMX on Intel Xeon,
AVX512-BF16 on AMD EPYC and Intel), can double the GEMM rate or more; elsewhere it is emulated and
slower than fp32. Its numerics are those of a bf16 CUDA run (docs/numerics.md: fp32 norms,
softmax, logits, LoRA and optimizer state), held by tests/engine/test_dtype_parity.py. So `auto`
takes bf16 on a CPU only where the model's own GEMMs run at least `MIN_SPEEDUP` times faster in
bf16's fastest kernel than in fp32's, at a decode step's rows and at a prefill chunk's
(`ROWS`), each shape weighted by how many GEMMs of it a forward runs; on CUDA it is bf16.

Invariants
- Each dtype's time is the fastest of the GEMM candidates available in it (gemm.py: packed,
  oneDNN, F.linear in fp32; oneDNN, F.linear in bf16), the kernels an engine in that dtype would
  take; all run in turns, so the machine's drift hits both alike. Where bf16 F.linear's result is
  not within bf16's rounding bound of fp32's (a broken kernel), auto is fp32 (the other bf16
  candidates are within bf16 rounding of bf16 F.linear: their own self-check, `available`).
- The choice is cached under the same key parts as the GEMM choice (CPU model and flags, torch and
  its libraries' versions, threads, shapes) and each dtype's candidates: a second start measures
  nothing. A forced `--dtype` measures nothing.
- `TRINE_AUTO_DTYPE=float32` (or `bfloat16`) pins what auto means without measuring: for a fleet
  that must run one dtype whatever its CPUs, and for the test suite, whose fp32 bounds are an fp32
  engine's.
- GEMMs above `gemm_choice.MAX_MEASURED_FLOP` are not timed (the LM head at prefill rows: the
  sampler computes logits at each sequence's last position only).
"""

from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from ...config import DTYPE_NAMES
from . import gemm, gemm_choice, rounding

log = logging.getLogger(__name__)

MIN_SPEEDUP = 2.0  # bf16's whole-forward GEMM time must be at most half of fp32's, in both regimes
PIN = "TRINE_AUTO_DTYPE"  # the environment variable that pins auto's answer
ROWS = (16, 256)  # a decode step of 16 sequences; a prefill chunk of 256 prompt positions
TURNS = 5
timings = 0  # GEMM calls timed in this process (tests count them: a cached start adds none)


@dataclass(frozen=True)
class DtypeChoice:
    dtype: torch.dtype
    speedup: float | None  # bf16 over fp32, the smaller of the two regimes; None: not measured
    reason: str  # how it was chosen, for the start line


def choose(counts: dict[tuple[int, int], int], device: torch.device) -> DtypeChoice:
    """The dtype of `--dtype auto` for a model whose forward runs `counts` GEMMs of each (out, in)
    weight shape (lora.linear_shape_counts) on `device`."""
    pinned = os.environ.get(PIN)
    if pinned:
        if pinned not in DTYPE_NAMES:
            raise ValueError(f"{PIN}: {pinned!r} is not one of {', '.join(DTYPE_NAMES)}")
        return DtypeChoice(getattr(torch, pinned), None, f"auto, {PIN}={pinned}")
    if device.type != "cpu":
        return DtypeChoice(torch.bfloat16, None, f"auto, on {device.type}")
    key = {
        **gemm_choice.cache_key(sorted(counts), []),
        "counts": sorted([o, i, n] for (o, i), n in counts.items()),
        "candidates": {gemm.dtype_name(dt): [c.name for c in _candidates(dt)] for dt in gemm.DTYPES},
    }
    key.update(kind="dtype", rows=list(ROWS), min_speedup=MIN_SPEEDUP)
    path = gemm_choice.cache_path(key, "dtype-choice")
    speedup = gemm_choice.read_cached(path, key)
    if not isinstance(speedup, (int, float)):
        speedup = measure(counts)
        gemm_choice.write_cached(path, key, speedup)
    dtype = torch.bfloat16 if speedup >= MIN_SPEEDUP else torch.float32
    return DtypeChoice(
        dtype, speedup, f"auto, bf16 GEMMs {speedup:.2f}x fp32's here, bf16 needs {MIN_SPEEDUP:g}x"
    )


def _candidates(dtype: torch.dtype) -> list[gemm.Candidate]:
    """The GEMM candidates an engine in `dtype` may take on this machine."""
    return [c for c in gemm.CANDIDATES.values() if c.available(dtype)]


def measure(counts: dict[tuple[int, int], int]) -> float:
    """bf16's speedup over fp32 on this machine: min over `ROWS` of sum(count x fp32 seconds) /
    sum(count x bf16 seconds), each the fastest candidate's in its dtype; 0.0 where bf16 fails its
    rounding check."""
    start = time.monotonic()
    cands = {dt: _candidates(dt) for dt in (torch.float32, torch.bfloat16)}
    log.info("dtype: timing %d GEMM shapes in fp32 and bf16, once for this machine", len(counts))
    gen = torch.Generator().manual_seed(0)
    speedups = []
    with torch.inference_mode():
        for rows in ROWS:
            total = {"fp32": 0.0, "bf16": 0.0}
            for (out_f, in_f), n in counts.items():
                if 2 * rows * out_f * in_f > gemm_choice.MAX_MEASURED_FLOP:
                    continue
                w = torch.randn(out_f, in_f, generator=gen) / in_f**0.5
                x = torch.randn(rows, in_f, generator=gen)
                times = _time_pair(cands, x, w)
                if times is None:
                    log.warning(
                        "dtype: bf16 GEMM off fp32 beyond bf16 rounding at %s: fp32", (rows, out_f, in_f)
                    )
                    return 0.0
                total["fp32"] += n * times[0]
                total["bf16"] += n * times[1]
            speedups.append(total["fp32"] / total["bf16"] if total["bf16"] else 0.0)
    log.info("dtype: measured in %.1f s", time.monotonic() - start)
    return min(speedups)


def _time_pair(
    cands: dict[torch.dtype, list[gemm.Candidate]], x: torch.Tensor, w: torch.Tensor
) -> tuple[float, float] | None:
    """(the fastest fp32 candidate's median seconds, the fastest bf16 candidate's) on x @ w.T (x, w
    fp32; bf16 takes them rounded), timed in turns; None when bf16 F.linear's result is off fp32's
    beyond bf16 rounding."""
    global timings
    xb, wb = x.bfloat16(), w.bfloat16()
    want = F.linear(x, w)
    # bf16 rounds x and w (a relative 2^-8 each), then accumulates in fp32: 2 * 2^-8 + fp32's gamma_k
    bound = (2 * 2.0**-8 + 2 * rounding.gamma(x.shape[1])) * (x.abs() @ w.abs().t())
    got = F.linear(xb, wb).float()
    if not bool(((got - want).abs() <= 2 * bound + 1e-30).all()):
        return None
    inputs = {torch.float32: (x, w), torch.bfloat16: (xb, wb)}
    runs = {
        (dt, c.name): (c.run, c.prepare(inputs[dt][1]), inputs[dt][0]) for dt, cs in cands.items() for c in cs
    }
    for run, handle, inp in runs.values():  # warm-up: first-call costs are not the steady state
        run(inp, handle, None)
    samples: dict[tuple, list[float]] = {name: [] for name in runs}
    for _ in range(TURNS):
        for name, (run, handle, inp) in runs.items():
            t = time.perf_counter()
            run(inp, handle, None)
            samples[name].append(time.perf_counter() - t)
            timings += 1
    med = {name: sorted(s)[len(s) // 2] for name, s in samples.items()}
    fp32, bf16 = (min(med[(dt, c.name)] for c in cands[dt]) for dt in (torch.float32, torch.bfloat16))
    return fp32, bf16
