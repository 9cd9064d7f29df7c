"""Checkpoint paths the SDK accepts: `trio://` URIs and the Tinker form of the same checkpoints."""

from __future__ import annotations

from ..errors import ValidationError
from ..uris import as_trio_uri


def checkpoint_uri(path: str) -> str:
    """A checkpoint path as the server's PyTRIO plane names it: `trio://...` as is, and a Tinker
    `tinker://<run>/<weights|sampler_weights>/<name>` path mapped to it (as the OpenAI routes do)."""
    if not isinstance(path, str) or not path:
        raise ValidationError(f"checkpoint path must be a non-empty str, got {path!r}")
    try:
        return as_trio_uri(path)
    except ValueError as e:
        raise ValidationError(str(e)) from None
