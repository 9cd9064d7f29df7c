"""`--batch-invariant` checks, once a process, that the kernels it builds on keep their bits here."""

from __future__ import annotations

import os
import subprocess
import sys

from trine.engine.model import invariant

PROBE = (
    "from trine.engine.model import invariant; invariant.enable(True); "
    "print('invariant' if invariant.rows_invariant() else 'not invariant')"
)


def test_the_kernels_keep_their_bits_on_mkls_own_paths(caplog):
    invariant.enable(True)
    try:
        assert invariant.rows_invariant()
        assert "--batch-invariant" not in caplog.text
    finally:
        invariant.enable(False)


def test_a_kernel_path_that_breaks_them_is_named_at_enable():
    """MKL's reproducibility mode computes a batched matmul's rows by their place in the call: the
    attention of a sequence's last queries then differs from theirs in the whole sequence's call.
    `enable` says so, naming the setting, rather than letting bit-for-bit claims silently fail."""
    env = {**os.environ, "MKL_CBWR": "COMPATIBLE"}  # read by MKL when it loads: another process
    done = subprocess.run([sys.executable, "-c", PROBE], env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "not invariant"
    assert "--batch-invariant" in done.stderr and "MKL_CBWR=COMPATIBLE" in done.stderr
