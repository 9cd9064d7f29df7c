"""The documentation against the code: the generated tables are complete, the refusal lists are the
code's own, every limit the code defines is documented, every error message the troubleshooting page
quotes still exists, and the README stays short. (`mkdocs build --strict`, run by `make test`, checks
links and anchors.)
"""

from __future__ import annotations

import dataclasses
import importlib.util
import numbers
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
DOCS = ROOT / "docs"


def load_hook():
    spec = importlib.util.spec_from_file_location("trine_docs_hook", DOCS / "hooks" / "trine_docs.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


hook = load_hook()


def page(name: str) -> str:
    return (DOCS / name).read_text()


# ---------------------------------------------------------------------------- losses


def test_loss_table_has_every_loss_with_its_objective_and_defaults():
    from trine.engine import api as losses

    rows = hook.loss_rows()
    assert [r["name"] for r in rows] == list(losses.LOSS_NAMES)
    for r in rows:
        assert r["formula"] != "?", f"{r['name']}: no objective in losses.py's docstring table"
        assert set(r["config"]) == set(losses.LOSS_CONFIG_KEYS[r["name"]])
        # the documented defaults are what a server resolves when the config is left out
        assert losses.Loss.parse(r["name"], r["config"]) == losses.Loss.parse(r["name"])


def test_ppo_thresholds_are_documented_as_ratio_bounds():
    from trine.engine import api as losses

    by_name = {r["name"]: r for r in hook.loss_rows()}
    for name in ("ppo", "cispo", "gspo"):
        assert by_name[name]["config"] == {"clip_low_threshold": 0.8, "clip_high_threshold": 1.2}
        assert "clip(r, lo, hi)" in by_name[name]["formula"] or "clip(s, lo, hi)" in by_name[name]["formula"]
    # the README's old reading (epsilons, clip(r, 1-lo, 1+hi), default 0.2) is gone everywhere
    text = (ROOT / "README.md").read_text() + "".join(p.read_text() for p in DOCS.rglob("*.md"))
    assert not re.search(r"1\s*[−-]\s*lo\b", text)
    with pytest.raises(ValueError, match="upper bound on the ratio"):
        losses.Loss.parse("ppo", {"clip_high_threshold": 0.2})
    assert "<!-- trine:table losses -->" in page("losses.md")


# ---------------------------------------------------------------------------- refusals


def test_openai_refusals_are_the_code_list_and_accepted_parameters_are_documented():
    from trine.server.openai import bodies

    table = hook.openai_refused_table()
    assert sorted(re.findall(r"^\| `([a-z_]+)` \|", table, re.M)) == sorted(bodies.NEUTRAL)
    text = page("protocols/openai.md")
    assert "<!-- trine:table openai_refused -->" in text
    undocumented = sorted(p for p in bodies.CHAT | bodies.COMPLETION if f"`{p}`" not in text)
    assert not undocumented, f"parameters the OpenAI front end accepts but its page omits: {undocumented}"


def test_tinker_refusals_are_the_code_list():
    from trine.server.tinker import refused

    table = hook.tinker_refused_table()
    assert len(re.findall(r"^\| `(GET|POST|PUT|DELETE) ", table, re.M)) == len(refused.REFUSED)
    for _, path, _, _ in refused.REFUSED:
        assert f"/api/v1{path}`" in table
    assert "<!-- trine:table tinker_refused -->" in page("protocols/tinker.md")


# ---------------------------------------------------------------------------- limits


def test_every_limit_in_the_code_is_documented():
    from trine import limits

    listed = {(where, name) for where, name, _ in hook.LIMITS}
    constants = {
        n
        for n, v in vars(limits).items()
        if n.isupper() and isinstance(v, numbers.Number) and not isinstance(v, bool)
    }
    missing = sorted(n for n in constants if ("limits", n) not in listed)
    assert not missing, f"trine.limits has limits the Limits page omits (add them to LIMITS): {missing}"
    fields = {f.name for f in dataclasses.fields(limits.KeyLimits)}
    assert not sorted(f for f in fields if ("KeyLimits", f) not in listed)
    for where, name, _ in hook.LIMITS:
        assert isinstance(hook.limit_value(where, name), numbers.Number), (where, name)
    table = hook.limits_table()
    assert f"| `live_runs` | {limits.KeyLimits().live_runs:,} |" in table
    for name in limits.ADAM_BOUNDS:
        assert f"`AdamParams.{name}`" in table
    for name, bound in limits.SAMPLING_BOUNDS.items():
        assert f"| `SamplingParams.{name}` | {bound.text()} |" in table


def test_cli_reference_has_every_command_and_option():
    import importlib

    import click

    from trine.cli.main import COMMANDS

    ref = hook.cli_reference()
    for name, (module, attr) in COMMANDS.items():
        cmd = getattr(importlib.import_module(module), attr)
        assert f"### `trine {name}`" in ref
        for p in cmd.params:
            if isinstance(p, click.Option) and not p.hidden:
                assert f"`{p.opts[0]}`" in ref, f"trine {name} {p.opts[0]}"


def test_every_engine_config_field_is_documented_with_its_flag():
    import click

    from trine.cli.serve import serve
    from trine.engine import config

    rows = hook.engine_config_rows()
    expected = [
        f.name for f in dataclasses.fields(config.EngineConfig) if f.name not in ("sampler", "trainer")
    ]
    expected += [f"sampler.{f.name}" for f in dataclasses.fields(config.SamplerConfig)]
    expected += [f"trainer.{f.name}" for f in dataclasses.fields(config.TrainerConfig)]
    assert [r["name"] for r in rows] == expected
    undocumented = [r["name"] for r in rows if not r["doc"]]
    assert not undocumented, f"EngineConfig fields without a meaning (metadata['doc']): {undocumented}"
    options = {o: p for p in serve.params if isinstance(p, click.Option) for o in p.opts + p.secondary_opts}
    for r in rows:
        for flag in (r["flag"] or "").split("/") if r["flag"] else ():
            assert flag in options, f"{r['name']}: `trine serve` has no {flag}"
            # the CLI reference says what this table says: the option's default and meaning are the field's
            opt = options[flag]
            assert opt.default == r["default"], (flag, opt.default, r["default"])
            assert opt.help.lower().startswith(r["doc"].replace("`", "").lower()), (flag, opt.help)
    table = hook.engine_config_table()
    for r in rows:
        assert f"| `{r['name']}` |" in table
    assert "| `sampler.max_running` | 64 |" in table
    assert "<!-- trine:table engine_config -->" in page("limits.md")
    assert "limits.md#engine-configuration" in page("cli.md")


def test_an_unknown_table_name_fails_the_build():
    with pytest.raises(ValueError, match="unknown generated table"):
        hook.render("<!-- trine:table nonesuch -->", "page.md")


# ---------------------------------------------------------------------------- troubleshooting


def _sources() -> str:
    texts = [p.read_text() for p in (ROOT / "src" / "trine").rglob("*.py")]
    try:
        import tinker  # the official client's own messages (the `tml-` prefix)

        texts += [p.read_text() for p in Path(tinker.__file__).parent.rglob("*.py")]
    except ImportError:
        pass
    return "\n".join(texts)


def troubleshooting_fragments() -> list[str]:
    fragments = []
    for line in page("troubleshooting.md").splitlines():
        if not line.startswith("### "):
            continue
        spans = re.findall(r"``\s(.+?)\s``|`([^`]+)`", line[4:])
        for double, single in spans:
            fragments += [f.strip() for f in (double or single).split("…") if f.strip()]
    return fragments


def test_troubleshooting_quotes_messages_that_exist():
    fragments = troubleshooting_fragments()
    assert len(fragments) >= 20
    source = _sources()
    if "tml-' prefix" not in source:
        fragments = [f for f in fragments if "tml-" not in f]  # tinker needs Python >= 3.11
    missing = [f for f in fragments if f not in source]
    assert not missing, f"troubleshooting quotes messages the source no longer has: {missing}"


# ---------------------------------------------------------------------------- README


def test_readme_is_short_opens_with_the_two_commands_and_copies_no_counts():
    text = (ROOT / "README.md").read_text()
    lines = text.splitlines()
    assert len(lines) <= 250, f"README.md has {len(lines)} lines; the docs site is where the rest goes"
    fence = lines.index("```bash")
    assert lines[fence + 1].startswith("make demo") and lines[fence + 2].startswith("make test")
    assert not re.search(r"\b\d+\s+tests\b", text), "no hand-written test counts"
    for link in re.findall(r"\]\((docs/[^)#]+)", text):
        assert (ROOT / link).exists(), link


# ---------------------------------------------------------------------------- the site itself


def test_site_config_stays_offline():
    """No web fonts, no CDN: Material's `font: false`; no plugin or extra asset that loads from a CDN
    (Material's offline plugin adds a search shim from one; Mermaid and MathJax come from one)."""
    text = (ROOT / "mkdocs.yml").read_text()
    assert re.search(r"^\s+font: false$", text, re.M)
    assert not re.search(r"^\s+- offline$", text, re.M)
    settings = "\n".join(line for line in text.splitlines() if not line.lstrip().startswith("#"))
    assert not re.search(r"https?://", settings)
    assert not re.search(r"```mermaid|\$\$", "".join(p.read_text() for p in DOCS.rglob("*.md")))


def test_numbers_written_in_prose_match_the_code():
    """The few limits a page states inline (where a link to the Limits page would break the sentence)."""
    from trine import limits

    tinker = page("protocols/tinker.md")
    widths = {int(n) for n in re.findall(r"\b[kK] ≤ (\d+)", tinker)}
    assert widths == {limits.MAX_TOPK_PROMPT_LOGPROBS}


def test_readme_layout_names_paths_that_exist():
    text = (ROOT / "README.md").read_text()
    tree = text[text.index("## Layout") :]
    tree = tree[tree.index("```") + 3 :]
    tree = tree[: tree.index("```")]
    parent = ""
    checked = 0
    for line in tree.strip("\n").splitlines():
        name = line.split()[0]
        if not line.startswith(" "):
            parent = name if name.endswith("/") else ""
            path = ROOT / name
        else:
            path = ROOT / parent / name
        assert path.exists(), f"README's layout names {path.relative_to(ROOT)}, which does not exist"
        checked += 1
    assert checked >= 10
