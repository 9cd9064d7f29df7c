"""`trine keys`: create, list and revoke API keys of a data dir."""

from __future__ import annotations

import click

from trine.home import trine_home
from trine.store.keys import tinker_form

from .output import Column, print_json, print_table, when


def _store(home):
    from trine.store import Store

    return Store(trine_home(home))


@click.group()
def keys():
    """Manage API keys (stored hashed in $TRINE_HOME/trine.db)."""


@keys.command("create")
@click.option("--name", required=True, help="A label for the key (who or what uses it).")
@click.option("--home", default=None, help="Data dir (default $TRINE_HOME or ~/.trine).")
def create(name, home):
    """Create a key and print it. It is shown once; only its hash is kept."""
    try:
        rec, secret = _store(home).create_key(name)
    except ValueError as e:
        raise click.UsageError(str(e)) from None
    click.echo(secret)
    click.echo(
        f"(key id {rec.id}, name {rec.name!r}; store it now, it cannot be shown again; "
        f"the tinker client takes the same key as {tinker_form(secret)})",
        err=True,
    )


@keys.command("list")
@click.option("--home", default=None, help="Data dir (default $TRINE_HOME or ~/.trine).")
@click.option("--json", "as_json", is_flag=True, help="Print the list as JSON.")
def list_keys(home, as_json):
    """List key ids, names and creation times (never the keys themselves)."""
    records = [
        {
            "id": k.id,
            "name": k.name,
            "created_at": k.created_at,
            "revoked_at": k.revoked_at,
            "status": "revoked" if k.revoked_at else "active",
        }
        for k in _store(home).keys()
    ]
    if as_json:
        print_json(records)
        return
    print_table(
        "API keys",
        [Column("id"), Column("name", fold=True), Column("created"), Column("status")],
        [(r["id"], r["name"], when(r["created_at"]), r["status"]) for r in records],
        empty="no API keys (`trine keys create --name NAME` makes one)",
    )


@keys.command("revoke")
@click.argument("key_id")
@click.option("--home", default=None, help="Data dir (default $TRINE_HOME or ~/.trine).")
def revoke(key_id, home):
    """Revoke a key by its id (see `trine keys list`)."""
    if not _store(home).revoke_key(key_id):
        raise click.UsageError(f"no key with id {key_id!r}; see `trine keys list`")
    click.echo(f"revoked {key_id}")
