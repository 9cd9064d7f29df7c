"""One owner per data dir: an exclusive OS lock on `DATA_DIR/trine.lock`, held for the owner's life.

Two processes writing one data dir corrupt each other's state: a second server's restart recovery
marks the first one's live runs interrupted. So, as PostgreSQL's `postmaster.pid` and etcd's
data-dir lock do, a process that writes a data dir (`trine serve`, an embedded server, `trine keys
create/revoke`, a schema migration: anything that opens a writing `Store`) first claims it.

Invariants
- At most one process holds a data dir's claim: `fcntl.flock(LOCK_EX | LOCK_NB)` on `trine.lock`.
  Another process's `claim` raises `DataDirInUse` at once (never waits), naming the owner's pid,
  host and the address it serves, as the owner wrote them into the lock file.
- The kernel drops the lock when the owner's process ends, however it ends (exit, crash, kill -9):
  a stale `trine.lock` never blocks a restart, and nobody has to delete it. The file itself is
  never deleted (unlinking a flock'd file lets two processes lock two different files).
- Within one process, claims on one data dir share one lock (counted; released with the last), so
  the parts of one server, or a test's store beside its embedded server, do not refuse each other.
- Readers (`Store(home, read_only=True)`: `trine usage`, `trine checkpoints`, `trine keys list`)
  claim nothing and work beside a live owner.
- The descriptor is not inherited by child processes (Python opens it non-inheritable), so a Ray
  worker or a subprocess never keeps a dead owner's lock alive.
"""

from __future__ import annotations

import fcntl
import json
import os
import socket
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path

LOCK_FILE = "trine.lock"


@dataclass(frozen=True)
class Owner:
    """Who holds a data dir, as written into its lock file."""

    pid: int | None
    hostname: str
    command: str
    host: str | None = None  # the address it serves, if it is a server
    port: int | None = None
    since: float | None = None

    def describe(self) -> str:
        pid = f"pid {self.pid}" if self.pid is not None else "a process"
        where = f" serving {self.host}:{self.port}" if self.host is not None and self.port is not None else ""
        return f"{self.command or 'trine'} ({pid} on host {self.hostname or '?'}{where})"

    @classmethod
    def parse(cls, text: str) -> "Owner":
        """The owner a lock file names; fields it lacks (a file being written) are None."""
        try:
            d = json.loads(text)
        except ValueError:
            d = {}
        d = d if isinstance(d, dict) else {}
        pid, port = d.get("pid"), d.get("port")
        return cls(
            pid=pid if isinstance(pid, int) else None,
            hostname=str(d.get("hostname") or ""),
            command=str(d.get("command") or ""),
            host=d.get("host") if isinstance(d.get("host"), str) else None,
            port=port if isinstance(port, int) else None,
            since=d.get("since") if isinstance(d.get("since"), (int, float)) else None,
        )


class DataDirInUse(RuntimeError):
    """Another process owns the data dir. `str()` is one line: the dir, its owner, what to do."""

    def __init__(self, home: Path, owner: Owner):
        self.home = home
        self.owner = owner
        super().__init__(
            f"data dir {home} is in use by {owner.describe()}; one process owns a data dir at a "
            "time: stop that one first, or give this one another --home (or $TRINE_HOME)"
        )


class Claim:
    """This process's hold on one data dir (see the module docstring). `release()` once per claim."""

    def __init__(self, home: Path, fd: int):
        self.home = home
        self._fd = fd
        self._holders = 1

    def announce(
        self, *, command: str | None = None, host: str | None = None, port: int | None = None
    ) -> None:
        """Rewrite the owner the lock file names (a server once it knows its port)."""
        if self._fd < 0:  # released: nothing of this process's to name
            return
        current = Owner.parse(_read(self._fd))
        owner = Owner(
            pid=os.getpid(),
            hostname=socket.gethostname(),
            command=command or current.command or _command(),
            host=host if host is not None else current.host,
            port=port if port is not None else current.port,
            since=current.since or time.time(),
        )
        _write(self._fd, owner)

    def release(self) -> None:
        with _registry_lock:
            self._holders -= 1
            if self._holders > 0 or self._fd < 0:
                return
            _held.pop(_key(self.home), None)
            fd, self._fd = self._fd, -1
            try:
                os.ftruncate(fd, 0)  # a clean exit leaves no owner named
            except OSError:
                pass
            os.close(fd)  # closing the descriptor drops the flock (before another claim here)

    @property
    def released(self) -> bool:
        return self._fd < 0


_held: dict[str, Claim] = {}
_registry_lock = threading.Lock()


def _key(home: Path) -> str:
    return str(Path(home).resolve())


def _command() -> str:
    """What this process is, for the lock file: `trine serve`, `trine keys`, else the program."""
    name = Path(sys.argv[0]).name if sys.argv and sys.argv[0] else "python"
    if name in ("trine", "main.py"):
        return " ".join(["trine", *sys.argv[1:2]])
    return name if name not in ("", "-c", "-m") else "python"


def _read(fd: int) -> str:
    try:
        return os.pread(fd, 4096, 0).decode("utf-8", "replace")
    except OSError:
        return ""


def _write(fd: int, owner: Owner) -> None:
    data = json.dumps(
        {
            "pid": owner.pid,
            "hostname": owner.hostname,
            "command": owner.command,
            "host": owner.host,
            "port": owner.port,
            "since": owner.since,
        }
    ).encode()
    os.ftruncate(fd, 0)
    os.pwrite(fd, data + b"\n", 0)


def claim(
    home: str | Path, *, command: str | None = None, host: str | None = None, port: int | None = None
) -> Claim:
    """Claim the data dir `home` (which must exist) for this process, or raise `DataDirInUse`.

    A second claim in the same process shares the first one's lock (and may name the address)."""
    home = Path(home)
    with _registry_lock:
        held = _held.get(_key(home))
        if held is None:
            fd = os.open(home / LOCK_FILE, os.O_RDWR | os.O_CREAT, 0o644)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                text = _read(fd)
                os.close(fd)
                raise DataDirInUse(home, Owner.parse(text)) from None
            except BaseException:
                os.close(fd)
                raise
            _write(
                fd, Owner(os.getpid(), socket.gethostname(), command or _command(), host, port, time.time())
            )
            _held[_key(home)] = Claim(home, fd)
            return _held[_key(home)]
        held._holders += 1
    if host is not None or port is not None or command is not None:
        held.announce(command=command, host=host, port=port)
    return held
