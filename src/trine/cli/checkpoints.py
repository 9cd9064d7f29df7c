"""`trine checkpoints`: the checkpoints kept in a data dir (training states and sampler weights)."""
from __future__ import annotations

import datetime
import json

import click

from trine.home import trine_home


@click.command()
@click.option("--home", default=None, help="Data dir (default $TRINE_HOME or ~/.trine).")
@click.option("--run", "run_id", default=None, help="Only this training run's checkpoints.")
@click.option("--json", "as_json", is_flag=True, help="One JSON object per line.")
def checkpoints(home, run_id, as_json):
    """List checkpoints: URI (what a client passes to load it), kind, base model, size, expiry."""
    from trine.store import Store

    rows, _ = Store(trine_home(home)).checkpoints(training_run_id=run_id)
    for c in rows:
        if as_json:
            click.echo(json.dumps({"uri": c.uri, "kind": c.kind, "visibility": c.visibility,
                                   "base_model": c.base_model, "size_bytes": c.size_bytes,
                                   "path": c.path, "created_at": c.created_at, "expires_at": c.expires_at}))
            continue
        created = datetime.datetime.fromtimestamp(c.created_at).strftime("%Y-%m-%d %H:%M")
        expires = (datetime.datetime.fromtimestamp(c.expires_at).strftime("%Y-%m-%d %H:%M")
                   if c.expires_at else "never")
        where = c.path or "(in memory)"
        click.echo(f"{c.uri}\t{c.kind}\t{c.base_model}\t{c.size_bytes / 1e6:.1f} MB\t{created}\t"
                   f"expires {expires}\t{where}")
    if not rows and not as_json:
        click.echo("no checkpoints", err=True)
