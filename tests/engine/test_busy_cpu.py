"""A busy CPU (issue 32, item 3): the engine's OpenMP threads spin briefly, then sleep, unless the
operator chose otherwise. The throughput figures are benchmarks/cpu_share.py's, not a timed test."""

from __future__ import annotations

import os
import subprocess
import sys

from trine.engine import DEFAULT_WAIT

PROBE = (
    "import trine.server.app, torch, os; "
    "print(*(os.environ.get(k, '-') for k in ('OMP_WAIT_POLICY', 'GOMP_SPINCOUNT', 'KMP_BLOCKTIME')))"
)
NAMES = ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT", "KMP_BLOCKTIME")


def wait_settings_in_a_fresh_server_process(**env: str) -> list[str]:
    base = {k: v for k, v in os.environ.items() if k not in NAMES}
    out = subprocess.run(
        [sys.executable, "-c", PROBE], env={**base, **env}, capture_output=True, text=True, check=True
    )
    return out.stdout.split()


def test_the_server_loads_torch_with_a_bounded_openmp_spin():
    # ACTIVE with a spin count: the count bounds the spin (and ACTIVE raises libgomp's throttled one)
    assert DEFAULT_WAIT == {"OMP_WAIT_POLICY": "ACTIVE", "GOMP_SPINCOUNT": "30000"}
    assert wait_settings_in_a_fresh_server_process() == ["ACTIVE", "30000", "0"]


def test_an_operators_wait_policy_or_spin_count_is_kept():
    assert wait_settings_in_a_fresh_server_process(OMP_WAIT_POLICY="ACTIVE") == ["ACTIVE", "-", "-"]
    assert wait_settings_in_a_fresh_server_process(GOMP_SPINCOUNT="0") == ["-", "0", "-"]
