"""Checkpoint records: creating one when a save succeeds, deleting (records, weights, files), their
time to live and visibility to other keys (publish), storage totals, tar downloads.

Files are written by the engine (atomically, under the data dir or the cluster's shared checkpoint
dir, so every replica can read them); this module owns their database records and their removal.

Download archives live apart from the checkpoint directories, named by checkpoint id
(`$TRINE_HOME/archives/<id>.tar`): an overwrite creates a new checkpoint id, so a download never
serves the old weights, and no checkpoint name (`w` and `w.tar`) can collide with an archive.
"""

from __future__ import annotations

import asyncio
import shutil
import tarfile
import time
import uuid
from pathlib import Path

from ..engine.api import Save
from ..limits import OPTIMIZE_STEP, TEMPORARY_CHECKPOINT_TTL_SECONDS, check_ttl_seconds
from ..store import ApiKey, Checkpoint, Store, TrainingRun
from . import commands
from .adapters import AdapterCache
from .errors import Conflict, InvalidRequest
from .models import ServedModel
from .ownership import Ownership

# a Save's kind -> its checkpoint's kind
CHECKPOINT_KINDS = {"state": "TRAINING", "weights": "SAMPLER", "external": "EXTERNAL"}


class Checkpoints:
    def __init__(
        self, *, store: Store, ownership: Ownership, models: dict[str, ServedModel], adapters: AdapterCache
    ):
        self.store = store
        self.ownership = ownership
        self.models = models
        self.adapters = adapters

    def record_saved(
        self,
        m: ServedModel,
        run: TrainingRun,
        save: commands.SaveByName,
        op: Save,
        size_bytes: int,
        inflight_version: int = 0,
    ) -> Checkpoint:
        """The record of a save that just succeeded (replacing an overwritten one): `save` as the
        client asked it, `op` where it went; an inflight save's target version."""
        old = self.store.checkpoint_by_uri(op.uri)
        if old is not None:  # overwrite: the new record replaces it (the files already did)
            self.store.delete_checkpoint(old.id)
            self.adapters.forget(m.replicas, old.id)
            self._unlink_archives(old.id)
        now = time.time()
        ttl = save.ttl_seconds or (
            TEMPORARY_CHECKPOINT_TTL_SECONDS if save.visibility == "TEMPORARY" else None
        )
        ck = Checkpoint(
            op.checkpoint_id,
            run.api_key_id,
            run.id,
            save.name,
            CHECKPOINT_KINDS[op.kind],
            op.uri,
            op.path,
            size_bytes,
            save.visibility,
            m.name,
            run.lora_rank,
            run.train_mlp,
            run.train_attn,
            run.train_unembed,
            run.seed,
            self.training_step(run),
            now,
            now + ttl if ttl else None,
            inflight_version=inflight_version,
            trainable_token_indices=run.trainable_token_indices,
        )
        self.store.add_checkpoint(ck)
        return ck

    def training_step(self, run: TrainingRun) -> int:
        """The run's training step: the optim steps it has completed, counted from the step of the
        checkpoint it was restored from (so a resumed run goes on numbering where its source stopped)."""
        source = (
            self.store.checkpoint_by_uri(run.source_checkpoint_uri) if run.source_checkpoint_uri else None
        )
        return (source.step if source is not None else 0) + self.store.count_events(
            run.id, OPTIMIZE_STEP, "succeeded"
        )

    def forget(self, ck: Checkpoint) -> None:
        """Delete the record, the weights held by any replica, and the files."""
        self.store.delete_checkpoint(ck.id)
        m = self.models.get(ck.base_model)
        if m is not None:
            self.adapters.forget(m.replicas, ck.id)
        if ck.path:
            shutil.rmtree(ck.path, ignore_errors=True)
        self._unlink_archives(ck.id)

    def forget_temporary(self, run: TrainingRun) -> None:
        cks, _ = self.store.checkpoints(run.api_key_id, training_run_id=run.id, visibility="TEMPORARY")
        for ck in cks:
            self.forget(ck)

    def delete(self, key: ApiKey, checkpoint_id: str) -> None:
        self.forget(self.ownership.checkpoint(key, checkpoint_id))

    def set_ttl(self, key: ApiKey, checkpoint_id: str, ttl_seconds: int | None) -> Checkpoint:
        """Expire the checkpoint `ttl_seconds` from now (the garbage collector deletes it then), or
        never (None)."""
        ck = self.ownership.checkpoint(key, checkpoint_id)
        try:
            check_ttl_seconds(ttl_seconds)
        except ValueError as e:
            raise InvalidRequest(str(e)) from None
        expires_at = None if ttl_seconds is None else time.time() + ttl_seconds
        self.store.update_checkpoint(ck.id, expires_at=expires_at)
        return self.store.checkpoint(ck.id)

    def set_public(self, key: ApiKey, checkpoint_id: str, public: bool) -> Checkpoint:
        """Publish (every key may sample, restore and download it) or unpublish a checkpoint."""
        ck = self.ownership.checkpoint(key, checkpoint_id)
        if bool(ck.public) == public:
            raise Conflict(
                f"checkpoint {ck.uri} is already {'public' if public else 'private'}",
                code="checkpoint_already_public" if public else "checkpoint_not_public",
            )
        if public and not ck.path:
            raise InvalidRequest(
                f"checkpoint {ck.uri} is a temporary snapshot held in memory; publish a named save",
                code="checkpoint_invalid_type",
            )
        self.store.update_checkpoint(ck.id, public=public)
        return self.store.checkpoint(ck.id)

    def stored(self, key: ApiKey) -> list[Checkpoint]:
        """The key's checkpoints that are on disk (what storage is billed for)."""
        return [c for c in self.store.checkpoints(key.id)[0] if c.path]

    def expired(self, now: float) -> list[Checkpoint]:
        cks, _ = self.store.checkpoints()
        return [c for c in cks if c.expires_at is not None and c.expires_at < now]

    async def archive(self, ck: Checkpoint, flat: bool = False) -> Path:
        """A tar file of the checkpoint directory (built once, atomically), for downloads: its files
        under one directory named after the checkpoint, or (`flat`) at the top of the archive."""
        if not Path(downloadable(ck).path).is_dir():
            raise Conflict(
                f"checkpoint {ck.uri} has no files to download", code="checkpoint_not_downloadable"
            )
        tar = self.archive_path(ck.id, flat)
        if not tar.is_file():
            await asyncio.get_running_loop().run_in_executor(None, _write_tar, Path(ck.path), tar, flat)
        return tar

    def archive_path(self, checkpoint_id: str, flat: bool = False) -> Path:
        return self.store.home / "archives" / f"{checkpoint_id}{'.flat' if flat else ''}.tar"

    def _unlink_archives(self, checkpoint_id: str) -> None:
        for flat in (False, True):
            self.archive_path(checkpoint_id, flat).unlink(missing_ok=True)


def downloadable(ck: Checkpoint) -> Checkpoint:
    """`ck`, refused (400 naming why) if it is a snapshot held in memory, which has no files: what a
    download URL is asked for is checked before the URL is signed."""
    if not ck.path:
        raise InvalidRequest(
            f"checkpoint {ck.uri} is a temporary snapshot held in memory and has no "
            "files; save it with a name to download it",
            code="checkpoint_not_downloadable",
        )
    return ck


def _write_tar(src: Path, dst: Path, flat: bool) -> None:
    dst.parent.mkdir(parents=True, exist_ok=True)
    tmp = dst.with_name(f".{dst.name}.tmp-{uuid.uuid4().hex}")
    with tarfile.open(tmp, "w") as tf:
        if flat:
            for f in sorted(src.iterdir()):
                tf.add(f, arcname=f.name)
        else:
            tf.add(src, arcname=src.name)
    tmp.replace(dst)
