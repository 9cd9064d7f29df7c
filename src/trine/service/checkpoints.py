"""Checkpoint records: creating one when a save succeeds, listing, deleting, tar downloads.

Files are written by the engine (atomically, under the data dir or the cluster's shared checkpoint
dir, so every replica can read them); this module owns their database records and their removal.
"""
from __future__ import annotations

import asyncio
import shutil
import tarfile
import time
import uuid
from pathlib import Path

from ..engine.ops import Save
from ..limits import TEMPORARY_CHECKPOINT_TTL_SECONDS
from ..store import ApiKey, Checkpoint, Store, TrainingRun
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

    def record_saved(self, m: ServedModel, run: TrainingRun, op: Save, size_bytes: int) -> Checkpoint:
        """The record of a save that just succeeded (replacing an overwritten one)."""
        old = self.store.checkpoint_by_uri(op.uri)
        if old is not None:  # overwrite: the new record replaces it (the files already did)
            self.store.delete_checkpoint(old.id)
            self.adapters.forget(m.replicas, old.id)
        now = time.time()
        ttl = op.ttl_seconds or (TEMPORARY_CHECKPOINT_TTL_SECONDS if op.visibility == "TEMPORARY" else None)
        ck = Checkpoint(op.checkpoint_id, run.api_key_id, run.id, op.name,
                        "TRAINING" if op.kind == "state" else "SAMPLER", op.uri, op.path,
                        size_bytes, op.visibility, m.name, run.lora_rank, run.train_mlp,
                        run.train_attn, run.train_unembed, run.seed, run.last_cycle, now,
                        now + ttl if ttl else None)
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
            Path(ck.path + ".tar").unlink(missing_ok=True)

    def forget_temporary(self, run: TrainingRun) -> None:
        cks, _ = self.store.checkpoints(run.api_key_id, training_run_id=run.id, visibility="TEMPORARY")
        for ck in cks:
            self.forget(ck)

    def list(self, key: ApiKey, *, training_run_id: str | None = None, limit: int | None = None,
             offset: int = 0):
        if training_run_id is not None:
            self.ownership.training_run(key, training_run_id)
        return self.store.checkpoints(key.id, training_run_id=training_run_id, limit=limit,
                                      offset=offset)

    def delete(self, key: ApiKey, checkpoint_id: str) -> None:
        self.forget(self.ownership.checkpoint(key, checkpoint_id))

    async def archive(self, ck: Checkpoint) -> Path:
        """A tar file of the checkpoint directory (built once, atomically), for downloads."""
        if not ck.path or not Path(ck.path).is_dir():
            raise Conflict(f"checkpoint {ck.uri} has no files to download (a temporary snapshot held in "
                           "memory)", code="checkpoint_not_downloadable")
        tar = Path(ck.path + ".tar")
        if not tar.is_file():
            await asyncio.get_running_loop().run_in_executor(None, _write_tar, Path(ck.path), tar)
        return tar


def _write_tar(src: Path, dst: Path) -> None:
    tmp = dst.with_name(f".{dst.name}.tmp-{uuid.uuid4().hex}")
    with tarfile.open(tmp, "w") as tf:
        tf.add(src, arcname=src.name)
    tmp.replace(dst)
