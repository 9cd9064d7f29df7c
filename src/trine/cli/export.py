"""`trine export CHECKPOINT OUT [--merged]`: a saved checkpoint as a PEFT adapter or a merged model."""

from __future__ import annotations

from pathlib import Path

import click

from trine.home import trine_home

from ..metering import remote
from ..uris import as_trio_uri
from .checkpoints import download, in_memory, server_of


def checkpoint_dir(checkpoint: str, home: Path) -> Path:
    """A checkpoint's directory: CHECKPOINT is a directory, a `trio://` URI (or `tinker://` path) or a
    checkpoint id of `home`."""
    if Path(checkpoint).expanduser().is_dir():
        return Path(checkpoint).expanduser()
    from .datadir import reader

    store = reader(home)
    if store is None:
        raise click.BadParameter(
            f"{checkpoint!r} is not a directory, and {home} has no trine.db to look it up in: pass "
            "--home the server's data dir (`trine checkpoints --home DIR` lists its checkpoints)",
            param_hint="CHECKPOINT",
        )
    try:
        ck = store.checkpoint_by_uri(as_trio_uri(checkpoint)) or store.checkpoint(checkpoint)
    except ValueError as e:  # a malformed tinker:// path
        raise click.BadParameter(str(e), param_hint="CHECKPOINT") from None
    finally:
        store.close()
    if ck is None:
        raise click.BadParameter(
            f"{checkpoint!r} is not a directory, nor a checkpoint URI or id in {home} "
            "(see `trine checkpoints`)",
            param_hint="CHECKPOINT",
        )
    if not ck.path:
        raise in_memory(ck.uri)
    return Path(ck.path)


def named_model_dir(adapter_dir: Path, home: Path) -> Path | None:
    """For a checkpoint that records only its base model's name: that model under `home`/models."""
    import json

    from trine.engine.trainer.checkpoint import ADAPTER_CONFIG, trine_facts

    cfg = json.loads((adapter_dir / ADAPTER_CONFIG).read_text())
    name = trine_facts(adapter_dir).get("base_model") or cfg.get("base_model_name_or_path") or ""
    candidate = home / "models" / Path(str(name)).name
    return candidate if name and (candidate / "config.json").is_file() else None


@click.command()
@click.argument("checkpoint")
@click.argument("out", type=click.Path(path_type=Path))
@click.option(
    "--merged",
    is_flag=True,
    help="Write a full Hugging Face model (weights merged, tokenizer and chat template copied) "
    "instead of a PEFT adapter.",
)
@click.option(
    "--base",
    "base_dir",
    type=click.Path(exists=True, file_okay=False, path_type=Path),
    help="The base model's directory (default: the one the checkpoint records).",
)
@click.option(
    "--home", default=None, help="Data dir whose checkpoints URIs refer to (default $TRINE_HOME or ~/.trine)."
)
@click.option(
    "--url",
    default=None,
    help="Download CHECKPOINT from this server first (default $TRINE_BASE_URL, "
    "unless --home is given or CHECKPOINT is a directory).",
)
@click.option("--api-key", default=None, help="API key for --url (default $TRINE_API_KEY).")
def export(checkpoint, out, merged, base_dir, home, url, api_key):
    """Export CHECKPOINT (a checkpoint id or trio:// URI as `trine checkpoints` lists them, a
    tinker:// path, or a checkpoint directory) to OUT.

    Without --merged, OUT is a PEFT adapter directory that `peft` loads
    (AutoPeftModelForCausalLM.from_pretrained(OUT)); with --merged, a model directory that
    `transformers` and vLLM load on their own. A full fine-tuning run's checkpoint is such a model
    directory either way. With --url the checkpoint is downloaded from the
    server; --merged then needs the base model here (--base DIR, or the same model under
    $TRINE_HOME/models)."""
    import tempfile

    server = None if Path(checkpoint).expanduser().is_dir() else server_of(url, home)
    home = trine_home(home)
    if server is None:
        _export(checkpoint_dir(checkpoint, home), out, merged, base_dir, home)
    else:
        with tempfile.TemporaryDirectory(prefix=".trine-export-") as tmp:
            try:
                download(server, remote.api_key(api_key), checkpoint, Path(tmp))
            except (ValueError, ConnectionError) as e:
                raise click.ClickException(str(e)) from None
            _export(Path(tmp), out, merged, base_dir, home)
    what = "merged model" if merged else "PEFT adapter"
    click.echo(f"wrote the {what} of {checkpoint} to {out}")


def _export(src: Path, out: Path, merged: bool, base_dir: Path | None, home: Path) -> None:
    from trine.engine.trainer.checkpoint import read_lora_config
    from trine.engine.trainer.export import base_model_dir, export_adapter, export_merged, export_model_dir
    from trine.engine.trainer.full import is_full_checkpoint

    try:
        if is_full_checkpoint(src):  # a full fine-tuning run's weights are a model already
            export_model_dir(src, out)
            return
        read_lora_config(src)  # refuses a directory that is not a LoRA checkpoint, naming what it lacks
        if base_dir is None and base_model_dir(src) is None:
            base_dir = named_model_dir(src, home)
        if merged:
            export_merged(src, out, base_dir)
        else:
            export_adapter(src, out, base_dir)
    except (ValueError, OSError) as e:  # not a checkpoint, unknown base, OUT not empty, disk full
        raise click.ClickException(str(e)) from None
