"""MkDocs hook: the tables that would drift if written by hand are generated from the code at build time.

A page asks for one with a marker on a line of its own, `<!-- trine:table NAME -->`; `TABLES` maps each
NAME to a function returning Markdown. An unknown NAME fails the build (so `mkdocs build --strict`, which
`make test` runs, fails too), and `tests/docs/test_docs_tables.py` calls the same functions to check them
against the code and that every limit the code defines is listed here.

Engine facts are read in `_engine()` alone: when engine modules move, that is the one place to change.

Benchmark figures come the same way from `benchmarks/results/NAME.jsonl` (written by benchmarks/report.py,
one record per run): `<!-- trine:bench NAME -->` renders the file's last record (its date, machine, command
and figures), or says how to record one when there is none yet.
"""

from __future__ import annotations

import inspect
import json
import re
from pathlib import Path

MARKER = re.compile(r"^<!-- trine:table ([a-z_]+) -->$", re.M)


def _engine():
    """The engine modules the docs read facts from: the boundary (loss names, config keys, defaults,
    divisors), the losses' docstring table, and the engine's configuration (its fields, defaults,
    meanings and flags)."""
    from trine.engine import api, config
    from trine.engine.trainer import losses

    return api, losses, config


def _table(header: list[str], rows: list[list[str]]) -> str:
    out = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    out += ["| " + " | ".join(str(c).replace("|", "\\|") for c in row) + " |" for row in rows]
    return "\n".join(out)


def _code(v) -> str:
    return f"`{v}`"


def _number(v) -> str:
    if isinstance(v, float) and v.is_integer() and abs(v) < 1e15:
        v = int(v)
    if isinstance(v, int) and not isinstance(v, bool):
        for unit, size in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
            if v >= size and v % size == 0 and v != 2**63 - 1:
                return f"{v:,} ({v // size} {unit})"
        return f"{v:,}"
    return repr(v)


# ---------------------------------------------------------------------------- losses


def loss_rows() -> list[dict]:
    """One row per loss the engine accepts: its objective (from losses.py's docstring table), config
    keys with the defaults `Loss.parse` resolves, and what the PyTRIO planes divide its gradient by."""
    api, losses, _ = _engine()
    formulas = {}
    for line in (losses.__doc__ or "").splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) == 3 and cells[0] in api.LOSS_NAMES:
            formulas[cells[0]] = (cells[1], cells[2])
    fields = {
        "clip_low_threshold": "clip_low",
        "clip_high_threshold": "clip_high",
        "beta": "beta",
        "kl_coeff": "kl_coeff",
    }
    rows = []
    for name in api.LOSS_NAMES:
        resolved = api.Loss.parse(name)
        keys = api.LOSS_CONFIG_KEYS[name]
        if name == "cross_entropy":
            divisor = "active tokens (target ≠ −100 and weight ≠ 0)"
        elif name in api.ADVANTAGE_NORMALISED:
            divisor = "advantage tokens (target ≠ −100 and advantage ≠ 0)"
        else:
            divisor = "active tokens (target ≠ −100)"
        inputs, formula = formulas.get(name, ("?", "?"))
        rows.append(
            {
                "name": name,
                "inputs": inputs,
                "formula": formula,
                "divisor": divisor,
                "config": {k: getattr(resolved, fields[k]) for k in keys},
            }
        )
    return rows


def losses_table() -> str:
    rows = [
        [
            _code(r["name"]),
            r["inputs"],
            _code(r["formula"]),
            ", ".join(f"`{k}` = {_number(v)}" for k, v in r["config"].items()) or "none",
            r["divisor"],
        ]
        for r in loss_rows()
    ]
    return _table(
        [
            "loss",
            "inputs",
            "per-token loss (summed over tokens)",
            "`loss_fn_config` keys (default)",
            "PyTRIO planes divide the gradient by",
        ],
        rows,
    )


# ---------------------------------------------------------------------------- limits

