"""Run a benchmark's child script in a fresh Python process: for settings the runtime reads once per
process (OpenMP's wait policy, the C allocator's thresholds), each setting needs its own process."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

SRC = Path(__file__).resolve().parents[1] / "src"


def run_child(code: str, argv: list, drop: tuple[str, ...] = (), env: dict | None = None) -> dict:
    """`python -c code *argv` with this process's environment less the names in `drop`, plus `env`,
    and trine's src on PYTHONPATH; returns the JSON object the child printed on its last line."""
    child_env = {k: v for k, v in os.environ.items() if k not in drop}
    path = os.pathsep.join(filter(None, [str(SRC), child_env.get("PYTHONPATH")]))
    child_env.update(env or {}, PYTHONPATH=path)
    cmd = [sys.executable, "-c", code, *map(str, argv)]
    out = subprocess.run(cmd, env=child_env, capture_output=True, text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])
