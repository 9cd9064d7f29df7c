"""`trine export CHECKPOINT OUT [--merged]`: a saved checkpoint as a PEFT adapter or a merged model."""
from __future__ import annotations

from pathlib import Path

import click

from trine.home import trine_home


def checkpoint_dir(checkpoint: str, home: Path) -> Path:
    """A checkpoint's directory: CHECKPOINT is a directory, a `trio://` URI or a checkpoint id of `home`."""
    if Path(checkpoint).expanduser().is_dir():
        return Path(checkpoint).expanduser()
    from trine.store import Store

    store = Store(home)
    try:
        ck = store.checkpoint_by_uri(checkpoint) or store.checkpoint(checkpoint)
    finally:
        store.close()
    if ck is None:
        raise click.BadParameter(f"{checkpoint!r} is not a directory, nor a checkpoint URI or id in {home} "
                                 "(see `trine checkpoints`)", param_hint="CHECKPOINT")
    if not ck.path:
        raise click.BadParameter(f"{ck.uri} is a temporary snapshot held in the server's memory; save it with "
                                 "`save_weights_for_sampler(name)` or `save_state(name)` and export that",
                                 param_hint="CHECKPOINT")
    return Path(ck.path)


@click.command()
@click.argument("checkpoint")
@click.argument("out", type=click.Path(path_type=Path))
@click.option("--merged", is_flag=True,
              help="Write a full Hugging Face model (weights merged, tokenizer and chat template copied) "
                   "instead of a PEFT adapter.")
@click.option("--base", "base_dir", type=click.Path(exists=True, file_okay=False, path_type=Path),
              help="The base model's directory (default: the one the checkpoint records).")
@click.option("--home", default=None, help="Data dir whose checkpoints URIs refer to (default $TRINE_HOME or ~/.trine).")
def export(checkpoint, out, merged, base_dir, home):
    """Export CHECKPOINT (a trio:// URI, a checkpoint id or a checkpoint directory) to OUT.

    Without --merged, OUT is a PEFT adapter directory that `peft` loads
    (AutoPeftModelForCausalLM.from_pretrained(OUT)); with --merged, a model directory that
    `transformers` and vLLM load on their own."""
    from trine.engine.export import export_adapter, export_merged

    src = checkpoint_dir(checkpoint, trine_home(home))
    try:
        if merged:
            export_merged(src, out, base_dir)
        else:
            export_adapter(src, out, base_dir)
    except (ValueError, OSError) as e:
        raise click.ClickException(str(e)) from None
    what = "merged model" if merged else "PEFT adapter"
    click.echo(f"wrote the {what} of {checkpoint} to {out}")
