"""A busy CPU (issue 32, item 3): the engine's OpenMP threads sleep while they wait, unless the
operator chose otherwise. The throughput figures are benchmarks/cpu_share.py's, not a timed test."""

from __future__ import annotations

import os
import subprocess
import sys

PROBE = "import trine.server.app, torch, os; print(os.environ.get('OMP_WAIT_POLICY'))"


def policy_in_a_fresh_server_process(**env: str) -> str:
    base = {k: v for k, v in os.environ.items() if k != "OMP_WAIT_POLICY"}
    out = subprocess.run(
        [sys.executable, "-c", PROBE], env={**base, **env}, capture_output=True, text=True, check=True
    )
    return out.stdout.strip()


def test_the_server_loads_torch_with_a_passive_openmp_wait_policy():
    assert policy_in_a_fresh_server_process() == "PASSIVE"


def test_an_operators_wait_policy_is_kept():
    assert policy_in_a_fresh_server_process(OMP_WAIT_POLICY="ACTIVE") == "ACTIVE"
