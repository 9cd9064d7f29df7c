"""`trine.db`: SQLite in WAL mode, one connection guarded by a lock (called from the event loop).

Each table mirrors a dataclass (records.py, metering.events): its columns are the dataclass's fields,
so rows round-trip without hand-written mappings. Every method is one short transaction; nothing here
holds the lock across I/O other than SQLite's own. A write that fails for a full disk raises
`trine.diskspace.DiskFull` (code `disk_full`, naming the database's path and its free bytes), never
a bare sqlite3 error; the transaction is rolled back and the connection stays usable.
"""

from __future__ import annotations

import contextlib
import dataclasses
import sqlite3
import threading
import time
import weakref
from pathlib import Path
from typing import Any, Callable, TypeVar

from ..diskspace import raise_if_full
from ..metering.events import CacheDiagnostic, UsageEvent
from .keys import generate_key, hash_key, new_id
from .owner import claim as claim_data_dir
from .records import (
    ApiKey,
    Checkpoint,
    EventRecord,
    MetricPoint,
    SamplingRun,
    Session,
    Timing,
    TrainingRun,
)

T = TypeVar("T")

_SQL_TYPES = {"str": "TEXT", "int": "INTEGER", "float": "REAL", "bool": "INTEGER", "bytes": "BLOB"}
# table -> (dataclass, primary key column or None for an autoincrement rowid, extra indexes)
TABLES: dict[str, tuple[type, str | None, tuple[str, ...]]] = {
    "api_keys": (ApiKey, "id", ("key_hash",)),
    "sessions": (Session, "id", ("api_key_id",)),
    "training_runs": (TrainingRun, "id", ("api_key_id", "session_id")),
    "sampling_runs": (SamplingRun, "id", ("api_key_id", "session_id")),
    "events": (EventRecord, "id", ("run_id", "status")),
    "checkpoints": (Checkpoint, "id", ("api_key_id", "training_run_id", "uri")),
    "usage_events": (UsageEvent, None, ("api_key_id", "time")),
    "diagnostics": (CacheDiagnostic, None, ("api_key_id", "time")),
    "run_metrics": (MetricPoint, None, ("run_id",)),
    "timings": (Timing, None, ("session_id",)),
}
UNFINISHED = ("accepted", "running")


def _column_type(f: dataclasses.Field) -> str:
    base = str(f.type).split("|")[0].strip()
    return _SQL_TYPES.get(base, "TEXT")


