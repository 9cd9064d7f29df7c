"""One way down: server -> service -> engine (docs/architecture.md, "Layers"), in one vocabulary.

Front ends build the engine's boundary types (`trine.engine.api`) and service commands, and read
through service queries; they import nothing else of the engine but its configuration
(`trine.engine.config`, torch-free, which `start_server` passes down), never the store, nor reach a
`.store` / `.engine` attribute. No class name is defined in two of server, service and engine, and
the boundary module (with the engine interface) imports no torch. The engine never imports the layers
above it. The service's modules import each other without cycles. Checked on the source (ast), so
a violation fails here before it can hide behind a passing protocol test.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

import trine

SRC = Path(trine.__file__).parent
REACH = re.compile(r"\.store\b|\.engine\b")
BOUNDARY_IMPORT = re.compile(r"\s*from \.+engine\.api import")


def module_name(path: Path) -> str:
    rel = path.relative_to(SRC.parent).with_suffix("")
    parts = rel.parts[:-1] if rel.name == "__init__" else rel.parts
    return ".".join(parts)


def imports(source: str, module: str, is_package: bool = False) -> set[str]:
    """Every module `source` (the text of `module`) imports, relative imports resolved; `from X
    import y` counts as importing both X and X.y (y may be a submodule)."""
    package = module if is_package else module.rpartition(".")[0]
    out = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[: len(base) - (node.level - 1)]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module
            out.add(target)
            out.update(f"{target}.{a.name}" for a in node.names)
    return out


def modules(package: str) -> dict[str, Path]:
    root = SRC.joinpath(*package.split(".")[1:])
    return {module_name(p): p for p in sorted(root.rglob("*.py"))}


def imports_of(package: str) -> dict[str, set[str]]:
    return {
        name: imports(p.read_text(), name, p.name == "__init__.py") for name, p in modules(package).items()
    }


def names(targets: set[str], *packages: str) -> list[str]:
    return sorted(t for t in targets if any(t == p or t.startswith(p + ".") for p in packages))


def test_the_checker_resolves_relative_imports():
    found = imports(
        "from ...engine.ops import Forward\nfrom ... import store\nimport trine.engine.model.model",
        "trine.server.tinker.routes_training",
    )
    assert {"trine.engine.ops", "trine.store", "trine.engine.model.model"} <= found
    assert names(found, "trine.engine") == [
        "trine.engine.model.model",
        "trine.engine.ops",
        "trine.engine.ops.Forward",
    ]
    assert REACH.search("rows = svc.store.sessions(key.id)") and not REACH.search("svc.queries.sessions(key)")


BOUNDARY = "trine.engine.api"
CONFIG = "trine.engine.config"  # the engine's configuration: built above the engine, passed down as is


def test_front_ends_import_only_the_engines_boundary_and_never_the_store():
    bad = {
        m: [
            t
            for t in names(targets, "trine.engine", "trine.store")
            if t != "trine.engine" and not any(t == m or t.startswith(m + ".") for m in (BOUNDARY, CONFIG))
        ]
        for m, targets in imports_of("trine.server").items()
    }
    assert {m: t for m, t in bad.items() if t} == {}


def test_no_class_name_is_defined_in_two_layers():
    where: dict[str, set[str]] = {}
    for layer in ("trine.server", "trine.service", "trine.engine"):
        for path in modules(layer).values():
            for node in ast.walk(ast.parse(path.read_text())):
                if isinstance(node, ast.ClassDef):
                    where.setdefault(node.name, set()).add(layer)
    assert {name: sorted(layers) for name, layers in where.items() if len(layers) > 1} == {}


def test_the_boundary_the_engine_interface_and_the_config_import_no_torch():
    """Checked in a fresh interpreter: importing them (and everything they import) loads no torch."""
    import subprocess
    import sys

    code = (
        "import sys, trine.engine.api, trine.engine.interface, trine.engine.prepare, trine.engine.config, "
        "trine.tokens; "
        "print('torch' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "False"


def test_front_ends_reach_no_store_or_engine_attribute():
    server = SRC / "server"
    hits = [
        f"{p.relative_to(SRC)}:{i}: {line.strip()}"
        for p in sorted(server.rglob("*"))
        if p.is_file() and p.suffix in (".py", ".js", ".css", ".html")
        for i, line in enumerate(p.read_text().splitlines(), 1)
        if REACH.search(line) and not BOUNDARY_IMPORT.match(line)
    ]
    assert hits == []


def test_tinker_and_openai_front_ends_do_not_import_the_pytrio_planes():
    """Of the PyTRIO package they share only the bodies Tinker's protocol repeats (model input,
    sampling and Adam params) and their conversion (`bodies.py`, `to_api.py`), never its routes or
    shapes."""
    shared = ("trine.server.pytrio.bodies", "trine.server.pytrio.to_api")
    bad = {
        m: [x for x in names(t, "trine.server.pytrio") if not x.startswith(shared)]
        for m, t in imports_of("trine.server").items()
        if m.startswith(("trine.server.tinker", "trine.server.openai"))
    }
    assert {m: t for m, t in bad.items() if t} == {}


def test_the_engine_imports_nothing_above_it():
    bad = {
        m: names(t, "trine.server", "trine.service", "trine.store", "trine.client")
        for m, t in imports_of("trine.engine").items()
    }
    assert {m: t for m, t in bad.items() if t} == {}


@pytest.mark.parametrize("package", ["trine.service", "trine.server", "trine.engine"])
def test_no_import_cycle_inside_a_layer(package):
    files = modules(package)
    # a package's __init__ re-exports its modules and is imported before any of them: edges into an
    # __init__ (`from . import x`) never make a cycle, so only edges between modules count
    graph = {
        m: {t for t in targets if t in files and t != m and files[t].name != "__init__.py"}
        for m, targets in imports_of(package).items()
    }
    state: dict[str, int] = {}  # 1 = on the current path, 2 = done
    path: list[str] = []

    def visit(m: str) -> list[str] | None:
        state[m] = 1
        path.append(m)
        for t in sorted(graph[m]):
            if state.get(t) == 1:
                return path[path.index(t) :] + [t]
            if t not in state and (cycle := visit(t)):
                return cycle
        path.pop()
        state[m] = 2
        return None

    for m in sorted(graph):
        if m not in state:
            cycle = visit(m)
            assert cycle is None, " -> ".join(cycle)