# (where, attribute, what it bounds; None: its config field's meaning). tests/docs/test_docs_tables.py fails
# when trine.limits gains a limit this list does not name, so a new limit is documented when it is added.
LIMITS = [
    (
        "limits",
        "LORA_RANK_MIN",
        "smallest LoRA rank a server accepts (the SDK's `LoraConfig` asks 4 to 64, as PyTRIO does)",
    ),
    ("limits", "LORA_RANK_MAX", "largest LoRA rank a server accepts"),
    (
        "limits",
        "FULL_RANK",
        "the rank that asks for full-parameter fine-tuning (Tinker `rank=0`, the SDK's `full=True`); "
        "the PyTRIO plane refuses it",
    ),
    ("limits", "MAX_TRAINABLE_TOKENS", "`trainable_token_indices` of a full fine-tuning run"),
    ("limits", "MAX_WAITING_EVENTS_PER_RUN", "training events a run may have accepted and not yet executed"),
    ("limits", "CHECKPOINT_NAME_MAX", "characters in a checkpoint name (letters, digits, `.`, `_`, `-`)"),
    ("limits", "TEMPORARY_CHECKPOINT_TTL_SECONDS", "seconds a `temp-sampling-*` snapshot lives"),
    ("limits", "MAX_SAMPLES_PER_REQUEST", "`num_samples` (OpenAI: `n`) of one sample request"),
    ("limits", "MAX_TOPK_PROMPT_LOGPROBS", "width k of top-k prompt / sample logprobs, alt tokens (Tinker)"),
    ("limits", "MAX_REQUEST_ID_CHARS", "characters in a sample `request_id`"),
    ("limits", "MAX_STOP_STRINGS", "stop strings per request (PyTRIO, Tinker)"),
    ("limits", "MAX_STOP_STRING_CHARS", "characters in one stop string"),
    ("limits", "MAX_STOP_TOKEN_IDS", "stop token ids per request"),
    ("limits", "GREEDY_BELOW_TEMPERATURE", "a temperature below this samples greedily (argmax)"),
    (
        "limits",
        "MAX_IMAGE_PIXELS",
        "an image's width x height as decoded, read from its header before decoding",
    ),
    ("limits", "MAX_IMAGES_PER_INPUT", "images in one model input: a prompt, a datum, a chat's messages"),
    ("limits", "MAX_IMAGE_ASPECT_RATIO", "an image's longer side over its shorter side"),
    ("limits", "MAX_CONTROL_BYTES", "body of a control-plane request (bytes read, chunked bodies included)"),
    ("limits", "MAX_EVENT_BYTES", "body of one training event"),
    ("limits", "MAX_SAMPLE_BYTES", "body of one sample request"),
    ("limits", "MAX_BODY_BYTES", "body of any other route"),
    ("limits", "MAX_ADAPTER_UPLOAD_BYTES", "a PEFT adapter uploaded for import (`trine adapters import`)"),
    (
        "limits",
        "BODY_IDLE_SECONDS",
        "seconds a request body may send nothing before a 408 (`request_timeout`)",
    ),
    ("limits", "INT64_MAX", "integers on the wire: indexes, steps, seeds, offsets, limits"),
    ("limits", "MAX_PAGE_SIZE", "`limit` of every list route"),
    ("limits", "MAX_TTL_SECONDS", "a checkpoint's `ttl_seconds` (100 years)"),
    ("KeyLimits", "live_runs", "live training runs per API key (429 `key_limit_live_runs`)"),
    (
        "KeyLimits",
        "adapter_bytes",
        "adapter memory per key: weights, gradients, Adam moments (429 `key_limit_adapter_memory`)",
    ),
    (
        "KeyLimits",
        "queued_tokens",
        "training tokens accepted and not yet run, per key (429 `key_limit_queued_tokens`)",
    ),
    ("openai", "MAX_TOP_LOGPROBS", "OpenAI `top_logprobs`"),
    ("openai", "MAX_STOP_STRINGS", "OpenAI `stop` strings"),
    ("openai", "DEFAULT_COMPLETION_TOKENS", "`max_tokens` of `/v1/completions` when not given"),
    ("service", "CYCLE_TOKENS", "forward tokens of one clock cycle, split equally between keys with work"),
]
# The sampler's limits a request meets, in `SamplerConfig` (their meanings are its fields', engine/config.py).
SAMPLER_LIMITS = (
    "max_running",
    "max_batch_tokens",
    "prefill_step_seconds",
    "idle_prefill_seconds",
    "min_prefill_tokens",
    "burst_seconds",
    "burst_stall_seconds",
    "prefill_share",
    "tenant_share",
    "block_size",
)
LIMITS += [("sampler", name, None) for name in SAMPLER_LIMITS]


def limit_value(where: str, name: str):
    from trine import limits

    if where == "limits":
        return getattr(limits, name)
    if where == "KeyLimits":
        return getattr(limits.KeyLimits(), name)
    if where == "openai":
        from trine.server.openai import bodies

        return getattr(bodies, name)
    if where == "service":
        from trine.service import scheduler

        return getattr(scheduler, name)
    _, _, config = _engine()
    return getattr(config.SamplerConfig(), name)


def limit_meaning(where: str, name: str, what: str | None) -> str:
    """What a LIMITS row bounds: its own words, or for a sampler limit its config field's meaning."""
    if what is not None:
        return what
    import dataclasses

    _, _, config = _engine()
    doc = {f.name: f.metadata["doc"] for f in dataclasses.fields(config.SamplerConfig)}[name]
    return doc


