"""The read side front ends use: lists and views of a key's sessions, runs, events, checkpoints and
usage; the served models, their limits and tokenizers; engine replica stats.

Single objects by id come from `Ownership` (`svc.ownership.training_run(key, id)`, ...); this module
answers everything else. Front ends read through these two only, never the store or an engine.

Invariant: every answer holds only the asking key's objects; another key's object is a NotFound,
exactly as if it did not exist. Engine counters are server-wide numbers that name nobody; in the
cycle lists of `replica_stats` only the key's own runs are named, the others are counted.
"""

from __future__ import annotations

import asyncio

from ..engine.api import EngineStats
from ..metering.events import CacheDiagnostic, UsageEvent
from ..store import ApiKey, Checkpoint, EventRecord, SamplingRun, Session, Store, TrainingRun
from . import labels
from .commands import SessionSearch
from .errors import InvalidRequest, NotFound
from .models import Replica, ServedModel, resolve_model
from .ownership import Ownership
from .results import EventResult
from .tokenizers import ModelTokenizer
from .views import CycleView, ModelView, ReplicaStats, SessionView

RECENT_CYCLES = 20  # per replica, in replica_stats


class UsageLedger:
    """Usage records as `metering.http`'s routes read them (they filter by the caller's key id):
    usage events and diagnostics, and the run and checkpoint records that name their runs."""

    def __init__(self, store: Store):
        self._store = store

    def usage_events(self, api_key_id: str, **filters) -> list[UsageEvent]:
        return self._store.usage_events(api_key_id, **filters)

    def diagnostics(self, api_key_id: str, **filters) -> list[CacheDiagnostic]:
        return self._store.diagnostics(api_key_id, **filters)

    def training_run(self, run_id: str) -> TrainingRun | None:
        return self._store.training_run(run_id)

    def sampling_run(self, run_id: str) -> SamplingRun | None:
        return self._store.sampling_run(run_id)

    def checkpoint(self, checkpoint_id: str) -> Checkpoint | None:
        return self._store.checkpoint(checkpoint_id)

    def last_metrics(self, run_id: str) -> dict[str, float]:
        return self._store.last_metrics(run_id)


class Queries:
    def __init__(self, *, store: Store, ownership: Ownership, models: dict[str, ServedModel]):
        self._store = store
        self._ownership = ownership
        self._models = models
        self.ledger = UsageLedger(store)

    # ------------------------------------------------------------------ sessions and runs
    def sessions(self, key: ApiKey, limit: int = 20, offset: int = 0) -> tuple[list[Session], int]:
        """A page of the key's sessions, oldest first, and how many there are."""
        return self._store.sessions(key.id, limit, offset)

    def search_sessions(
        self, key: ApiKey, search: SessionSearch, limit: int, after: str | None = None
    ) -> tuple[list[Session], bool]:
        """Up to `limit` of the key's sessions that match `search`, newest first (ties: by id,
        descending), starting after session `after` (the last one of the previous page); and whether
        more may follow."""
        rows, _ = self._store.sessions(key.id, limit=None)
        rows.sort(key=lambda s: (s.created_at, s.id), reverse=True)
        if after is not None:
            last = self._store.session(after)
            if last is None or last.api_key_id != key.id:
                raise InvalidRequest(f"cursor: session {after!r} is not one of this key's sessions")
            rows = [s for s in rows if (s.created_at, s.id) < (last.created_at, last.id)]
        found = []
        for s in rows:
            if _matches(s, search):
                if len(found) == limit:
                    return found, True
                found.append(s)
        return found, False

    def session_checkpoints(self, key: ApiKey, session_id: str) -> tuple[int, int]:
        """How many checkpoints the session's training runs hold on disk, and their bytes."""
        runs, _ = self._store.training_runs(key.id, session_id=session_id)
        count = size = 0
        for r in runs:
            rows, _ = self._store.checkpoints(key.id, training_run_id=r.id)
            stored = [c for c in rows if c.path]
            count, size = count + len(stored), size + sum(c.size_bytes for c in stored)
        return count, size

    def session(self, key: ApiKey, session_id: str) -> SessionView:
        """A session with the ids of its training and sampling runs."""
        s = self._ownership.session(key, session_id)
        trs, _ = self._store.training_runs(key.id, session_id=s.id)
        return SessionView(s, [r.id for r in trs], [r.id for r in self.sampling_runs(key, session_id=s.id)])

    def training_runs(
        self, key: ApiKey, limit: int | None = None, offset: int = 0
    ) -> tuple[list[TrainingRun], int]:
        """A page of the key's training runs, oldest first, and how many there are."""
        return self._store.training_runs(key.id, limit=limit, offset=offset)

    def sampling_runs(
        self, key: ApiKey, session_id: str | None = None, training_run_id: str | None = None
    ) -> list[SamplingRun]:
        """The key's sampling runs (of one session; attributed to one training run), oldest first."""
        return self._store.sampling_runs(key.id, session_id=session_id, training_run_id=training_run_id)

    # ------------------------------------------------------------------ events
    def run_events(self, key: ApiKey, run_id: str) -> list[EventRecord]:
        """A training run's events in index order, without their results (see `event_results`)."""
        return self._store.events(self._ownership.training_run(key, run_id).id, responses=False)

    def event_results(self, key: ApiKey, records: list[EventRecord]) -> dict[str, EventResult]:
        """The results of those of `records` (the key's) that finished, by event id."""
        blobs = self._store.event_responses([e.id for e in records if e.api_key_id == key.id])
        return {event_id: EventResult.unpack(blob) for event_id, blob in blobs.items()}

    def event(self, key: ApiKey, event_id: str) -> EventRecord:
        """One of the key's events by its stored id (any run)."""
        rec = self._store.event(event_id)
        if rec is None or rec.api_key_id != key.id:
            raise NotFound(f"event {event_id} not found", code="event_not_found")
        return rec

    # ------------------------------------------------------------------ checkpoints, usage
    def checkpoints(
        self,
        key: ApiKey,
        *,
        training_run_id: str | None = None,
        on_disk: bool = False,
        limit: int | None = None,
        offset: int = 0,
    ) -> tuple[list[Checkpoint], int]:
        """A page of the key's checkpoints (of one of its training runs; `on_disk`: not in-memory
        snapshots), oldest first, and the count."""
        if training_run_id is not None:
            self._ownership.training_run(key, training_run_id)
        return self._store.checkpoints(
            key.id, training_run_id=training_run_id, on_disk=on_disk, limit=limit, offset=offset
        )

    def usage_events(
        self,
        key: ApiKey,
        *,
        session_id: str | None = None,
        run_id: str | None = None,
        since: float | None = None,
    ) -> list[UsageEvent]:
        return self._store.usage_events(key.id, session_id=session_id, run_id=run_id, since=since)

    # ------------------------------------------------------------------ models
    def models(self) -> list[ModelView]:
        return [_model_view(m) for m in self._models.values()]

    def model(self, name_or_id: str) -> ModelView:
        """A served model by its name, its model_id (directory) or that directory's name."""
        return _model_view(resolve_model(self._models, name_or_id))

    def find_model(self, name: str) -> ModelView | None:
        """The served model of this exact name (a record's base_model), None if it is not served."""
        m = self._models.get(name)
        return _model_view(m) if m is not None else None

    def tokenizer(self, name_or_id: str) -> ModelTokenizer:
        return resolve_model(self._models, name_or_id).tokenizer

    async def replica_stats(self, key: ApiKey | None) -> list[ReplicaStats]:
        """One entry per engine replica of every served model (a lost replica says so). With no
        key (the operator's `/metrics`) no run is named: every run is only counted."""
        own = {r.id for r in self._store.training_runs(key.id)[0]} if key is not None else set()
        out = []
        for m in self._models.values():
            live = m.live_replicas()
            answers = await asyncio.gather(*(rep.engine.stats() for rep in live), return_exceptions=True)
            stats = dict(zip(map(id, live), answers))
            for rep in m.replicas:
                out.append(_replica_view(m, rep, stats.get(id(rep), RuntimeError("replica lost")), own))
        return out


