"""`trine adapters import DIR`: a PEFT adapter trained elsewhere, uploaded to a server as a checkpoint."""

from __future__ import annotations

from pathlib import Path

import click

from ..metering import remote
from .output import print_json


@click.group()
def adapters():
    """LoRA adapters trained elsewhere."""


@adapters.command("import")
@click.argument("directory", type=click.Path(exists=True, file_okay=False, path_type=Path))
@click.option("--base-model", required=True, help="The served model the adapter was trained on.")
@click.option("--name", default=None, help="The checkpoint's name (default: the directory's name).")
@click.option("--url", default=None, help="The server (default $TRINE_BASE_URL, else http://127.0.0.1:8000).")
@click.option("--api-key", default=None, help="API key (default $TRINE_API_KEY).")
@click.option("--json", "as_json", is_flag=True, help="Print the new checkpoint as JSON.")
def import_(directory, base_model, name, url, api_key, as_json):
    """Import the PEFT adapter in DIRECTORY (adapter_config.json + adapter_model.safetensors) onto
    BASE_MODEL. The server checks it against the model first (the modules it adapts, their shapes,
    its rank and dtype, the base model its config names) and keeps it as a sampler checkpoint: sample
    it, train from it (`create_training_client_from_state(URI)`), export or download it."""
    import httpx

    from ..client.rest import adapter_archive, checkpoint_name
    from ..errors import ValidationError

    server = remote.server_url(url) or "http://127.0.0.1:8000"
    try:
        key = remote.api_key(api_key)
        archive = adapter_archive(directory)
    except (ValueError, ValidationError) as e:
        raise click.ClickException(str(e)) from None
    params = {
        "base_model": base_model,
        "name": name or checkpoint_name(directory.resolve().name),
        "filename": directory.name,
    }
    try:
        r = httpx.post(
            f"{server}/api/trine/v1/adapters",
            params=params,
            content=archive,
            timeout=None,
            headers={"X-API-Key": key, "Authorization": f"Bearer {key}"},
        )
    except httpx.HTTPError as e:
        raise click.ClickException(f"cannot reach the trine server at {server}: {e}") from None
    body = r.json() if r.headers.get("content-type", "").startswith("application/json") else {}
    if r.status_code >= 400:
        raise click.ClickException(
            f"the import was refused ({r.status_code}): {body.get('message') or r.text}"
        )
    if as_json:
        print_json(body)
        return
    click.echo(f"imported {directory} as {body['checkpoint_uri']} ({body['size_bytes']} bytes)")
    click.echo(f"source: {body.get('source')}")
