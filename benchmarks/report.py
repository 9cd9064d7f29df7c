"""How a benchmark reports its figures: printed (one JSON object with `--json`, or one line per key), and
recorded as one line of `benchmarks/results/<benchmark>.jsonl` with the date, the machine and the command.

The docs' Benchmarks page is generated from the last line of each results file (docs/hooks/trine_docs.py),
so a figure reaches the docs only by a run that recorded it. `TRINE_BENCH_RECORD=0` turns recording off
(a smoke run, a run on a machine whose figures should not be published). A record's keys: `benchmark`,
`date` (UTC, ISO 8601), `machine` (`cpu` the model name, `cpu_vendor`, `cpu_features`: which of AMX,
AVX512-BF16 and AVX-512 the CPU has, `cores`, `torch`, `load_average` at the end of the run),
`command` (the script and its arguments) and `result` (the figures, as the script printed them).
"""

from __future__ import annotations

import datetime
import json
import os
import platform
import shlex
import sys
from pathlib import Path

RESULTS = Path(__file__).resolve().parent / "results"
REPO = RESULTS.parents[1]
FIELDS = ("benchmark", "date", "machine", "command", "result")


def emit(out: dict, as_json: bool) -> None:
    record(out)
    if as_json:
        print(json.dumps(out))
        return
    for k, v in out.items():
        print(f"{k:28s} {v:.3f}" if isinstance(v, float) else f"{k:28s} {v}")


def record(result: dict, name: str | None = None) -> Path | None:
    """Append this run to `results/<name>.jsonl` (name: the running script's, by default); return the file,
    or None when `TRINE_BENCH_RECORD=0`."""
    if os.environ.get("TRINE_BENCH_RECORD", "1") == "0":
        return None
    name = name or Path(sys.argv[0]).stem
    line = {
        "benchmark": name,
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "machine": machine(),
        "command": command(),
        "result": result,
    }
    RESULTS.mkdir(exist_ok=True)
    path = RESULTS / f"{name}.jsonl"
    with path.open("a") as f:
        f.write(json.dumps(line) + "\n")
    return path


# /proc/cpuinfo flags -> the feature a record names: what decides which GEMM and bf16 kernels a CPU runs
CPU_FEATURES = {"amx_bf16": "amx", "avx512_bf16": "avx512_bf16", "avx512f": "avx512"}


def machine() -> dict:
    """The machine block of every record: the CPU (model name, vendor, its AMX / AVX512-BF16 / AVX-512),
    the cores, torch's version and the load average."""
    info: dict[str, str] = {}  # the first CPU's fields: every core of a machine is the same model
    try:
        for text in Path("/proc/cpuinfo").read_text().splitlines():
            field, _, value = text.partition(":")
            info.setdefault(field.strip(), value.strip())
    except OSError:  # not Linux: platform's name is the best there is
        pass
    flags = set(info.get("flags", "").split())
    return {
        "cpu": info.get("model name") or platform.processor() or platform.machine(),
        "cpu_vendor": info.get("vendor_id"),
        "cpu_features": [name for flag, name in CPU_FEATURES.items() if flag in flags],
        "cores": os.cpu_count(),
        "torch": _torch_version(),
        "load_average": [round(x, 2) for x in os.getloadavg()],
    }


def _torch_version() -> str | None:
    if "torch" in sys.modules:  # the version that ran, which may not be the installed one
        return sys.modules["torch"].__version__
    from importlib import metadata

    try:
        return metadata.version("torch")
    except metadata.PackageNotFoundError:
        return None


def command() -> str:
    """The script relative to the repository (so records read the same on every checkout) and its argv."""
    script = Path(sys.argv[0]).resolve()
    shown = script.relative_to(REPO) if script.is_relative_to(REPO) else Path(sys.argv[0])
    return shlex.join([str(shown), *sys.argv[1:]])
