"""C kernels built with the system compiler, once per source, compiler and CPU.

The engine's few C kernels (paged_attention.c, fused_ops.c) are compiled at the engine's start
(active.py), or when first needed by code that runs them without an engine, with `CC` (default `cc`;
about a second each) and `march_flag()` (the CPU's own instruction set, or the level torch is held
to), into `kernel_dir()`, and loaded with ctypes. The OpenMP runtime they link is the one torch
already loaded (the same soname), so they run on torch's threads.

Invariants
- A built library is named by a hash of its source and the local headers it includes, flags (the
  -march among them), compiler version and CPU model and flags: an edit, another compiler, another
  CPU or another instruction set level builds anew; nothing stale is ever loaded.
- The kernels follow torch's kernel path: where `ATEN_CPU_CAPABILITY` holds torch to a lower
  instruction set than the CPU's (the test suite's second kernel path, `make test-portable`), they
  are built for that level too, so they are tested on the code a CPU of that level runs.
- Built aside and renamed into place (atomic): two processes building at once both load a
  complete library.
- Not -ffast-math nor -funsafe-math-optimizations: linking with them adds crtfastmath.o, which
  flushes subnormals to zero for the whole process when the library loads.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import platform
import re
import subprocess
import tempfile
import threading
import time
from pathlib import Path
from typing import Callable

log = logging.getLogger(__name__)

BASE_FLAGS = ("-O3", "-fno-math-errno", "-fno-trapping-math", "-fopenmp", "-shared", "-fPIC")
# ATEN_CPU_CAPABILITY's values -> the x86-64 level of the same instructions (psABI levels: v2 is
# SSE4.2, v3 adds AVX2 and FMA, v4 adds AVX-512)
X86_LEVELS = {"default": "x86-64-v2", "avx2": "x86-64-v3", "avx512": "x86-64-v4"}


def march_flag() -> str:
    """`-march=native`, or on x86-64 the level `ATEN_CPU_CAPABILITY` holds torch to."""
    level = X86_LEVELS.get(os.environ.get("ATEN_CPU_CAPABILITY", "").lower())
    if level and platform.machine() in ("x86_64", "AMD64"):
        return f"-march={level}"
    return "-march=native"


def kernel_dir() -> Path:
    """Where built kernels are kept: `TRINE_KERNEL_DIR`, else `$XDG_CACHE_HOME/trine/kernels`."""
    if os.environ.get("TRINE_KERNEL_DIR"):
        return Path(os.environ["TRINE_KERNEL_DIR"])
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "trine" / "kernels"


def cpu_identity() -> str:
    """What `-march=native` compiles for: the CPU model and its flags."""
    try:
        info = Path("/proc/cpuinfo").read_text()
        lines = [ln for ln in info.splitlines() if ln.startswith(("model name", "flags"))]
        return "\n".join(sorted(set(lines)))
    except OSError:
        return platform.processor() or platform.machine()


def _text_with_headers(source: Path) -> str:
    """The source and the local headers it includes (`#include "x.h"`, beside it): what a build
    is keyed by, so an edited header builds anew too."""
    text = source.read_text()
    headers = re.findall(r'^#include "([^"]+)"', text, flags=re.M)
    return "\0".join([text, *((source.parent / h).read_text() for h in headers)])


def build(source: Path, flags: tuple[str, ...] = ()) -> ctypes.CDLL:
    """Compile `source` with BASE_FLAGS + `flags` (or reuse its build) and load it. Raises
    OSError, RuntimeError or subprocess.SubprocessError where it cannot be built."""
    cc = os.environ.get("CC", "cc")
    version = subprocess.run([cc, "--version"], capture_output=True, text=True, check=True, timeout=60).stdout
    all_flags = [*BASE_FLAGS, march_flag(), *flags]
    key = hashlib.sha256(
        "\0".join([_text_with_headers(source), cc, version, " ".join(all_flags), cpu_identity()]).encode()
    ).hexdigest()[:16]
    path = kernel_dir() / f"{source.stem}-{key}.so"
    if not path.exists():
        start = time.monotonic()
        path.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=path.parent) as tmp:  # built aside, then renamed: atomic
            built = Path(tmp) / path.name
            cmd = [cc, *all_flags, str(source), "-o", str(built), "-lm"]
            done = subprocess.run(cmd, capture_output=True, timeout=300)
            if done.returncode:
                raise RuntimeError(done.stderr.decode(errors="replace").strip()[-500:])
            os.replace(built, path)
        log.info("%s built in %.1f s: %s", source.name, time.monotonic() - start, path)
    return ctypes.CDLL(str(path))


class Kernel:
    """A C library built and loaded at its first `available()` call. `switch` names the
    environment variable whose value "0" turns it off; `declare(lib)` sets its functions'
    ctypes signatures. Where it cannot be built (no compiler, no OpenMP) or is switched off, `lib`
    stays None and the reason is logged once, with `instead`: what callers do without it."""

    def __init__(
        self,
        source: Path,
        flags: tuple[str, ...],
        declare: Callable[[ctypes.CDLL], None],
        switch: str,
        instead: str = "the torch path instead",
    ):
        self.source, self.flags, self.declare, self.switch = source, flags, declare, switch
        self.instead = instead  # what callers do without it, for the log
        self.lib: ctypes.CDLL | None = None
        self._tried = False
        self._lock = threading.Lock()

    def available(self) -> bool:
        if self._tried:
            return self.lib is not None
        with self._lock:
            if not self._tried:
                if os.environ.get(self.switch, "1") == "0":
                    log.info("%s off (%s=0): %s", self.source.name, self.switch, self.instead)
                else:
                    try:
                        lib = build(self.source, self.flags)
                        self.declare(lib)
                        self.lib = lib
                    except (OSError, RuntimeError, subprocess.SubprocessError) as e:
                        log.warning("%s not built (%s): %s", self.source.name, e, self.instead)
                self._tried = True
        return self.lib is not None