def _matches(s: Session, q: SessionSearch) -> bool:
    """Whether session `s` matches search `q` (see SessionSearch)."""
    lab = labels.of_record(s)
    if q.session_id is not None or q.name is not None:
        by_id = q.session_id is not None and s.id == q.session_id
        name = lab.name.lower()
        by_name = q.name is not None and all(w in name for w in q.name.lower().split())
        if not (by_id or by_name):
            return False
    if not set(q.tags) <= set(lab.tags):
        return False
    meta = labels.as_metadata(s)
    if any(meta.get(k) != v for k, v in q.metadata.items()):
        return False
    if q.statuses is not None:
        return any(
            s.status == status and (reason is None or s.finish_reason == reason)
            for status, reason in q.statuses
        )
    return True


def _model_view(m: ServedModel) -> ModelView:
    info = m.info  # None until the engines started
    return ModelView(
        m.name,
        m.model_id,
        info.architecture if info else None,
        info.vocab_size if info else 0,
        info.max_seq_len if info else 0,
        len(m.replicas),
        info.vision if info else None,
    )


def _replica_view(
    m: ServedModel, rep: Replica, st: EngineStats | BaseException, own: set[str]
) -> ReplicaStats:
    queues = list(rep.scheduler.queues.values()) if rep.scheduler else []
    base = dict(
        model=m.name,
        replica=rep.index,
        alive=rep.alive and not isinstance(st, BaseException),
        cycle=rep.scheduler.cycle if rep.scheduler else 0,
        train_runs_waiting=sum(1 for q in queues if q.waiting),
        train_events_waiting=sum(len(q.waiting) for q in queues),
        inflight_samples=rep.inflight_samples,
        cycle_tally=rep.cycle_tally,
    )
    if isinstance(st, BaseException):
        return ReplicaStats(**base, error=f"{type(st).__name__}: {st}")
    cycles = [
        CycleView(
            c.number, c.seconds, c.events, [r for r in c.runs if r in own], sum(r not in own for r in c.runs)
        )
        for c in reversed(st.recent_cycles[-RECENT_CYCLES:])
    ]
    return ReplicaStats(
        **base,
        where=st.replica,
        sampler=dict(st.sampler),
        engine_jobs=st.queued_jobs,
        training_runs=st.runs,
        sampler_adapters=st.adapters,
        cycles=cycles,
        kernels=dict(st.kernels),
    )
