"""The process-wide settings an engine runs under, applied by `configure()`: once per process, at the
`trine` CLI's entry (before any command imports torch) and again at every engine's start (a worker
thread, a Ray replica's actor, where it is a no-op if already done). Importing trine.engine sets
nothing; only `configure()` does. A program that embeds a server (`start_server`) or an engine
calls it before it imports them (they load torch), as the benchmarks and examples do.

How OpenMP's threads wait between parallel regions, unless the environment already says
(`OMP_WAIT_POLICY` or `GOMP_SPINCOUNT`): libgomp's threads spin `SPIN_COUNT` times, then sleep
(`GOMP_SPINCOUNT`; Intel's libiomp, which has no such count, sleeps at once: `KMP_BLOCKTIME=0`). A
thread that has gone to sleep costs the next op a wake-up, and the Python between a forward's ops
is often longer than a short spin (the figures: docs/serving.md, "Shared CPU cores"). Spinning is a
loss only beside other busy processes, where threads that wait on each other burn their slices;
there the engine runs on fewer threads (runtime/cpu_share.py), and one thread waits for nobody.
Spinning without end (libgomp's default) is no faster than this count and never lets an idle
engine's threads sleep.

`OMP_WAIT_POLICY=ACTIVE` goes with the count (which still bounds the spin) for one reason: when two
threads have run parallel regions (a server's engine thread and its main thread), libgomp counts
more of its threads than cores and cuts every spin to a "throttled" count: 100 by default, 1000
under ACTIVE; at 100 every op of the engine thread's forward paid a wake-up.

The OpenMP runtime reads these variables once, when torch loads it: `configure()` sets them only
while torch is not yet imported in the process (after that they would not take effect, and are
not set, so `openmp_wait()` still tells what the runtime read).

It also keeps freed large blocks in the C allocator's heap for the next step (malloc.py):
otherwise every step's tensors of a few MB page-fault in afresh.
"""

from __future__ import annotations

import os
import sys

from .malloc import keep_freed_memory

# Pause-loop iterations between parallel regions (benchmarks/cpu_share.py compares counts).
SPIN_COUNT = 30000
WAIT_SETTINGS = ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")  # either one, set by the operator, is kept
DEFAULT_WAIT = {"OMP_WAIT_POLICY": "ACTIVE", "GOMP_SPINCOUNT": str(SPIN_COUNT)}  # in WAIT_SETTINGS order

_configured: list[str] | None = None


def openmp_wait() -> str:
    """How this process's OpenMP threads wait, as the environment told the runtime (a log line)."""
    named = [f"{name}={os.environ[name]}" for name in WAIT_SETTINGS if name in os.environ]
    return " ".join(named) or "libgomp default (spin)"


def configure() -> list[str]:
    """Apply the settings above once per process (later calls return the first call's answer):
    OpenMP's wait, if torch is not loaded yet and the operator set neither variable, and the C
    allocator's thresholds. Returns what this process runs under, one log line each."""
    global _configured
    if _configured is not None:
        return _configured
    if "torch" not in sys.modules and not os.environ.keys() & set(WAIT_SETTINGS):
        os.environ.update(DEFAULT_WAIT)
        os.environ.setdefault("KMP_BLOCKTIME", "0")
    _configured = [f"OpenMP wait: {openmp_wait()}", keep_freed_memory()]
    return _configured
