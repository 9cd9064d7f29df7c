"""`trine checkpoints`: the checkpoints kept in a data dir (training states and sampler weights)."""
from __future__ import annotations

import click

from trine.home import trine_home

from .output import Column, print_json, print_table, size, when


@click.command()
@click.option("--home", default=None, help="Data dir (default $TRINE_HOME or ~/.trine).")
@click.option("--run", "run_id", default=None, help="Only this training run's checkpoints.")
@click.option("--json", "as_json", is_flag=True, help="Print the list as JSON.")
def checkpoints(home, run_id, as_json):
    """List checkpoints: URI (what a client passes to load it), kind, base model, size, expiry.
    `trine export URI OUT` writes one as a PEFT adapter or a merged model."""
    from trine.store import Store

    rows, _ = Store(trine_home(home)).checkpoints(training_run_id=run_id)
    records = [{"uri": c.uri, "name": c.name, "kind": c.kind, "visibility": c.visibility,
                "base_model": c.base_model, "training_run_id": c.training_run_id, "step": c.step,
                "size_bytes": c.size_bytes, "path": c.path, "created_at": c.created_at,
                "expires_at": c.expires_at} for c in rows]
    if as_json:
        print_json(records)
        return
    cols = [Column("uri", fold=True), Column("kind"), Column("base model", fold=True),
            Column("size", numeric=True), Column("created"), Column("expires"), Column("path", fold=True)]
    print_table("checkpoints", cols,
                [(r["uri"], r["kind"].lower(), r["base_model"], size(r["size_bytes"]), when(r["created_at"]),
                  when(r["expires_at"], never="never"), r["path"] or "(in memory)") for r in records],
                empty="no checkpoints" + (f" for run {run_id}" if run_id else ""))
