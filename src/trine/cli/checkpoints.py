"""`trine checkpoints`: the checkpoints of a data dir or of a server (training states and sampler weights)."""

from __future__ import annotations

import datetime
from pathlib import Path

import click

from ..metering import remote
from .output import Column, print_json, print_table, size, when


def server_of(url: str | None, home) -> str | None:
    """The server a command reads: `--url`, else $TRINE_BASE_URL unless `--home` names a data dir."""
    return remote.server_url(url) if url or home is None else None


@click.command()
@click.option("--home", default=None, help="Data dir to read directly (default $TRINE_HOME or ~/.trine).")
@click.option(
    "--url",
    default=None,
    help="List a server's checkpoints instead (default $TRINE_BASE_URL, unless --home is given).",
)
@click.option("--api-key", default=None, help="API key for --url (default $TRINE_API_KEY).")
@click.option("--run", "run_id", default=None, help="Only this training run's checkpoints.")
@click.option("--json", "as_json", is_flag=True, help="Print the list as JSON.")
def checkpoints(home, url, api_key, run_id, as_json):
    """List checkpoints: id and URI (either is what `trine export` and clients take), kind, base model,
    step, size, expiry. `trine export ID OUT` writes one as a PEFT adapter or a merged model."""
    server = server_of(url, home)
    try:
        records = (
            remote_records(server, remote.api_key(api_key), run_id) if server else local_records(home, run_id)
        )
    except (ValueError, ConnectionError) as e:
        raise click.ClickException(str(e)) from None
    if as_json:
        print_json(records)
        return
    cols = [
        Column("id"),
        Column("uri", fold=True),
        Column("kind"),
        Column("base model", fold=True),
        Column("step", numeric=True),
        Column("size", numeric=True),
        Column("created"),
        Column("expires"),
    ]
    rows = [
        (
            r["id"],
            r["uri"],
            r["kind"].lower(),
            r["base_model"],
            str(r["step"]),
            size(r["size_bytes"]),
            when(r["created_at"]),
            when(r["expires_at"], never="never"),
        )
        for r in records
    ]
    if not server:
        cols.append(Column("path", fold=True))
        rows = [(*row, r["path"] or "(in memory)") for row, r in zip(rows, records)]
    print_table(
        "checkpoints" + (f" on {server}" if server else ""),
        cols,
        rows,
        empty="no checkpoints" + (f" for run {run_id}" if run_id else ""),
    )


def local_records(home, run_id: str | None) -> list[dict]:
    from .datadir import reader

    store = reader(home)
    if store is None:
        return []
    try:
        rows, _ = store.checkpoints(training_run_id=run_id)
    finally:
        store.close()
    return [
        {
            "id": c.id,
            "uri": c.uri,
            "name": c.name,
            "kind": c.kind,
            "visibility": c.visibility,
            "base_model": c.base_model,
            "training_run_id": c.training_run_id,
            "step": c.step,
            "size_bytes": c.size_bytes,
            "path": c.path,
            "created_at": c.created_at,
            "expires_at": c.expires_at,
        }
        for c in rows
    ]


def remote_records(url: str, key: str, run_id: str | None) -> list[dict]:
    """The key's checkpoints on a server (PyTRIO's checkpoint listing, every page), as local_records
    shapes them (no `path`: a server never shows its paths)."""
    path = f"/api/openapi/v1/training-runs/{run_id}/checkpoints" if run_id else "/api/openapi/v1/checkpoints"
    items: list[dict] = []
    while True:
        page = remote.get_json(url, key, path, {"limit": 1000, "offset": len(items)})
        items += page["checkpoints"]
        total = (page.get("cursor") or {}).get("total", len(items))
        if not page["checkpoints"] or len(items) >= total:
            break
    return [
        {
            "id": c["checkpoint_cuid"],
            "uri": c["checkpoint_uri"],
            "name": c["name"],
            "kind": c["checkpoint_type"],
            "visibility": c["visibility"],
            "base_model": c["model_spec_cuid"],
            "training_run_id": c["training_run_cuid"],
            "step": c["step"],
            "size_bytes": c["size_bytes"],
            "downloadable": c["is_uploaded"],
            "created_at": _timestamp(c["created_at"]),
            "expires_at": _timestamp(c["expired_at"]),
        }
        for c in items
    ]


def in_memory(uri: str) -> click.BadParameter:
    return click.BadParameter(
        f"{uri} is a temporary snapshot held in the server's memory; save it with "
        "`save_weights_for_sampler(name)` or `save_state(name)` and export that",
        param_hint="CHECKPOINT",
    )


def _timestamp(iso: str | None) -> float | None:
    return datetime.datetime.fromisoformat(iso.replace("Z", "+00:00")).timestamp() if iso else None


def download(url: str, key: str, checkpoint: str, into: Path) -> dict:
    """Fetch a server's checkpoint (by id, `trio://` URI or `tinker://` path) into the directory
    `into` (its files, extracted); returns its record."""
    import httpx

    from ..client.rest import extract_checkpoint
    from ..uris import as_trio_uri

    try:
        uri = as_trio_uri(checkpoint)
    except ValueError as e:
        raise click.BadParameter(str(e), param_hint="CHECKPOINT") from None
    found = [
        r for r in remote_records(url, key, None) if checkpoint in (r["id"], r["uri"]) or uri == r["uri"]
    ]
    if not found:
        raise click.BadParameter(
            f"{checkpoint!r} is not a checkpoint id or URI of this key on {url} "
            "(see `trine checkpoints --url URL`)",
            param_hint="CHECKPOINT",
        )
    ck = found[0]
    if not ck["downloadable"]:
        raise in_memory(ck["uri"])
    link = remote.get_json(url, key, f"/api/openapi/v1/checkpoints/{ck['id']}/download-url")["url"]
    archive = into / f".{ck['id']}.tar"
    try:
        with httpx.stream("GET", link, timeout=None, follow_redirects=True) as r:
            if r.status_code != 200:
                raise ConnectionError(f"downloading {ck['uri']} from {url} answered HTTP {r.status_code}")
            with archive.open("wb") as f:
                for block in r.iter_bytes():
                    f.write(block)
    except httpx.HTTPError as e:
        raise ConnectionError(f"cannot download {ck['uri']} from {url}: {e}") from None
    try:
        extract_checkpoint(archive, into)
    finally:
        archive.unlink(missing_ok=True)
    return ck
