"""`trine runs`: training runs on a server, as the console shows them: name, tags, LoRA, the last
optimizer settings, the last value of each logged metric; one run's steps and metrics."""

from __future__ import annotations

import csv
import sys

import click

from ..metering import remote
from ..metering.report import fmt_lora, fmt_metrics, fmt_optimizer
from .output import Column, console, print_json, print_table, when

SERVER = [
    click.option("--url", help="The server (default $TRINE_BASE_URL)."),
    click.option("--api-key", help="API key for --url (default $TRINE_API_KEY)."),
]


def _server(f):
    for opt in reversed(SERVER):
        f = opt(f)
    return f


def _get(url, api_key, path, params=None):
    url = remote.server_url(url) or "http://127.0.0.1:8000"
    try:
        return remote.get_json(url, remote.api_key(api_key), path, params)
    except (ValueError, ConnectionError) as e:
        raise click.ClickException(str(e)) from None


@click.group()
def runs():
    """Training runs on a server: list them, or show one's steps and logged metrics."""


@runs.command("list")
@_server
@click.option("--json", "as_json", is_flag=True, help="Print the runs as JSON.")
def list_(url, api_key, as_json):
    """The key's training runs, newest first."""
    rows = _get(url, api_key, "/api/trine/v1/training-runs")["runs"]
    if as_json:
        print_json(rows)
        return
    cols = [
        Column("run"),
        Column("name", fold=True),
        Column("tags", fold=True),
        Column("model", fold=True),
        Column("lora"),
        Column("state"),
        Column("steps", numeric=True),
        Column("samplers", numeric=True),
        Column("optimizer", fold=True),
        Column("last metrics", fold=True),
        Column("created"),
    ]
    print_table(
        "training runs",
        cols,
        [
            (
                r["id"],
                r["name"] or "",
                ", ".join(r["tags"]),
                r["model"],
                fmt_lora(r["lora"]),
                r["state"],
                f"{r['steps']:,}",
                f"{r['samplers']:,}",
                fmt_optimizer(r["optimizer"]),
                fmt_metrics(r["last_metrics"]),
                when(r["created_at"]),
            )
            for r in rows
        ],
        empty="no training runs",
    )


@runs.command()
@click.argument("run_id")
@_server
@click.option("--json", "as_json", is_flag=True, help="Print the run, its steps and metrics as JSON.")
@click.option(
    "--csv", "as_csv", is_flag=True, help="Print its metrics by step as CSV (the console's download)."
)
def show(run_id, url, api_key, as_json, as_csv):
    """One run: its labels, LoRA, optimizer, each step's loss and time, and every logged metric."""
    if as_csv:
        table = _get(url, api_key, f"/api/trine/v1/training-runs/{run_id}/metrics")
        w = csv.writer(sys.stdout, lineterminator="\n")
        w.writerow(table["columns"])
        w.writerows([["" if v is None else v for v in row] for row in table["rows"]])
        return
    d = _get(url, api_key, f"/api/trine/v1/training-runs/{run_id}")
    if as_json:
        print_json(d)
        return
    r, out = d["run"], console()
    out.print(f"[bold]{r['id']}[/bold] {r['name'] or ''}  ({r['state']}, {r['model']})")
    for label, value in (
        ("tags", ", ".join(r["tags"])),
        ("lora", fmt_lora(r["lora"])),
        ("optimizer", fmt_optimizer(r["optimizer"])),
        ("samplers", str(r["samplers"])),
        ("metadata", ", ".join(f"{k}={v}" for k, v in r["user_metadata"].items())),
        ("last metrics", fmt_metrics(r["last_metrics"])),
        ("created", when(r["created_at"])),
    ):
        if value:
            out.print(f"  {label}: {value}")
    table = _get(url, api_key, f"/api/trine/v1/training-runs/{run_id}/metrics")
    fmt = lambda x: "-" if x is None else f"{x:.4g}"  # noqa: E731
    print_table(
        "steps",
        [Column(c.removeprefix("train:"), numeric=True) for c in table["columns"]],
        [(str(row[0]), *map(fmt, row[1:])) for row in table["rows"]],
        empty="no steps and no logged metrics yet",
    )
