"""Who may touch what: API keys, and the lookups that return an object only to the key that owns it.

Invariant: every session, run, checkpoint and event belongs to one API key; asking for another
key's object is a NotFound, exactly as if it did not exist. The one exception is reading a
checkpoint its owner published (`Checkpoint.public`): any key may sample, restore or download it;
only the owner may change or delete it.
"""

from __future__ import annotations

from ..engine.api import ADAMW
from ..store import ApiKey, Checkpoint, EventRecord, SamplingRun, Session, Store, TrainingRun
from ..uris import as_trio_uri
from .errors import Conflict, InvalidRequest, NotFound, Unauthorized


def owned(record, key: ApiKey, what: str, code: str, hint: str = ""):
    """The record if `key` owns it; otherwise 404, whether it is missing or another key's."""
    if record is None or record.api_key_id != key.id:
        raise NotFound(f"{what} not found{hint}", code=code)
    return record


class Ownership:
    def __init__(self, *, store: Store):
        self.store = store

    def authenticate(self, secret: str | None) -> ApiKey:
        if not secret:
            raise Unauthorized("send the API key as `X-API-Key: <key>` or `Authorization: Bearer <key>`")
        key = self.store.key_by_secret(secret.strip())
        if key is None:
            raise Unauthorized(
                "the API key is not valid (create one with `trine keys create --name NAME`)",
                code="unauthorized",
            )
        return key

    def create_key(self, name: str) -> str:
        """A new API key named `name`; returns its secret (shown once, never stored)."""
        return self.store.create_key(name)[1]

    def key(self, key_id: str) -> ApiKey:
        key = self.store.key(key_id)
        if key is None or key.revoked_at is not None:
            raise Unauthorized("the API key behind this token was revoked")
        return key

    def session(self, key: ApiKey, session_id: str) -> Session:
        return owned(
            self.store.session(session_id), key, f"service session {session_id}", "service_session_not_found"
        )

    def training_run(self, key: ApiKey, run_id: str) -> TrainingRun:
        return owned(self.store.training_run(run_id), key, f"training run {run_id}", "training_run_not_found")

    def sampling_run(self, key: ApiKey, run_id: str) -> SamplingRun:
        return owned(self.store.sampling_run(run_id), key, f"sampling run {run_id}", "sampling_run_not_found")

    def checkpoint(self, key: ApiKey, checkpoint_id: str) -> Checkpoint:
        return owned(
            self.store.checkpoint(checkpoint_id), key, f"checkpoint {checkpoint_id}", "checkpoint_not_found"
        )

    def checkpoint_by_uri(self, key: ApiKey, uri: str) -> Checkpoint:
        """The key's checkpoint at `uri`, in trio:// or Tinker's tinker:// form."""
        return owned(
            self.store.checkpoint_by_uri(_trio(uri)),
            key,
            f"checkpoint {uri!r}",
            "checkpoint_not_found",
            ": use the path a save returned (trio://<run>/state/<name> or trio://<run>/weights/<name>)",
        )

    def readable_by_uri(self, key: ApiKey, uri: str) -> Checkpoint:
        """A checkpoint the key owns or one its owner published (to sample, restore or download)."""
        return self._readable(self.store.checkpoint_by_uri(_trio(uri))) or self.checkpoint_by_uri(key, uri)

    def readable(self, key: ApiKey, checkpoint_id: str) -> Checkpoint:
        return self._readable(self.store.checkpoint(checkpoint_id)) or self.checkpoint(key, checkpoint_id)

    @staticmethod
    def _readable(ck: Checkpoint | None) -> Checkpoint | None:
        return ck if ck is not None and ck.public else None

    def event(self, key: ApiKey, run_id: str | None, rec: EventRecord) -> EventRecord:
        if rec.api_key_id != key.id or (run_id is not None and rec.run_id != run_id):
            raise NotFound(f"event {rec.event_id} not found", code="event_not_found")
        return rec

    # ------------------------------------------------------------------ states
    def active_session(self, key: ApiKey, session_id: str) -> Session:
        s = self.session(key, session_id)
        if s.status != "ACTIVE":
            raise Conflict(
                f"service session {session_id} is {s.status}; create a new ServiceClient",
                code="service_session_closed",
            )
        return s

    def active_run(self, key: ApiKey, run_id: str) -> TrainingRun:
        r = self.training_run(key, run_id)
        if r.status == "INTERRUPTED":
            raise Conflict(
                f"training run {run_id} was interrupted (a server restart or a lost engine "
                "replica) and its weights are gone; restore it from a saved state with "
                "create_training_client_from_state",
                code="run_interrupted",
            )
        if r.status != "ACTIVE":
            raise Conflict(
                f"training run {run_id} has ended ({r.status}); create a new training client",
                code="run_ended",
            )
        return r

    def restorable(self, key: ApiKey, uri: str, restore_optimizer: bool) -> Checkpoint:
        """A checkpoint a training run can start from (the key's own or a published one)."""
        ck = self.readable_by_uri(key, uri)
        if ck.kind == "EXTERNAL":
            raise InvalidRequest(
                f"checkpoint {uri} holds merged weights for download (save_weights_external); "
                "training restores a saved state or sampler weights",
                code="checkpoint_invalid_type",
            )
        if not ck.path:
            raise InvalidRequest(
                f"checkpoint {uri} is a temporary sampler snapshot held in memory; "
                "training can restore saved states (save_state) or named weights",
                code="checkpoint_invalid_type",
            )
        if restore_optimizer and ck.kind != "TRAINING":
            raise InvalidRequest(
                f"checkpoint {uri} holds sampler weights only (save_weights_for_sampler): "
                "it has no optimizer state. Restore its weights with a fresh optimizer "
                "(create_training_client_from_state / load_state), or restore a checkpoint "
                "saved with save_state(name) to keep the optimizer",
                code="checkpoint_has_no_optimizer_state",
            )
        return ck

    def checkpoint_optimizer(self, ck: Checkpoint) -> str:
        """The optimizer family of the run that saved `ck` (its optimizer state is of that family;
        a run's family never changes)."""
        run = self.store.training_run(ck.training_run_id)
        return run.optimizer_family if run is not None else ADAMW


def _trio(uri: str) -> str:
    """A checkpoint URI as the store keys it (trio://), from either form; one that is neither is
    kept as it is, and found nowhere."""
    uri = (uri or "").strip() if isinstance(uri, str) else ""
    try:
        return as_trio_uri(uri)
    except ValueError:
        return uri