def limits_table() -> str:
    from trine import limits

    rows = [
        [
            _code(f"sampler.{name}"),
            config_value(name, limit_value(where, name)),
            limit_meaning(where, name, what),
        ]
        if where == "sampler"
        else [_code(name), _number(limit_value(where, name)), what]
        for where, name, what in LIMITS
    ]
    for name, (lo, hi, closed) in limits.ADAM_BOUNDS.items():
        close = "]" if closed else ")"
        rng = f">= {_number(lo)}" if hi == float("inf") else f"[{_number(lo)}, {_number(hi)}{close}"
        rows.append([_code(f"AdamParams.{name}"), rng, "accepted range, checked before a step is queued"])
    for name, bound in limits.SAMPLING_BOUNDS.items():
        rows.append(
            [
                _code(f"SamplingParams.{name}"),
                bound.text(),
                "accepted range, checked by the SDK and every plane",
            ]
        )
    return _table(["limit", "value", "what it bounds"], rows)


# ---------------------------------------------------------------------------- engine configuration


def engine_config_rows() -> list[dict]:
    """One row per field of `EngineConfig` and of its nested `SamplerConfig` / `TrainerConfig`, named
    as a Python caller sets it (`sampler.max_running`), with its default, meaning and `trine serve`
    flag, all read from the dataclass fields (engine/config.py)."""
    import dataclasses

    _, _, config = _engine()
    nested = {"sampler": config.SamplerConfig, "trainer": config.TrainerConfig}
    rows = []
    for cls, prefix in ((config.EngineConfig, ""), *((c, f"{n}.") for n, c in nested.items())):
        defaults = cls()
        for f in dataclasses.fields(cls):
            if prefix == "" and f.name in nested:
                continue
            rows.append(
                {
                    "name": prefix + f.name,
                    "default": getattr(defaults, f.name),
                    "doc": f.metadata.get("doc"),
                    "flag": f.metadata.get("flag"),
                }
            )
    return rows


def config_value(name: str, v) -> str:
    """A config field's value as the docs write it: sizes with their units, counts and seconds as numbers."""
    if v is None:
        return "unset"
    if isinstance(v, (bool, str)):
        return _code(v)
    return _number(v) if name.endswith("_bytes") else f"{v:,}"


def engine_config_table() -> str:
    rows = [
        [
            _code(r["name"]),
            config_value(r["name"], r["default"]),
            r["doc"],
            _code(r["flag"]) if r["flag"] else "",
        ]
        for r in engine_config_rows()
    ]
    return _table(["field", "default", "meaning", "`trine serve` flag"], rows)


# ---------------------------------------------------------------------------- rate card


def rates_table() -> str:
    from trine.metering.rates import SHIPPED, RateCard

    card = RateCard.from_tomls([(str(SHIPPED), SHIPPED.read_text())])

    def usd(v: float) -> str:
        return f"{v:.6f}".rstrip("0").rstrip(".")

    rows = [
        [
            _code(p.model),
            usd(p.prefill),
            usd(p.prefill_cached),
            usd(p.sample),
            usd(p.train),
            usd(p.storage_gb_month),
            p.note,
        ]
        for p in card.rows.values()
    ]
    return _table(
        ["model", "prefill", "prefill_cached", "sample", "train", "storage (per GB-month)", "note"], rows
    )


# ---------------------------------------------------------------------------- refusals


def openai_refused_table() -> str:
    from trine.server.openai import bodies

    rows = [
        [_code(k), ", ".join(_code(_json(v)) for v in values if v is not None) or "absent", why]
        for k, (values, why) in sorted(bodies.NEUTRAL.items())
    ]
    return _table(["parameter", "accepted only as", "why other values are refused"], rows)


def _json(v) -> str:
    import json

    return json.dumps(v)


def tinker_refused_table() -> str:
    from trine.server.tinker import refused

    rows = [[f"`{m} /api/v1{p}`", feature, instead] for m, p, feature, instead in refused.REFUSED]
    return _table(["route", "feature", "use instead"], rows)


# ---------------------------------------------------------------------------- CLI


def cli_reference() -> str:
    import importlib

    import click

    from trine.cli.main import COMMANDS

    parts = []
    for name in sorted(COMMANDS):
        module, attr = COMMANDS[name]
        cmd = getattr(importlib.import_module(module), attr)
        parts.append(_command(f"trine {name}", cmd, click))
    return "\n\n".join(parts)