class Store:
    """The database of one data dir.

    `Store(home)` writes: it claims the data dir for this process first (owner.py; `DataDirInUse`
    if another process owns it), then creates `home/trine.db` and the schema if missing and adds
    the columns a newer trine has (the migration). `close()` releases the claim.

    `Store(home, read_only=True)` only reads, beside a live owner: it claims nothing, never
    migrates, and its connection refuses writes (`query_only`); columns an older schema lacks
    read as None. `home/trine.db` must exist (FileNotFoundError otherwise)."""

    def __init__(self, home: str | Path, *, read_only: bool = False):
        self.home = Path(home)
        self.read_only = read_only
        self.checkpoint_dir = self.home / "checkpoints"
        self.path = self.home / "trine.db"
        self._lock = threading.Lock()
        self._absent: dict[str, tuple[str, ...]] = {}  # table -> columns the file lacks (readers)
        self.claim = None
        self._release: Callable[[], Any] = lambda: None
        if read_only:
            if not self.path.is_file():
                raise FileNotFoundError(f"no trine.db in {self.home}: is it a data dir (--home)?")
            self._db = sqlite3.connect(self.path, check_same_thread=False, isolation_level=None)
            self._db.execute("PRAGMA query_only=ON")
            self._db.execute("PRAGMA busy_timeout=5000")
            for table, (cls, _, _) in TABLES.items():
                have = {row[1] for row in self._db.execute(f"PRAGMA table_info({table})")}
                self._absent[table] = tuple(f.name for f in dataclasses.fields(cls) if f.name not in have)
            return
        self.home.mkdir(parents=True, exist_ok=True)
        self.claim = claim_data_dir(self.home)
        self._release = weakref.finalize(self, self.claim.release)  # by close(), else when collected
        try:
            self.checkpoint_dir.mkdir(exist_ok=True)
            self._db = sqlite3.connect(self.path, check_same_thread=False, isolation_level=None)
            self._db.execute("PRAGMA journal_mode=WAL")
            self._db.execute("PRAGMA synchronous=NORMAL")
            self._db.execute("PRAGMA busy_timeout=5000")
            self._migrate()
        except BaseException:
            self._release()
            raise

    def _migrate(self) -> None:
        """Create what is missing of the schema (only ever under the data dir's claim)."""
        with self._lock:
            for table, (cls, pk, indexes) in TABLES.items():
                cols = []
                if pk is None:
                    cols.append("rowid_ INTEGER PRIMARY KEY AUTOINCREMENT")
                for f in dataclasses.fields(cls):
                    cols.append(f"{f.name} {_column_type(f)}" + (" PRIMARY KEY" if f.name == pk else ""))
                self._db.execute(f"CREATE TABLE IF NOT EXISTS {table} ({', '.join(cols)})")
                self._add_missing_columns(table, [(f.name, _column_type(f)) for f in dataclasses.fields(cls)])
                for col in indexes:
                    self._db.execute(f"CREATE INDEX IF NOT EXISTS ix_{table}_{col} ON {table}({col})")
            self._db.execute(
                "CREATE TABLE IF NOT EXISTS sample_results (sampling_run_id TEXT, "
                "request_id TEXT, response BLOB, created_at REAL, "
                "PRIMARY KEY (sampling_run_id, request_id))"
            )
            self._add_missing_columns("sample_results", [("fingerprint", "TEXT")])

    def _add_missing_columns(self, table: str, columns: list[tuple[str, str]]) -> None:
        """A data dir written by an older trine lacks newer columns: add them (NULL in old rows)."""
        have = {row[1] for row in self._db.execute(f"PRAGMA table_info({table})")}
        for name, sql_type in columns:
            if name not in have:
                self._db.execute(f"ALTER TABLE {table} ADD COLUMN {name} {sql_type}")

    def close(self) -> None:
        with self._lock:
            self._db.close()
        self._release()

    # ------------------------------------------------------------------ generic row mapping
    @contextlib.contextmanager
    def _full_disk_named(self):
        """A full disk's sqlite3 error, as DiskFull naming the database."""
        try:
            yield
        except sqlite3.OperationalError as e:
            raise_if_full(e, self.path, "database write")
            raise

    def _exec(self, sql: str, args: tuple = ()) -> list[sqlite3.Row]:
        with self._lock, self._full_disk_named():
            cur = self._db.execute(sql, args)
            return cur.fetchall()

    def _rollback(self) -> None:
        with contextlib.suppress(sqlite3.OperationalError):  # nothing open: SQLite rolled back itself
            self._db.execute("ROLLBACK")

    def _insert(self, table: str, obj: Any, *, replace: bool = False) -> None:
        d = dataclasses.asdict(obj)
        cols = ", ".join(d)
        marks = ", ".join("?" for _ in d)
        verb = "INSERT OR REPLACE" if replace else "INSERT"
        self._exec(f"{verb} INTO {table} ({cols}) VALUES ({marks})", tuple(d.values()))

    def _update(self, table: str, pk: str, **fields) -> None:
        sets = ", ".join(f"{k} = ?" for k in fields)
        self._exec(f"UPDATE {table} SET {sets} WHERE id = ?", (*fields.values(), pk))

    def _select(
        self,
        table: str,
        where: str = "1",
        args: tuple = (),
        *,
        order: str = "",
        limit: int | None = None,
        offset: int = 0,
        skip: tuple[str, ...] = (),
    ) -> list:
        """Rows as dataclasses; columns named in `skip` are not read (their fields are None)."""
        cls = TABLES[table][0]
        fields = dataclasses.fields(cls)
        skip = (*skip, *self._absent.get(table, ()))
        cols = ", ".join("NULL" if f.name in skip else f.name for f in fields)
        sql = f"SELECT {cols} FROM {table} WHERE {where}"
        if order:
            sql += f" ORDER BY {order}"
        if limit is not None:
            sql += f" LIMIT {int(limit)} OFFSET {int(offset)}"
        rows = self._exec(sql, args)
        out = []
        for row in rows:
            vals = {
                f.name: (
                    bool(v)
                    if v is not None and _column_type(f) == "INTEGER" and str(f.type).startswith("bool")
                    else v
                )
                for f, v in zip(fields, row)
            }
            out.append(cls(**vals))
        return out

    def _one(self, table: str, where: str, args: tuple):
        rows = self._select(table, where, args, limit=1)
        return rows[0] if rows else None

    def _count(self, table: str, where: str, args: tuple) -> int:
        return self._exec(f"SELECT COUNT(*) FROM {table} WHERE {where}", args)[0][0]

    # ------------------------------------------------------------------ API keys
    def create_key(self, name: str) -> tuple[ApiKey, str]:
        """A new key: returns its record and the secret string (shown once, never stored)."""
        if not name or not name.strip():
            raise ValueError("key name: give a non-empty --name")
        secret = generate_key()
        rec = ApiKey(id=new_id("key"), name=name.strip(), key_hash=hash_key(secret), created_at=time.time())
        self._insert("api_keys", rec)
        return rec, secret

    def key_by_secret(self, secret: str) -> ApiKey | None:
        rec = self._one("api_keys", "key_hash = ?", (hash_key(secret),))
        return rec if rec is not None and rec.revoked_at is None else None

    def key(self, key_id: str) -> ApiKey | None:
        return self._one("api_keys", "id = ?", (key_id,))

    def keys(self) -> list[ApiKey]:
        return self._select("api_keys", order="created_at")

    def revoke_key(self, key_id: str) -> bool:
        if self.key(key_id) is None:
            return False
        self._update("api_keys", key_id, revoked_at=time.time())
        return True

    # ------------------------------------------------------------------ sessions and runs
    def add_session(self, s: Session) -> None:
        self._insert("sessions", s)

    def session(self, session_id: str) -> Session | None:
        return self._one("sessions", "id = ?", (session_id,))

    def sessions(self, api_key_id: str, limit: int | None = 20, offset: int = 0) -> tuple[list[Session], int]:
        rows = self._select(
            "sessions", "api_key_id = ?", (api_key_id,), order="created_at", limit=limit, offset=offset
        )
        return rows, self._count("sessions", "api_key_id = ?", (api_key_id,))

    def update_session(self, session_id: str, **fields) -> None:
        self._update("sessions", session_id, updated_at=time.time(), **fields)

    def add_training_run(self, r: TrainingRun) -> None:
        self._insert("training_runs", r)

    def training_run(self, run_id: str) -> TrainingRun | None:
        return self._one("training_runs", "id = ?", (run_id,))

    def training_runs(
        self,
        api_key_id: str | None = None,
        *,
        session_id: str | None = None,
        status: str | None = None,
        limit: int | None = None,
        offset: int = 0,
    ) -> tuple[list[TrainingRun], int]:
        where, args = self._filters(api_key_id=api_key_id, session_id=session_id, status=status)
        rows = self._select("training_runs", where, args, order="created_at", limit=limit, offset=offset)
        return rows, self._count("training_runs", where, args)

    def update_training_run(self, run_id: str, **fields) -> None:
        self._update("training_runs", run_id, updated_at=time.time(), **fields)

    def add_sampling_run(self, r: SamplingRun) -> None:
        self._insert("sampling_runs", r)

    def sampling_run(self, run_id: str) -> SamplingRun | None:
        return self._one("sampling_runs", "id = ?", (run_id,))

    def sampling_runs(
        self,
        api_key_id: str | None = None,
        *,
        session_id: str | None = None,
        status: str | None = None,
        training_run_id: str | None = None,
    ) -> list[SamplingRun]:
        where, args = self._filters(
            api_key_id=api_key_id, session_id=session_id, status=status, training_run_id=training_run_id
        )
        return self._select("sampling_runs", where, args, order="created_at")

    def update_sampling_run(self, run_id: str, **fields) -> None:
        self._update("sampling_runs", run_id, updated_at=time.time(), **fields)

    def count_runs(self, session_id: str) -> int:
        return self._count("training_runs", "session_id = ?", (session_id,)) + self._count(
            "sampling_runs", "session_id = ?", (session_id,)
        )

    @staticmethod
    def _filters(**kw) -> tuple[str, tuple]:
        parts = [(f"{k} = ?", v) for k, v in kw.items() if v is not None]
        return (" AND ".join(p for p, _ in parts) or "1"), tuple(v for _, v in parts)

    # ------------------------------------------------------------------ events
    def add_event(self, e: EventRecord) -> None:
        self._insert("events", e)

    def event(self, event_id: str) -> EventRecord | None:
        return self._one("events", "id = ?", (event_id,))

    def events(self, run_id: str, *, responses: bool = True) -> list[EventRecord]:
        """A run's events in index order; `responses=False` leaves `response` None (a cheap listing)."""
        return self._select(
            "events", "run_id = ?", (run_id,), order="idx", skip=() if responses else ("response",)
        )

    def event_responses(self, event_ids: list[str]) -> dict[str, bytes]:
        """The stored responses of these events (those that have one)."""
        out: dict[str, bytes] = {}
        for i in range(0, len(event_ids), 500):
            part = event_ids[i : i + 500]
            rows = self._exec(
                f"SELECT id, response FROM events WHERE response IS NOT NULL AND id IN "
                f"({', '.join('?' for _ in part)})",
                tuple(part),
            )
            out.update((r[0], r[1]) for r in rows)
        return out

    def count_events(self, run_id: str, type_: str, status: str) -> int:
        """How many of a run's events have this type and status."""
        return self._count("events", "run_id = ? AND type = ? AND status = ?", (run_id, type_, status))

    def delete_event(self, event_id: str) -> None:
        self._exec("DELETE FROM events WHERE id = ?", (event_id,))

    def update_event(self, event_id: str, **fields) -> None:
        self._update("events", event_id, updated_at=time.time(), **fields)

    def max_cycle(self) -> int:
        return self._exec("SELECT COALESCE(MAX(cycle), 0) FROM events")[0][0]

    def unfinished_events(self) -> list[EventRecord]:
        return self._select("events", "status IN (?, ?)", UNFINISHED)

    # ------------------------------------------------------------------ sample results
    def sample_result(self, sampling_run_id: str, request_id: str) -> tuple[bytes, str | None] | None:
        """The stored response of a sample request and the fingerprint of the request it answered
        ("" or None: not recorded), in one read; None when nothing is stored."""
        rows = self._exec(
            "SELECT response, fingerprint FROM sample_results WHERE sampling_run_id = ? AND request_id = ?",
            (sampling_run_id, request_id),
        )
        return (rows[0][0], rows[0][1]) if rows else None

    def add_sample_result(
        self,
        sampling_run_id: str,
        request_id: str,
        response: bytes,
        fingerprint: str = "",
        usage: UsageEvent | None = None,
        timing: Timing | None = None,
    ) -> None:
        """Store a sample request's response, and its usage and timing in the same transaction."""
        with self._lock, self._full_disk_named():
            self._db.execute("BEGIN")
            try:
                self._db.execute(
                    "INSERT OR REPLACE INTO sample_results (sampling_run_id, request_id, response, "
                    "created_at, fingerprint) VALUES (?, ?, ?, ?, ?)",
                    (sampling_run_id, request_id, response, time.time(), fingerprint),
                )
                for table, row in (("usage_events", usage), ("timings", timing)):
                    if row is not None:
                        d = dataclasses.asdict(row)
                        self._db.execute(
                            f"INSERT INTO {table} ({', '.join(d)}) VALUES ({', '.join('?' for _ in d)})",
                            tuple(d.values()),
                        )
                self._db.execute("COMMIT")
            except BaseException:
                self._rollback()
                raise

    # ------------------------------------------------------------------ checkpoints
    def add_checkpoint(self, c: Checkpoint) -> None:
        self._insert("checkpoints", c, replace=True)

    def checkpoint(self, checkpoint_id: str) -> Checkpoint | None:
        return self._one("checkpoints", "id = ?", (checkpoint_id,))

    def checkpoint_by_uri(self, uri: str) -> Checkpoint | None:
        return self._one("checkpoints", "uri = ?", (uri,))

    def checkpoints(
        self,
        api_key_id: str | None = None,
        *,
        training_run_id: str | None = None,
        visibility: str | None = None,
        on_disk: bool = False,
        limit: int | None = None,
        offset: int = 0,
    ) -> tuple[list[Checkpoint], int]:
        """A page of checkpoints, oldest first, and how many match; `on_disk`: only those with a
        directory (not in-memory sampler snapshots), counted and paged alike."""
        where, args = self._filters(
            api_key_id=api_key_id, training_run_id=training_run_id, visibility=visibility
        )
        if on_disk:
            where += " AND path != ''"
        rows = self._select("checkpoints", where, args, order="created_at", limit=limit, offset=offset)
        return rows, self._count("checkpoints", where, args)

    def update_checkpoint(self, checkpoint_id: str, **fields) -> None:
        self._update("checkpoints", checkpoint_id, **fields)

    def delete_checkpoint(self, checkpoint_id: str) -> None:
        self._exec("DELETE FROM checkpoints WHERE id = ?", (checkpoint_id,))

    # ------------------------------------------------------------------ logged metrics
    def add_metrics(self, points: list[MetricPoint]) -> None:
        """Store points, replacing any earlier value of the same (run, step, name), in one transaction."""
        with self._lock, self._full_disk_named():
            self._db.execute("BEGIN")
            try:
                for p in points:
                    self._db.execute(
                        "DELETE FROM run_metrics WHERE run_id = ? AND step = ? AND name = ?",
                        (p.run_id, p.step, p.name),
                    )
                    d = dataclasses.asdict(p)
                    self._db.execute(
                        f"INSERT INTO run_metrics ({', '.join(d)}) VALUES ({', '.join('?' for _ in d)})",
                        tuple(d.values()),
                    )
                self._db.execute("COMMIT")
            except BaseException:
                self._rollback()
                raise

    def count_metrics(self, run_id: str) -> int:
        return self._count("run_metrics", "run_id = ?", (run_id,))

    def metrics(self, run_id: str) -> list[MetricPoint]:
        """A run's logged points by step, then in the order logged."""
        return self._select("run_metrics", "run_id = ?", (run_id,), order="step, rowid_")

    def last_metrics(self, run_id: str) -> dict[str, float]:
        """Each metric's value at the highest step the run logged it at."""
        rows = self._exec(
            "SELECT name, value FROM run_metrics m WHERE run_id = ? AND step = "
            "(SELECT MAX(step) FROM run_metrics WHERE run_id = m.run_id AND name = m.name) "
            "ORDER BY name",
            (run_id,),
        )
        return {r[0]: r[1] for r in rows}

    # ------------------------------------------------------------------ usage and diagnostics
    def add_usage(self, event: UsageEvent) -> None:
        self._insert("usage_events", event)

    def usage_events(
        self,
        api_key_id: str,
        *,
        session_id: str | None = None,
        run_id: str | None = None,
        since: float | None = None,
    ) -> list[UsageEvent]:
        return self._timed("usage_events", api_key_id, session_id, run_id, since)

    def add_timing(self, t: Timing) -> None:
        self._insert("timings", t)

    def timings(self, api_key_id: str, session_id: str, limit: int | None = None) -> tuple[list[Timing], int]:
        """A session's timings (its key's only): the latest `limit` accepted, in the order they were
        accepted, and how many it has in all."""
        where, args = "api_key_id = ? AND session_id = ?", (api_key_id, session_id)
        rows = self._select("timings", where, args, order="accepted DESC, rowid_ DESC", limit=limit)
        return rows[::-1], self._count("timings", where, args)

    def add_diagnostic(self, d: CacheDiagnostic) -> None:
        self._insert("diagnostics", d)

    def diagnostics(
        self,
        api_key_id: str,
        *,
        session_id: str | None = None,
        run_id: str | None = None,
        since: float | None = None,
    ) -> list[CacheDiagnostic]:
        return self._timed("diagnostics", api_key_id, session_id, run_id, since)

    def _timed(self, table, api_key_id, session_id, run_id, since) -> list:
        where, args = self._filters(api_key_id=api_key_id, session_id=session_id, run_id=run_id)
        if since is not None:
            where, args = where + " AND time >= ?", (*args, since)
        return self._select(table, where, args, order="time, rowid_")
