"""How a benchmark reports its figures: printed (one JSON object with `--json`, or one line per key), and
recorded as one line of `benchmarks/results/<benchmark>.jsonl` with the date, the machine and the command.

The docs' Benchmarks page is generated from the last line of each results file (docs/hooks/trine_docs.py),
so a figure reaches the docs only by a run that recorded it. `TRINE_BENCH_RECORD=0` turns recording off
(a smoke run, a run on a machine whose figures should not be published). A record's keys: `benchmark`,
`date` (UTC, ISO 8601), `machine` (`cpu`, `cores`, `torch`, `load_average` at the end of the run),
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


def machine() -> dict:
    cpu = platform.processor() or platform.machine()
    try:
        for text in Path("/proc/cpuinfo").read_text().splitlines():
            if text.startswith("model name"):
                cpu = text.split(":", 1)[1].strip()
                break
    except OSError:  # not Linux: platform's name is the best there is
        pass
    return {
        "cpu": cpu,
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
