"""The GEMM candidate per (weight shape, row bucket), chosen by measurement on this machine at the
engine's start and cached on disk, so that a second start measures nothing.

`choose(shapes, mode, dtype)` installs gemm.py's dispatch for engines in `dtype` (fp32 or bf16):
forced (`mode` a candidate's name) it measures nothing; in auto it reads the choice of this
machine, these shapes and this dtype from `cache_path()`, or measures it and writes it there. For
each shape and bucket (gemm.BUCKETS) every candidate available in the dtype runs `WARMUP` calls,
then `TIMED` timed ones, the candidates in turns, on inputs and weights in that dtype. The
candidate with the fastest median whose output passed the self-check wins, unless it is within
`MARGIN` of the incumbent (`incumbent`: in fp32 MKL's packed path up to its row bound, else
F.linear; in bf16 oneDNN), which then stays: a difference the measurement cannot tell from noise,
or one a timing loop shows and a forward does not, does not move the dispatch.
(The median, not the fastest call: a best-case call favoured bf16 F.linear, whose per-call weight
reorder is cheap on a weight the timing loop keeps in cache, and lost 20-40 % in bf16 decoding.)

Invariants
- The self-check: a candidate's output lies within the rounding bound of F.linear's in the same
  dtype (rounding.py: fp32 2 gamma_k sum|x||w| over the k-term dot products; bf16 that plus each
  result's rounding to bf16, 2^-8 of it); one that fails, or raises, is never chosen. `linear`
  (F.linear itself) always passes, so every pair has a choice.
- The cache key holds all that makes a measurement another one: the CPU model and flags
  (/proc/cpuinfo), torch's version, its MKL and oneDNN versions, torch's thread count, the shapes
  and buckets, the candidates available and the dtype (named in the key for dtypes other than
  fp32, so fp32's key is the one written before bf16 was measured, and its caches stay valid). A
  file is written aside and renamed (atomic); one that cannot be read or does not match is
  measured again.
- Beside the choice, the fastest candidate that keeps no copy of the weight (`copy_free_choice`) per
  shape and bucket: a chosen copy past packed.budget_bytes() (a large model's LM head) is not
  made, and the call takes that one, not F.linear.
- A pair whose GEMM exceeds `MAX_MEASURED_FLOP` (the LM head at prefill-sized rows: the sampler
  takes logits at each sequence's last position, only prompt logprobs take more) is not measured:
  it keeps gemm.py's default (`packed` in fp32, F.linear in bf16), so the first start stays within
  seconds.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import tempfile
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from . import cbuild, gemm, rounding

log = logging.getLogger(__name__)

WARMUP, TIMED = 2, 7
MARGIN = 0.05  # how much faster than the incumbent a candidate must be measured to be chosen
MAX_MEASURED_FLOP = 8e9  # 2 * rows * out * in of the largest GEMM timed (the LM head at 128 rows)
timings = 0  # candidate calls timed in this process (tests count them: a cached start adds none)


def choose(shapes: list[tuple[int, int]], mode: str = "auto", dtype: torch.dtype = torch.float32) -> str:
    """Install the dispatch for engines in `dtype` running a model whose linears have weight
    `shapes` [(out, in)]; return its summary (gemm.summary(dtype))."""
    if mode != "auto":
        gemm.set_choice(mode, {}, dtype)
        return gemm.summary(dtype)
    shapes = sorted(set(map(tuple, shapes)))
    names = [c.name for c in gemm.CANDIDATES.values() if c.available(dtype)]
    key = cache_key(shapes, names, dtype)
    path = cache_path(key)
    cached = _read(path, key)
    if cached is None:
        chosen, times = measure(shapes, names, dtype)
        cached = chosen, copy_free_choice(times)
        _write(path, key, *cached)
    gemm.set_choice("auto", cached[0], dtype, cached[1])
    return gemm.summary(dtype)


def copy_free_choice(times: dict) -> dict[tuple[int, int], dict[int, str]]:
    """From `measure`'s timings, the fastest passing candidate per shape and bucket among those that
    keep no copy of the weight (gemm.Candidate.copies): where a chosen copy does not fit the budget."""
    out: dict[tuple[int, int], dict[int, str]] = {}
    for shape, per in times.items():
        for rows, got in per.items():
            free = {n: t for n, t in got.items() if t is not None and not gemm.CANDIDATES[n].copies}
            out.setdefault(shape, {})[rows] = min(free, key=free.get) if free else "linear"
    return out


def measure(
    shapes: list[tuple[int, int]], names: list[str], dtype: torch.dtype = torch.float32
) -> tuple[dict[tuple[int, int], dict[int, str]], dict]:
    """The fastest passing candidate per shape and bucket in `dtype`, and every timing (seconds, or
    None where the self-check failed), as {shape: {bucket: {name: seconds}}}."""
    start = time.monotonic()
    buckets = {s: [b for b in gemm.BUCKETS if 2 * b * s[0] * s[1] <= MAX_MEASURED_FLOP] for s in shapes}
    log.info(
        "gemm: measuring %s in %s on %d shapes x row buckets (%d pairs), once for this machine",
        ", ".join(names),
        gemm.dtype_name(dtype),
        len(shapes),
        sum(map(len, buckets.values())),
    )
    chosen: dict[tuple[int, int], dict[int, str]] = {}
    times: dict = {}
    gen = torch.Generator().manual_seed(0)
    with torch.inference_mode():
        for (out_f, in_f), rows_list in buckets.items():
            w = (torch.randn(out_f, in_f, generator=gen) / in_f**0.5).to(dtype)
            for rows in rows_list:
                x = torch.randn(rows, in_f, generator=gen).to(dtype)
                want = F.linear(x, w)
                bound = rounding.linear_bound(x, w, None, want)
                got = _time([gemm.CANDIDATES[n] for n in names], x, w, want, bound)
                times.setdefault((out_f, in_f), {})[rows] = got
                passing = {n: t for n, t in got.items() if t is not None}
                chosen.setdefault((out_f, in_f), {})[rows] = _winner(passing, incumbent(rows, dtype))
    log.info("gemm: measured in %.1f s", time.monotonic() - start)
    return chosen, times


def incumbent(rows: int, dtype: torch.dtype) -> str:
    """The kernel a measurement keeps unless another is more than MARGIN faster. fp32: gemm.default
    (MKL's packed path up to its row bound, else F.linear). bf16: oneDNN over its prepacked weight,
    which ran trine's bf16 sampler 1.3-1.4x faster than bf16 F.linear end to end, more than a
    timing loop shows: F.linear reorders its weight on every call, cheaply while the loop keeps that
    one weight in cache, not while a forward streams all of them."""
    return gemm.default(rows) if dtype == torch.float32 else "onednn"


def _winner(times: dict[str, float], held: str) -> str:
    """The fastest of `times`, unless `held` (the incumbent) is among them and within MARGIN of it."""
    best = min(times, key=times.get)
    if held in times and times[best] > (1 - MARGIN) * times[held]:
        return held
    return best


def _time(cands: list[gemm.Candidate], x: torch.Tensor, w: torch.Tensor, want, bound) -> dict:
    """Each candidate's median seconds on x @ w.T, timed in turns (one call of each, `TIMED` times,
    so the machine's drift hits all alike); None for one that raises or fails the self-check."""
    global timings
    handles = {}
    for cand in cands:
        try:
            handle = cand.prepare(w)
            for _ in range(WARMUP):
                y = cand.run(x, handle, None)
        except RuntimeError as e:
            log.warning("gemm: %s failed (%s): not chosen", cand.name, e)
            continue
        if not bool(((y.float() - want.float()).abs() <= bound + 1e-30).all()):
            log.warning(
                "gemm: %s off F.linear beyond %s rounding at %s: not chosen",
                cand.name,
                gemm.dtype_name(x.dtype),
                tuple(x.shape),
            )
            continue
        handles[cand.name] = (cand, handle)
    samples: dict[str, list[float]] = {name: [] for name in handles}
    for _ in range(TIMED):
        for name, (cand, handle) in handles.items():
            t = time.perf_counter()
            cand.run(x, handle, None)
            samples[name].append(time.perf_counter() - t)
            timings += 1
    medians = {name: sorted(s)[len(s) // 2] for name, s in samples.items()}
    return {c.name: medians.get(c.name) for c in cands}


def _versions() -> list[str]:
    """torch's MKL and oneDNN versions, as its build configuration names them."""
    lines = torch.__config__.show().splitlines()
    return sorted(
        ln.strip() for ln in lines if "Math Kernel Library" in ln or "MKL-DNN" in ln or "oneDNN" in ln
    )


def cache_key(shapes: list[tuple[int, int]], names: list[str], dtype: torch.dtype = torch.float32) -> dict:
    """What a measurement of `shapes` by candidates `names` in `dtype` depends on (the module
    docstring); fp32's has no "dtype" entry, as before bf16 was measured."""
    key = {
        "cpu": cbuild.cpu_identity(),
        "torch": torch.__version__,
        "libraries": _versions(),
        "threads": torch.get_num_threads(),
        "shapes": [list(s) for s in shapes],
        "buckets": list(gemm.BUCKETS),
        "candidates": names,
        "max_measured_flop": MAX_MEASURED_FLOP,
        "statistic": f"median of {TIMED}, {MARGIN} margin to the incumbent",
    }
    if dtype != torch.float32:
        key["dtype"] = gemm.dtype_name(dtype)
    return key


def cache_path(key: dict, kind: str = "gemm-choice") -> Path:
    """Where the measurement `kind` of `key` is kept: beside the C kernels' builds (cbuild.kernel_dir())."""
    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:16]
    return cbuild.kernel_dir() / f"{kind}-{digest}.json"


def read_cached(path: Path, key: dict):
    """The value cached at `path` under exactly `key`, or None (no file, another key, unreadable)."""
    try:
        data = json.loads(path.read_text())
        return data["value"] if data["key"] == key else None
    except (OSError, ValueError, KeyError, TypeError):
        return None


def write_cached(path: Path, key: dict, value) -> None:
    """Cache `value` (JSON) under `key` at `path`: written aside and renamed, so a reader never sees
    half a file. A read-only cache only logs: the next start measures again."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile("w", dir=path.parent, delete=False, suffix=".tmp") as f:
            json.dump({"key": key, "value": value}, f, indent=1, sort_keys=True)
        os.replace(f.name, path)
    except OSError as e:
        log.warning("%s: not cached (%s)", path.name, e)


def _read(path: Path, key: dict):
    """(choice, copy-free choice) cached at `path` under `key`, or None."""
    value = read_cached(path, key)
    try:
        return None if value is None else (_shapes(value["chosen"]), _shapes(value["copy_free"]))
    except (ValueError, AttributeError, KeyError, TypeError):
        return None


def _shapes(value: dict) -> dict[tuple[int, int], dict[int, str]]:
    return {
        tuple(int(v) for v in shape.split("x")): {int(b): n for b, n in per.items()}
        for shape, per in value.items()
    }


def _write(path: Path, key: dict, *choices: dict[tuple[int, int], dict[int, str]]) -> None:
    chosen, free = ({f"{o}x{i}": per for (o, i), per in c.items()} for c in choices)
    write_cached(path, key, {"chosen": chosen, "copy_free": free})
