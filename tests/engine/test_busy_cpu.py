"""A busy CPU (issue 32, item 3): the engine's OpenMP threads spin briefly, then sleep, unless the
operator chose otherwise. The throughput figures are benchmarks/cpu_share.py's, not a timed test."""

from __future__ import annotations

import os
import subprocess
import sys

from trine.engine.setup import DEFAULT_WAIT

SHOW = "print(*(os.environ.get(k, '-') for k in ('OMP_WAIT_POLICY', 'GOMP_SPINCOUNT', 'KMP_BLOCKTIME')))"
# as `trine serve` starts: the CLI resolves the command (and configures the process), then the
# command loads the server, and torch with it
PROBE = (
    "import os; from trine.cli.main import main; main.get_command(None, 'serve'); "
    "import trine.server.app, torch; " + SHOW
)
NAMES = ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT", "KMP_BLOCKTIME")


def wait_settings_in_a_fresh_process(probe: str = PROBE, **env: str) -> list[str]:
    base = {k: v for k, v in os.environ.items() if k not in NAMES}
    out = subprocess.run(
        [sys.executable, "-c", probe], env={**base, **env}, capture_output=True, text=True, check=True
    )
    return out.stdout.split()


def test_the_server_loads_torch_with_a_bounded_openmp_spin():
    # ACTIVE with a spin count: the count bounds the spin (and ACTIVE raises libgomp's throttled one)
    assert DEFAULT_WAIT == {"OMP_WAIT_POLICY": "ACTIVE", "GOMP_SPINCOUNT": "30000"}
    assert wait_settings_in_a_fresh_process() == ["ACTIVE", "30000", "0"]


def test_an_operators_wait_policy_or_spin_count_is_kept():
    assert wait_settings_in_a_fresh_process(OMP_WAIT_POLICY="ACTIVE") == ["ACTIVE", "-", "-"]
    assert wait_settings_in_a_fresh_process(GOMP_SPINCOUNT="0") == ["-", "0", "-"]


def test_importing_the_engine_sets_nothing():
    """Only `configure()` does (the CLI's entry, an engine's start): an import leaves the process
    as it was."""
    probe = "import os, trine.engine, trine.engine.runtime.local, torch; " + SHOW
    assert wait_settings_in_a_fresh_process(probe) == ["-", "-", "-"]
    malloc = "import trine.engine.runtime.local, trine.engine.malloc as m; print(m._applied)"
    out = subprocess.run([sys.executable, "-c", malloc], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "None"
