"""How this process's C allocator hands out and returns large blocks (glibc only).

Every engine step allocates tensors of a few to a few dozen MB and frees them within the step: a
decode step's logits and their softmax and log-softmax ([64, 49152] fp32: 12.5 MB each), a prefill
chunk's MLP activations ([2048, 3072] fp32: 25 MB). glibc serves a block above its mmap threshold
(128 KiB at first, raised as such blocks are freed, but the heap's top is trimmed back to the
kernel whenever more than twice that is free) with fresh pages from the kernel, and each page then
faults when first written (what that cost a decode-heavy batch: docs/serving.md, "Memory kept
between steps", benchmarks/allocator.py).

`keep_freed_memory()` sets a fixed mmap threshold of `MMAP_THRESHOLD` and a trim threshold of
`TRIM_THRESHOLD`, so such blocks come from the heap and freed ones stay there for the next step,
and one arena for every thread: a thread other than the main one (a server's engine thread) gets
an arena of its own otherwise, made of 64 MiB heaps that glibc unmaps as they empty, and its run
page-faulted as much as with glibc's defaults (tests/engine/test_malloc.py). The costs: up to
`TRIM_THRESHOLD` of freed memory at the heap's top stays with the process after a peak (it is
reused by the next step, not lost), and threads that allocate at once wait on one lock (the
engine's steps are one thread's). An operator who tunes glibc's allocator
(`GLIBC_TUNABLES` naming `glibc.malloc`, or a `MALLOC_*_` variable) is left alone, and so is a
process whose C library is not glibc (musl, macOS); `TRINE_MALLOC=default` keeps glibc's default.
"""

from __future__ import annotations

import ctypes
import os
import platform

M_TRIM_THRESHOLD, M_MMAP_THRESHOLD, M_ARENA_MAX = -1, -3, -8  # glibc's mallopt parameter numbers (malloc.h)
MMAP_THRESHOLD = 64 * 2**20  # blocks below this come from the heap: every per-step tensor here
TRIM_THRESHOLD = 256 * 2**20  # free memory at the heap's top kept for the next step
OPERATOR_SETTINGS = (
    "MALLOC_MMAP_THRESHOLD_",
    "MALLOC_TRIM_THRESHOLD_",
    "MALLOC_TOP_PAD_",
    "MALLOC_ARENA_MAX",
)
ENV_NAMES = ("TRINE_MALLOC", "GLIBC_TUNABLES", *OPERATOR_SETTINGS)  # every name that changes the outcome

_applied: str | None = None


def keep_freed_memory() -> str:
    """Apply the thresholds above once per process, unless an operator tuned glibc's allocator or
    the C library is not glibc. Returns what this process's allocator does (a log line)."""
    global _applied
    if _applied is not None:
        return _applied
    if os.environ.get("TRINE_MALLOC") == "default":
        _applied = "C allocator: the default (TRINE_MALLOC=default)"
    elif "glibc.malloc" in os.environ.get("GLIBC_TUNABLES", "") or os.environ.keys() & set(OPERATOR_SETTINGS):
        _applied = "glibc malloc: the operator's settings"
    elif platform.libc_ver()[0] != "glibc":
        _applied = "C allocator: the platform's default (not glibc)"
    else:
        libc = ctypes.CDLL(None)
        ok = libc.mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD) and libc.mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD)
        ok = ok and libc.mallopt(M_ARENA_MAX, 1)
        _applied = (
            f"glibc malloc: mmap threshold {MMAP_THRESHOLD >> 20} MiB, "
            f"trim threshold {TRIM_THRESHOLD >> 20} MiB, one arena"
            if ok
            else "glibc malloc: the default (mallopt refused a setting)"
        )
    return _applied
