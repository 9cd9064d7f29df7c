"""How many intra-op threads the engine runs on: its own count, less the cores other processes use.

`trine.engine.setup.configure()` makes OpenMP's threads spin a while between parallel regions
(`SPIN_COUNT`), because a thread that has gone to sleep costs the next op a wake-up (docs/serving.md,
"Shared CPU cores").
Beside another busy process the same spin is a loss: two threads that wait on each other, one of
them descheduled, burn their slices spinning, and decoding keeps well under a fair share of its
speed alone. One thread waits for nobody. So the engine measures, every
`INTERVAL` seconds of work, how busy the CPUs it may run on were and how much of that was this
process; the rest is other processes, and the engine runs on the cores they leave it.

Invariants
- threads = min(configured, cores - cores other processes kept busy, rounded), at least 1, where
  cores are the CPUs this process may run on (`os.sched_getaffinity`) and their busy time is read
  from their lines of /proc/stat (so a container pinned to a few CPUs of a busy host counts only
  those). A new count is taken only when two readings in a row ask for it, so a blip moves nothing.
- Called from the thread that runs the engine's torch ops, between steps: torch's thread count is
  that thread's (OpenMP's and MKL's settings are per thread).
- Nothing changes where /proc/stat cannot be read (not Linux), with `TRINE_CPU_SHARE=0`, or under
  `--batch-invariant` (the engine worker's choice: its bit-for-bit numerics hold for a fixed
  thread count). Elsewhere a thread count change moves results in their last bits, as a batch's
  composition already does.
"""

from __future__ import annotations

import ctypes
import logging
import os
import time
from typing import Callable

import torch

log = logging.getLogger("trine.cpu_share")

INTERVAL = 0.25  # seconds of engine work between readings
STALE = 5.0  # a reading older than this (the engine was idle) starts a new window instead
_TICK = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


def fair_threads(configured: int, cores: int, others_busy: float) -> int:
    """The thread count that leaves other processes the cores they use (`others_busy`, in cores)."""
    return max(1, min(configured, round(cores - others_busy)))


def busy_seconds(cpus: set[int], stat: str | None = None) -> float | None:
    """CPU seconds the CPUs `cpus` have been busy since boot (user, nice, system, irq, softirq;
    not idle, iowait or steal), from /proc/stat's per-CPU lines; None if it cannot be read."""
    try:
        if stat is None:
            with open("/proc/stat") as f:
                stat = f.read()
        total = 0
        for line in stat.splitlines():
            name, *fields = line.split()
            if name.startswith("cpu") and name != "cpu" and int(name[3:]) in cpus:
                user, nice, system, _idle, _iowait, irq, softirq = (int(x) for x in fields[:7])
                total += user + nice + system + irq + softirq
        return total / _TICK
    except (OSError, ValueError, IndexError):
        return None


class CpuShare:
    """Sets torch's thread count in the calling thread to `fair_threads`, re-read every `INTERVAL`
    seconds of `adapt()` calls (see the module docstring). `read` returns (seconds the CPUs were
    busy, this process's CPU seconds) and `clock` the time: /proc/stat over `cpus` (the CPUs this
    process may run on), `time.process_time` and `time.monotonic` unless given."""

    def __init__(
        self,
        configured: int | None = None,
        *,
        enabled: bool = True,
        cpus: set[int] | None = None,
        read: Callable[[], tuple[float | None, float]] | None = None,
        clock: Callable[[], float] = time.monotonic,
    ):
        self.configured = configured or torch.get_num_threads()
        if cpus is None:
            try:
                cpus = set(os.sched_getaffinity(0))
            except (AttributeError, OSError):
                cpus = set(range(os.cpu_count() or 1))
        self.cpus = cpus
        self._read = read or (lambda: (busy_seconds(self.cpus), time.process_time()))
        self._clock = clock
        wanted = enabled and os.environ.get("TRINE_CPU_SHARE", "1") != "0"
        self.enabled = wanted and self._read()[0] is not None
        self.threads = self.configured
        self._proposed: int | None = None
        self._mark: tuple[float, float, float] | None = None  # (clock, machine busy, own CPU) seconds

    def adapt(self) -> int:
        """Take a reading if one is due and apply its thread count; returns the count in force."""
        if not self.enabled:
            return self.threads
        now = self._clock()
        mark = self._mark
        if mark is not None and now - mark[0] < INTERVAL:
            return self.threads
        busy, own = self._read()
        self._mark = None if busy is None else (now, busy, own)
        if mark is None or self._mark is None or now - mark[0] > STALE:
            self._proposed = None  # a reading starts afresh
            return self.threads
        others = max(0.0, (busy - mark[1]) - (own - mark[2])) / (now - mark[0])
        target = fair_threads(self.configured, len(self.cpus), others)
        if target == self.threads:
            self._proposed = None
        elif target == self._proposed:  # asked for twice in a row
            log.info("other processes use %.1f of %d cores: %d threads", others, len(self.cpus), target)
            self.threads, self._proposed = target, None
            torch.set_num_threads(target)
        else:
            self._proposed = target
        return self.threads


def release_openmp_pool() -> bool:
    """Let go of the calling thread's OpenMP worker threads (`omp_pause_resource_all`), so that
    libgomp does not count them against another thread's: once more of its threads exist than
    cores, it cuts every thread's spin to a "throttled" 1000 pause loops (about 10 us), and the
    engine thread pays a wake-up per op (trine/engine/setup.py's docstring). The pool is made again if
    this thread runs a parallel op later. False where the runtime has no such call."""
    try:
        gomp = ctypes.CDLL("libgomp.so.1")  # the runtime torch loaded (same soname)
        return gomp.omp_pause_resource_all(ctypes.c_int(1)) == 0  # omp_pause_soft
    except (OSError, AttributeError):
        return False
