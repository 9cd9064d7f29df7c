"""Benchmark figures reach the docs only through `benchmarks/results/*.jsonl` (issue 29: nothing
hand-copied that can drift): every record there has its date, machine, command and figures; the
Benchmarks page renders a table for each results file; and the page's own Markdown states no figure.
"""

from __future__ import annotations

import datetime
import importlib.util
import json
import re
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
RESULTS = ROOT / "benchmarks" / "results"
PAGE = ROOT / "docs" / "benchmarks.md"


def load(name: str, path: Path):
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


hook = load("trine_docs_hook", ROOT / "docs" / "hooks" / "trine_docs.py")
report = load("trine_bench_report", ROOT / "benchmarks" / "report.py")
FILES = sorted(RESULTS.glob("*.jsonl"))

# A measured figure as people type one: a number with a unit or a ratio sign (`4.02×`, `18.4 s`, `93.4 %`,
# `237 tokens/s`; a ratio's × is attached, a size's is spaced), a bold number, or a number with two
# decimals or more. Goals (`≥ 3×`, `≤ 3 %`) and sizes in prose (`2 cores`, `8 × 256 tokens`,
# `512-token prompts`) pass.
FIGURE = re.compile(
    r"(?<![≥≤<>]\s)(?<![≥≤<>\w.])[−+-]?\d[\d,]*(\.\d+)?(×|x\b|\s?(%|s\b|ms\b|GB\b|GiB\b|MiB\b|[a-z]+/s\b))"
    r"|\*\*[−+-]?\d|\d\.\d\d"
)


def hand_figures(markdown: str) -> list[str]:
    """Lines of a page's Markdown source that state a figure or hold a table of their own."""
    return [
        line
        for line in markdown.splitlines()
        if not hook.BENCH_MARKER.match(line) and (line.lstrip().startswith("|") or FIGURE.search(line))
    ]


def test_there_are_results_to_render():
    assert FILES, "benchmarks/results/ holds no *.jsonl: the page would have no figures"


@pytest.mark.parametrize("path", FILES, ids=lambda p: p.stem)
def test_every_record_parses_and_has_the_fields(path):
    for n, line in enumerate(path.read_text().splitlines(), 1):
        r = json.loads(line)
        where = f"{path.name}:{n}"
        assert set(report.FIELDS) <= set(r), f"{where}: missing {set(report.FIELDS) - set(r)}"
        assert r["benchmark"] == path.stem, where
        datetime.datetime.fromisoformat(r["date"])  # a date alone is ISO too (a seeded record)
        assert {"cpu", "cores", "torch"} <= set(r["machine"]), where
        # the load average report.py reads, or what the person who ran it said of the load
        assert {"load_average", "note"} & set(r["machine"]), where
        assert f"{path.stem}.py" in r["command"], where
        assert isinstance(r["result"], dict) and r["result"], where


def test_a_record_names_its_cpu_kind():
    """Every new record's machine block: the CPU's model, vendor and which of AMX / AVX512-BF16 /
    AVX-512 it has (from /proc/cpuinfo), and the page says them beside the figures."""
    m = report.machine()
    assert m["cpu"] and set(m["cpu_features"]) <= set(report.CPU_FEATURES.values())
    flags = Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").exists() else ""
    assert ("avx512f" in flags) == ("avx512" in m["cpu_features"])
    if "vendor_id" in flags:
        assert m["cpu_vendor"] in flags
    named = hook._cpu_kind(m)
    assert named.startswith(m["cpu"]) and all(hook.FEATURE_NAMES[f] in named for f in m["cpu_features"])
    assert hook._cpu_kind({"cpu": "an old record's CPU"}) == "an old record's CPU"  # old records as they are


@pytest.mark.parametrize("path", FILES, ids=lambda p: p.stem)
def test_the_page_renders_the_latest_record_of_every_results_file(path):
    source = PAGE.read_text()
    assert f"<!-- trine:bench {path.stem} -->" in source, f"docs/benchmarks.md has no section for {path.name}"
    latest = json.loads(path.read_text().splitlines()[-1])
    table = hook.bench_table(path.stem)
    assert table in hook.render(source, "benchmarks.md")
    assert "| figure | value |" in table and latest["command"] in table and latest["date"] in table
    for key in latest["result"]:
        assert f"`{key}" in table, f"{path.name}: {key} not rendered"


