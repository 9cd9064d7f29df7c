"""Checkpoint records: creating one when a save succeeds, deleting (records, weights, files), tar downloads.

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

from ..engine import ops
from ..limits import TEMPORARY_CHECKPOINT_TTL_SECONDS
from ..store import ApiKey, Checkpoint, Store, TrainingRun
from . import commands
from .adapters import AdapterCache
from .errors import Conflict
from .models import ServedModel
from .ownership import Ownership


class Checkpoints:
    def __init__(self, store: Store, ownership: Ownership, models: dict[str, ServedModel],
                 adapters: AdapterCache):
        self.store = store
        self.ownership = ownership
        self.models = models
        self.adapters = adapters

    def record_saved(self, m: ServedModel, run: TrainingRun, save: commands.Save, op: ops.Save,
                     size_bytes: int, inflight_version: int = 0) -> Checkpoint:
        """The record of a save that just succeeded (replacing an overwritten one): `save` as the
        client asked it, `op` where it went; an inflight save's target version."""
        old = self.store.checkpoint_by_uri(op.uri)
        if old is not None:  # overwrite: the new record replaces it (the files already did)
            self.store.delete_checkpoint(old.id)
            self.adapters.forget(m.replicas, old.id)
            self.archive_path(old.id).unlink(missing_ok=True)
        now = time.time()
        ttl = save.ttl_seconds or (TEMPORARY_CHECKPOINT_TTL_SECONDS if save.visibility == "TEMPORARY" else None)
        ck = Checkpoint(op.checkpoint_id, run.api_key_id, run.id, save.name,
                        "TRAINING" if op.kind == "state" else "SAMPLER", op.uri, op.path,
                        size_bytes, save.visibility, m.name, run.lora_rank, run.train_mlp,
                        run.train_attn, run.train_unembed, run.seed, run.last_cycle, now,
                        now + ttl if ttl else None, inflight_version=inflight_version)
        self.store.add_checkpoint(ck)
        return ck

    def forget(self, ck: Checkpoint) -> None:
        """Delete the record, the weights held by any replica, and the files."""
        self.store.delete_checkpoint(ck.id)
        m = self.models.get(ck.base_model)
        if m is not None:
            self.adapters.forget(m.replicas, ck.id)
        if ck.path:
            shutil.rmtree(ck.path, ignore_errors=True)
        self.archive_path(ck.id).unlink(missing_ok=True)

    def forget_temporary(self, run: TrainingRun) -> None:
        cks, _ = self.store.checkpoints(run.api_key_id, training_run_id=run.id, visibility="TEMPORARY")
        for ck in cks:
            self.forget(ck)

    def delete(self, key: ApiKey, checkpoint_id: str) -> None:
        self.forget(self.ownership.checkpoint(key, checkpoint_id))

    async def archive(self, ck: Checkpoint) -> Path:
        """A tar file of the checkpoint directory (built once, atomically), for downloads."""
        if not ck.path or not Path(ck.path).is_dir():
            raise Conflict(f"checkpoint {ck.uri} has no files to download (a temporary snapshot held in "
                           "memory)", code="checkpoint_not_downloadable")
        tar = self.archive_path(ck.id)
        if not tar.is_file():
            await asyncio.get_running_loop().run_in_executor(None, _write_tar, Path(ck.path), tar)
        return tar

    def archive_path(self, checkpoint_id: str) -> Path:
        return self.store.home / "archives" / f"{checkpoint_id}.tar"


def _write_tar(src: Path, dst: Path) -> None:
    dst.parent.mkdir(parents=True, exist_ok=True)
    tmp = dst.with_name(f".{dst.name}.tmp-{uuid.uuid4().hex}")
    with tarfile.open(tmp, "w") as tf:
        tf.add(src, arcname=src.name)
    tmp.replace(dst)
