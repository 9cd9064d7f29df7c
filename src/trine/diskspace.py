"""Free disk space: how much, whether a write failed for lack of it, and the coded error that says so.

Shared by every layer (the store, the service, the engine's checkpoint writes, the front ends), so
it imports nothing of trine.

Invariants
- A write that fails because the disk is full (OSError ENOSPC / EDQUOT, SQLite's "database or disk
  is full") surfaces as `DiskFull`: code `disk_full`, HTTP 507, a message naming the path and its
  free bytes. It is an OSError, never a ValueError: it is not the caller's input that is wrong.
- `require(path, reserve)` refuses work before it writes when fewer than `reserve` bytes are free.
"""

from __future__ import annotations

import errno
import shutil
import sqlite3
from pathlib import Path

DEFAULT_RESERVE_BYTES = 64 << 20  # work that writes is refused below this much free space
_FULL_ERRNOS = (errno.ENOSPC, errno.EDQUOT)


def free_bytes(path: str | Path) -> int:
    """Bytes free to an unprivileged writer on the file system of `path` (its nearest existing
    ancestor); -1 when that cannot be read."""
    p = Path(path)
    while not p.exists() and p != p.parent:
        p = p.parent
    try:
        return shutil.disk_usage(p).free
    except OSError:
        return -1


def is_disk_full(e: BaseException) -> bool:
    if isinstance(e, DiskFull):
        return True
    if isinstance(e, OSError) and e.errno in _FULL_ERRNOS:
        return True
    return isinstance(e, sqlite3.OperationalError) and "disk is full" in str(e)


class DiskFull(OSError):
    """A write failed, or would fail, for lack of disk space at `path`."""

    code = "disk_full"
    status = 507

    def __init__(self, path: str | Path, what: str, free: int | None = None, reserve: int = 0):
        self.path = str(path)
        self.free = free_bytes(path) if free is None else free
        self.what = what
        fix = "free space there (delete old checkpoints: `trine checkpoints`) and send it again"
        if reserve:
            self.message = (
                f"{what}: fewer than the {reserve} bytes kept in reserve are free at {self.path} "
                f"({self.free} bytes free); {fix}"
            )
        else:
            self.message = f"{what}: the disk is full at {self.path} ({self.free} bytes free); {fix}"
        super().__init__(errno.ENOSPC, self.message)

    def __str__(self) -> str:
        return self.message


def raise_if_full(e: BaseException, path: str | Path, what: str) -> None:
    """Re-raise `e` as DiskFull when it is a full disk (call from an `except` block)."""
    if is_disk_full(e) and not isinstance(e, DiskFull):
        raise DiskFull(path, what) from e


def require(path: str | Path, reserve: int, what: str) -> None:
    """Refuse `what` (DiskFull) when fewer than `reserve` bytes are free at `path`."""
    if reserve <= 0:
        return
    free = free_bytes(path)
    if 0 <= free < reserve:
        raise DiskFull(path, what, free=free, reserve=reserve)


__all__ = ["DiskFull", "DEFAULT_RESERVE_BYTES", "free_bytes", "is_disk_full", "raise_if_full", "require"]
