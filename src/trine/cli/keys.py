"""`trine keys`: create, list and revoke API keys of a data dir.

`create` and `revoke` write, so they claim the data dir (datadir.py): beside a live `trine serve`
they exit 2 naming it (create and revoke keys of a running server through it, or stop it first).
`list` only reads and works beside a live server."""

from __future__ import annotations

import click

from trine.store.keys import tinker_form

from .datadir import reader, writer
from .output import Column, print_json, print_table, when


@click.group()
def keys():
    """Manage API keys (stored hashed in $TRINE_HOME/trine.db)."""


@keys.command("create")
@click.option("--name", required=True, help="A label for the key (who or what uses it).")
@click.option("--home", default=None, help="Data dir (default $TRINE_HOME or ~/.trine).")
def create(name, home):
    """Create a key and print it. It is shown once; only its hash is kept."""
    store = writer(home, "trine keys create")
    try:
        rec, secret = store.create_key(name)
    except ValueError as e:
        raise click.UsageError(str(e)) from None
    finally:
        store.close()
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
        for k in _read_keys(home)
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
    store = writer(home, "trine keys revoke")
    try:
        if not store.revoke_key(key_id):
            raise click.UsageError(f"no key with id {key_id!r}; see `trine keys list`")
    finally:
        store.close()
    click.echo(f"revoked {key_id}")


def _read_keys(home) -> list:
    store = reader(home)
    if store is None:  # no database yet: no keys
        return []
    try:
        return store.keys()
    finally:
        store.close()
