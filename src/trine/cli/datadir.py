"""How a command opens its data dir and the other paths an operator names (`--home`,
`--checkpoint-dir`, `--model`): checked before anything loads, each mistake one line and exit 2.

Invariants
- A path that cannot serve its purpose (a regular file where a directory goes, a directory that
  cannot be created or written, a model that is not a directory) is reported as `PathError`:
  one line naming the option, the path and what is wrong with it, exit status 2, no traceback.
- Writability is tried, not inferred from mode bits: a probe file is created and removed, so a
  read-only mount, a full disk or a missing permission are found even when running as root.
- A command that writes the data dir (`writer`) holds its claim (store/owner.py) for as long as
  it runs; another owner is `PathError` naming that owner's pid, host and address. Readers
  (`reader`) never claim and work beside a live server.
"""

from __future__ import annotations

import errno
import os
import tempfile
from pathlib import Path

import click

from trine.home import trine_home


class PathError(click.ClickException):
    """A path an operator gave cannot be used: one line, exit status 2 (a usage error)."""

    exit_code = 2


def _first_file_above(path: Path) -> Path | None:
    """The nearest existing ancestor of `path` that is not a directory, if there is one."""
    for parent in path.parents:
        if parent.exists():
            return parent if not parent.is_dir() else None
    return None


def writable_dir(path: str | Path, option: str, *, purpose: str = "a directory this user can write") -> Path:
    """`path` as a directory this process can write, created if missing; else `PathError`."""
    path = Path(path).expanduser()
    if path.exists() and not path.is_dir():
        raise PathError(f"{option} {path}: is a file, not a directory; give {purpose}")
    if not path.exists():
        blocker = _first_file_above(path)
        if blocker is not None:
            raise PathError(f"{option} {path}: cannot be a directory, {blocker} is a file; give {purpose}")
        try:
            path.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise PathError(f"{option} {path}: cannot create it ({_why(e)}); give {purpose}") from None
    try:
        fd, probe = tempfile.mkstemp(prefix=".trine-write-probe-", dir=path)
        os.close(fd)
        os.unlink(probe)
    except OSError as e:
        raise PathError(f"{option} {path}: cannot write there ({_why(e)}); give {purpose}") from None
    return path


def _why(e: OSError) -> str:
    if e.errno == errno.EROFS:
        return "read-only file system"
    return e.strerror or type(e).__name__


def model_path(spec: str, target: str) -> None:
    """Refuse a `--model` that names an existing path which is not a directory."""
    path = Path(target).expanduser()
    if path.exists() and not path.is_dir():
        raise PathError(
            f"--model {spec}: {path} is a file, not a model directory; give a Hugging Face checkpoint "
            "directory (config.json, *.safetensors, tokenizer files)"
        )


def home_dir(home: str | Path | None) -> Path:
    """The data dir (`--home`, else $TRINE_HOME, else ~/.trine), checked to be a writable directory."""
    return writable_dir(
        trine_home(home), "--home", purpose="a directory this user can write for trine's data"
    )


def claim(home: Path, *, command: str, host: str | None = None, port: int | None = None):
    """Hold `home` for this process (store/owner.py): the claim, or `PathError` naming the owner."""
    from trine.store.owner import DataDirInUse
    from trine.store.owner import claim as claim_data_dir

    try:
        return claim_data_dir(home, command=command, host=host, port=port)
    except DataDirInUse as e:
        raise PathError(
            f"--home {home}: in use by {e.owner.describe()}; one process owns a data dir at a time: "
            "stop that one first, or give this one another --home"
        ) from None


def writer(home: str | Path | None, command: str):
    """A writing `Store` of the data dir, claimed for this command (released by `close()`)."""
    from trine.store import Store

    path = home_dir(home)
    claimed = claim(path, command=command)
    try:
        return Store(path)
    finally:
        claimed.release()  # the store holds its own claim now


def reader(home: str | Path | None):
    """A read-only `Store` of an existing data dir (works beside a live server); None if it has no
    database yet."""
    from trine.store import Store

    path = trine_home(home)
    if path.exists() and not path.is_dir():
        raise PathError(f"--home {path}: is a file, not a directory; give a trine data dir")
    if not (path / "trine.db").is_file():
        return None
    return Store(path, read_only=True)