def _command(path: str, cmd, click) -> str:
    lines = [f"### `{path}`", ""]
    if cmd.help:
        lines += [inspect.cleandoc(cmd.help).split("\n\n")[0].replace("\b\n", ""), ""]
    args = [p.human_readable_name for p in cmd.params if isinstance(p, click.Argument)]
    if args:
        lines += [f"Arguments: {', '.join(_code(a) for a in args)}", ""]
    rows = []
    for p in cmd.params:
        if not isinstance(p, click.Option) or p.hidden:
            continue
        flags = ", ".join(_code(o) for o in p.opts + p.secondary_opts)
        if not p.is_flag and p.metavar:
            flags += f" {_code(p.metavar)}"
        default = p.default
        unset = default is None or type(default).__name__ == "Sentinel" or default == ()
        shown = "" if unset or p.is_flag or callable(default) else _code(default)
        if isinstance(p.type, click.Choice):
            shown = (shown + " of " if shown else "") + " / ".join(_code(c) for c in p.type.choices)
        rows.append([flags, shown, " ".join((p.help or "").split())])
    if rows:
        lines.append(_table(["option", "default", "meaning"], rows))
    out = "\n".join(lines)
    if isinstance(cmd, click.Group):
        subs = sorted(cmd.commands.items())
        out += "\n\n" + "\n\n".join(_command(f"{path} {n}", c, click) for n, c in subs)
    return out


TABLES = {
    "losses": losses_table,
    "limits": limits_table,
    "engine_config": engine_config_table,
    "rates": rates_table,
    "openai_refused": openai_refused_table,
    "tinker_refused": tinker_refused_table,
    "cli": cli_reference,
}


# ---------------------------------------------------------------------------- benchmark results

BENCH_MARKER = re.compile(r"^<!-- trine:bench ([a-z0-9_]+) -->$", re.M)
RESULTS = Path(__file__).resolve().parents[2] / "benchmarks" / "results"
# Benchmarks that print text, not a JSON object, so benchmarks/report.py cannot record them yet.
UNRECORDED = {"probe_prefill"}


def bench_records(name: str) -> list[dict]:
    path = RESULTS / f"{name}.jsonl"
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def _figure(v) -> str:
    """A value as the table shows it: floats to 4 significant digits, lists and deeper dicts inline."""
    if isinstance(v, float):
        return f"{v:.4g}"
    if isinstance(v, list):
        return ", ".join(_figure(x) for x in v)
    if isinstance(v, dict):
        return "; ".join(f"{k} {_figure(x)}" for k, x in v.items())
    return str(v)


def _rows(result: dict, prefix: str = "", depth: int = 2) -> list[list[str]]:
    """Dotted keys down to `depth` levels of nesting; anything deeper is shown inline by `_figure`."""
    rows = []
    for k, v in result.items():
        key = f"{prefix}{k}"
        if isinstance(v, dict) and depth > 1:
            rows += _rows(v, f"{key}.", depth - 1)
        else:
            rows.append([_code(key), _figure(v)])
    return rows


FEATURE_NAMES = {"amx": "AMX", "avx512_bf16": "AVX512-BF16", "avx512": "AVX-512"}


def _cpu_kind(machine: dict) -> str:
    """The CPU as a record names it: its model, and (records since report.py read them) its vendor and
    which of AMX, AVX512-BF16 and AVX-512 it has, which decide the kernels it runs."""
    if "cpu_features" not in machine:
        return machine["cpu"]
    features = [FEATURE_NAMES.get(f, f) for f in machine["cpu_features"]] or ["no AVX-512"]
    return f"{machine['cpu']} ({', '.join([machine.get('cpu_vendor') or 'vendor unknown', *features])})"


def bench_table(name: str) -> str:
    records = bench_records(name)
    if not records and name in UNRECORDED:
        return f"*Not yet recorded in this format: `benchmarks/{name}.py` prints text, not a JSON object.*"
    if not records:
        return f"*Not yet recorded in this format; run `.venv/bin/python benchmarks/{name}.py --json`.*"
    r = records[-1]
    m = r["machine"]
    where = [_cpu_kind(m), f"{m['cores']} cores", f"torch {m['torch']}"]
    if m.get("load_average"):
        where.append(f"load average {' '.join(f'{x:.1f}' for x in m['load_average'])} at the end")
    if m.get("note"):
        where.append(m["note"])
    lines = [
        f"*Recorded {r['date']} on {', '.join(where)}; `{r['command']}`; "
        f"the last of {len(records)} record(s) in `benchmarks/results/{name}.jsonl`.*",
    ]
    if r.get("note"):
        lines += ["", f"*{r['note']}.*"]
    return "\n".join([*lines, "", _table(["figure", "value"], _rows(r["result"]))])


def render(markdown: str, where: str = "") -> str:
    def one(m: re.Match) -> str:
        name = m.group(1)
        if name not in TABLES:
            raise ValueError(f"{where}: unknown generated table {name!r}; known: {', '.join(sorted(TABLES))}")
        return TABLES[name]()

    return BENCH_MARKER.sub(lambda m: bench_table(m.group(1)), MARKER.sub(one, markdown))


def on_page_markdown(markdown, page, config, files):
    return render(markdown, page.file.src_path)