def test_every_benchmark_that_records_has_a_section():
    recorders = [
        p.stem
        for p in (ROOT / "benchmarks").glob("*.py")
        if p.stem != "report" and re.search(r"^\s*(emit|record)\(", p.read_text(), re.M)
    ]
    assert len(recorders) > 10
    source = PAGE.read_text()
    missing = [name for name in recorders if f"<!-- trine:bench {name} -->" not in source]
    assert not missing, f"docs/benchmarks.md has no `<!-- trine:bench NAME -->` section for {missing}"


def test_a_benchmark_without_records_says_how_to_make_one():
    assert "Not yet recorded in this format; run `.venv/bin/python benchmarks/nothing_yet.py --json`" in (
        hook.bench_table("nothing_yet")
    )


def test_the_page_states_no_figure_of_its_own():
    assert hand_figures(PAGE.read_text()) == []


def test_the_figure_check_catches_typed_figures_and_tolerates_prose():
    typed = [
        "| a | 18.4 s |",
        "speed **1.27×**",
        "it took 2954 ms",
        "93.4 % cached",
        "0.902 → 0.140",
        "4.02×",
    ]
    prose = ["2 cores", "8 × 256 tokens", "512-token prompts", "goal ≥ 3×, ≤ 3 %", "issue 32", "lr 1e-5"]
    assert hand_figures("\n".join(typed)) == typed
    assert hand_figures("\n".join(prose)) == []


def test_record_appends_one_line_with_the_fields(tmp_path, monkeypatch):
    monkeypatch.setattr(report, "RESULTS", tmp_path)
    monkeypatch.setattr(sys, "argv", [str(ROOT / "benchmarks" / "made_up.py"), "--json", "--n", "2"])
    report.record({"x": 1.5})
    path = report.record({"x": 2.5})
    lines = [json.loads(s) for s in path.read_text().splitlines()]
    assert path.name == "made_up.jsonl" and [r["result"] for r in lines] == [{"x": 1.5}, {"x": 2.5}]
    assert lines[0]["command"] == "benchmarks/made_up.py --json --n 2"
    assert lines[0]["machine"]["cores"] >= 1 and lines[0]["date"].endswith("+00:00")
    monkeypatch.setenv("TRINE_BENCH_RECORD", "0")
    assert report.record({"x": 3.5}) is None and len(path.read_text().splitlines()) == 2


def engine_settings_order(source: str) -> list[str]:
    """A benchmark's top-level statements that matter to the engine's process settings, in order:
    'engine' (an import of trine.engine or trine.server), 'configure' (a `configure()` call) and
    'import' (any other import that may load torch: not the standard library's, nor the settings'
    own modules or the benchmarks' torch-free helpers)."""
    import ast

    std = set(sys.stdlib_module_names) | {"__future__", "report", "fresh_process"}
    seen = []
    for node in ast.parse(source).body:
        if isinstance(node, ast.Expr) and isinstance(node.value, ast.Call):
            if getattr(node.value.func, "id", None) == "configure":
                seen.append("configure")
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            names = [node.module] if isinstance(node, ast.ImportFrom) else [a.name for a in node.names]
            for name in names:
                if name in ("trine.engine.setup", "trine.engine.malloc"):
                    continue
                if name.startswith(("trine.engine", "trine.server")):
                    seen.append("engine")
                elif name.split(".")[0] not in std:
                    seen.append("import")
    return seen


def test_a_benchmark_that_runs_an_engine_applies_its_process_settings_before_torch_loads():
    """A benchmark that runs trine's engine in its own process measures it under the settings
    `trine serve` applies (engine/setup.py: OpenMP's wait and the allocator's thresholds), and
    those take effect only before torch loads: so `configure()` comes before every import that
    may load it."""
    late = []
    for path in sorted((ROOT / "benchmarks").glob("*.py")):
        seen = engine_settings_order(path.read_text())
        if "engine" in seen and (
            "configure" not in seen
            or seen.index("configure") > min(seen.index(k) for k in ("engine", "import") if k in seen)
        ):
            late.append(path.name)
    assert late == []
    assert engine_settings_order(
        "import torch\nfrom trine.engine.setup import configure\nconfigure()\n"
        "from trine.engine.api import Forward\n"
    ) == ["import", "configure", "engine"]
