"""The tokenizer of a served model, loaded on the client, never from a model hub.

Resolution: if the server's `model_id` is a directory on this machine holding a tokenizer (same
host), load it from there. Otherwise fetch the tokenizer files from the server once
(`GET /api/trine/v1/models/{model}/tokenizer` lists the files, `.../tokenizer/{file}` serves one) into
`$TRINE_HOME/tokenizers/<model>/` (written to a temporary dir, then renamed: the cache dir is
either absent or complete; `.model_id` records which server model it came from) and load that.
"""

from __future__ import annotations

import re
import shutil
import tempfile
from pathlib import Path
from typing import Any

from ..home import trine_home


def _load(directory: Path) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(directory), local_files_only=True)


def _has_tokenizer(directory: Path) -> bool:
    return directory.is_dir() and (directory / "tokenizer.json").is_file()


def cache_dir(model_alias: str) -> Path:
    return trine_home() / "tokenizers" / re.sub(r"[^A-Za-z0-9._-]+", "_", model_alias)


def write_cache(directory: Path, model_id: str, files: dict[str, bytes]) -> None:
    if "tokenizer.json" not in files:
        raise ValueError("the server's tokenizer has no tokenizer.json")
    directory.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=directory.parent, prefix=".tmp-"))
    try:
        for name, content in files.items():
            if "/" in name or name.startswith("."):
                raise ValueError(f"the server sent an unsafe tokenizer file name {name!r}")
            (tmp / name).write_bytes(content)
        (tmp / ".model_id").write_text(model_id, encoding="utf-8")
        if directory.exists():
            shutil.rmtree(directory)
        tmp.rename(directory)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


async def fetch_tokenizer_files(control, model_alias: str) -> dict[str, bytes]:
    listing = await control.call("GET", f"trine/v1/models/{model_alias}/tokenizer")
    names = listing.get("files")
    if not isinstance(names, list) or not all(isinstance(n, str) for n in names):
        raise ValueError(f"the server's tokenizer listing for {model_alias!r} has no 'files' list")
    return {n: await control.get_bytes(f"trine/v1/models/{model_alias}/tokenizer/{n}") for n in names}


def resolve_local(model_id: str, model_alias: str) -> Any | None:
    """The tokenizer if it is available without the network, else None."""
    local = Path(model_id)
    if local.is_absolute() and _has_tokenizer(local):
        return _load(local)
    cached = cache_dir(model_alias)
    marker = cached / ".model_id"
    if _has_tokenizer(cached) and marker.is_file() and marker.read_text(encoding="utf-8") == model_id:
        return _load(cached)
    return None


def install(model_id: str, model_alias: str, files: dict[str, bytes]) -> Any:
    directory = cache_dir(model_alias)
    write_cache(directory, model_id, files)
    return _load(directory)


__all__ = ["cache_dir", "fetch_tokenizer_files", "install", "resolve_local", "trine_home"]
