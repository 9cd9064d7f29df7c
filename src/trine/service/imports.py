"""Adapters imported from elsewhere: a PEFT directory becomes an ordinary sampler checkpoint.

`Imports.adapter(key, base_model=, name=, directory=, origin=)` checks the directory against the
served model (engine/trainer/adapter_import.py: the modules it adapts, their shapes, its rank and
dtype, the base model its config names) before anything is stored, then writes it under the
checkpoint dir and records it as the SAMPLER checkpoint `trio://<run>/weights/<name>` of a training
run made for it: ENDED, named `import <name>`, its metadata and the checkpoint's `source` naming
where it came from, in an ENDED session of its own. So it is listed, sampled, restored (its LoRA
weights, a fresh optimizer), exported and downloaded like any sampler checkpoint, and a run trained
from it records it as its source checkpoint (its lineage).

Invariant: a refused import leaves nothing (no record, no file): the check comes first, the files
are written to a temporary directory moved into place, and the records are written after them.
"""

from __future__ import annotations

import asyncio
import json
import tempfile
import time
from pathlib import Path

from ..engine.trainer.adapter_import import import_adapter
from ..engine.trainer.checkpoint import by_uri, save_dir
from ..limits import check_checkpoint_name
from ..store import ApiKey, Checkpoint, Session, Store, TrainingRun
from ..store.keys import new_id
from .errors import InvalidRequest
from .gate import WorkGate
from .models import ServedModel, resolve_model

IMPORTED_TAG = "imported"


class Imports:
    def __init__(self, *, store: Store, models: dict[str, ServedModel], gate: WorkGate | None = None):
        self.store = store
        self.models = models
        self.gate = gate

    def workdir(self) -> tempfile.TemporaryDirectory:
        """A temporary directory in the data dir (an upload unpacks there; removed on exit)."""
        root = self.store.home / "imports"
        root.mkdir(parents=True, exist_ok=True)
        return tempfile.TemporaryDirectory(prefix=".upload-", dir=root)

    async def adapter(
        self, key: ApiKey, *, base_model: str, name: str, directory: Path, origin: str = ""
    ) -> Checkpoint:
        """Import the PEFT adapter in `directory` onto `base_model` as checkpoint `name`; `origin`
        says where it came from (an upload's file name, a path): kept in its `source`."""
        m = resolve_model(self.models, base_model)
        try:
            check_checkpoint_name(name)
        except ValueError as e:
            raise InvalidRequest(str(e)) from None
        if self.gate is not None:
            self.gate.admit("an adapter import")
        run_id = new_id("tr")
        uri = f"trio://{run_id}/weights/{name}"
        path = self.store.checkpoint_dir / key.id / run_id / "weights" / name
        targets, names = m.info.linear_shapes, (m.name, m.dir.name)

        def write():
            found = {}

            def into(tmp: Path) -> int:
                found["lora"], found["source"], size = import_adapter(
                    directory, tmp, targets, names, m.name, m.dir, origin
                )
                return size

            return found, save_dir(path, into)

        try:
            found, size = await asyncio.get_running_loop().run_in_executor(None, write)
        except ValueError as e:  # the adapter does not fit the model: nothing was stored
            raise InvalidRequest(
                f"adapter import onto {m.name}: {by_uri(str(e), directory, origin or 'the upload')}",
                code="adapter_invalid",
            ) from None
        lora, source, now = found["lora"], found["source"], time.time()
        meta = json.dumps({"source": source})
        session = Session(new_id("ss"), key.id, "ENDED", "", now, now, name=f"import {name}")
        run = TrainingRun(
            run_id,
            key.id,
            session.id,
            1,
            m.name,
            lora.rank,
            lora.train_mlp,
            lora.train_attn,
            lora.train_unembed,
            None,
            "",
            False,
            "ENDED",
            now,
            now,
            name=f"import {name}",
            tags=json.dumps([IMPORTED_TAG]),
            user_metadata=meta,
        )
        ck = Checkpoint(
            new_id("ck"),
            key.id,
            run_id,
            name,
            "SAMPLER",
            uri,
            str(path),
            size,
            "WORKSPACE",
            m.name,
            lora.rank,
            lora.train_mlp,
            lora.train_attn,
            lora.train_unembed,
            None,
            0,
            now,
            source=source,
        )
        self.store.add_session(session)
        self.store.add_training_run(run)
        self.store.add_checkpoint(ck)
        return ck
