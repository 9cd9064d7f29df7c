"""Every code block the docs say runs does run: the files under docs/snippets/ (the pages include them with
`--8<--`) and the README's Python blocks, each as a script against one embedded server.

The server serves the tiny test model under the default model's name, so the snippets read exactly as a
user runs them against `trine serve`; the clients find it through the variables a user sets
(`TRINE_BASE_URL` / `TRINE_API_KEY`, `PYTRIO_BASE_URL` / `PYTRIO_API_KEY`).
"""

from __future__ import annotations

import os
import re
import runpy
import subprocess
import sys
from pathlib import Path

import pytest
from serverutil import serve

ROOT = Path(__file__).resolve().parents[2]
SNIPPETS = sorted((ROOT / "docs" / "snippets").glob("*.py"))
FENCE = re.compile(r"^```python\n(.*?)^```", re.S | re.M)


def readme_blocks() -> list[str]:
    return FENCE.findall((ROOT / "README.md").read_text())


@pytest.fixture(scope="module")
def server(tiny_model_dir, tmp_path_factory):
    with serve({"SmolLM2-135M-Instruct": tiny_model_dir}, tmp_path_factory.mktemp("docs-home")) as srv:
        yield srv


def run_python(code: str, server, tmp_path: Path, monkeypatch, capsys) -> str:
    """Run `code` as a script with the environment a user sets; returns what it printed. In this process
    (sharing the imports keeps each run to the snippet's own work), except a script using the official
    pytrio client, whose session is closed at interpreter exit: that one gets a process of its own, which
    exits while the server is still up."""
    env = {
        "TRINE_BASE_URL": server.url,
        "TRINE_API_KEY": server.api_key,
        "PYTRIO_BASE_URL": server.url,
        "PYTRIO_API_KEY": server.api_key,
        "TRINE_HOME": str(tmp_path),
        "NO_PROXY": "127.0.0.1,localhost",
        "HF_HUB_OFFLINE": "1",
    }
    script = tmp_path / "snippet.py"
    script.write_text(code)
    if "import pytrio" in code:
        proc = subprocess.run(
            [sys.executable, str(script)],
            env={**os.environ, **env},
            cwd=tmp_path,
            capture_output=True,
            text=True,
            timeout=300,
        )
        assert proc.returncode == 0, (
            f"snippet failed:\n{code}\n--- stdout\n{proc.stdout}\n--- stderr\n{proc.stderr}"
        )
        return proc.stdout
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    monkeypatch.chdir(tmp_path)
    runpy.run_path(str(script), run_name="__main__")
    return capsys.readouterr().out


def test_there_are_snippets_to_run():
    assert SNIPPETS and len(readme_blocks()) >= 3


@pytest.mark.parametrize("path", SNIPPETS, ids=[p.name for p in SNIPPETS])
def test_docs_snippet_runs(path, server, tmp_path, monkeypatch, capsys):
    assert run_python(path.read_text(), server, tmp_path, monkeypatch, capsys).strip()


@pytest.mark.parametrize("index", range(len(readme_blocks())))
def test_readme_block_runs(index, server, tmp_path, monkeypatch, capsys):
    assert run_python(readme_blocks()[index], server, tmp_path, monkeypatch, capsys).strip()


def test_every_snippet_is_included_by_a_page():
    pages = "\n".join(p.read_text() for p in (ROOT / "docs").rglob("*.md"))
    for path in SNIPPETS:
        assert f'--8<-- "{path.name}"' in pages, f"{path.name} is run by the tests but shown on no page"
