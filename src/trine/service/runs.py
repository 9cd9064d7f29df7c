"""Sessions, training runs and sampling runs: creating, binding a checkpoint, ending.

Invariants
- A run belongs to its session's API key; a session that ends ends its runs.
- Ending a training run fails its waiting events (`run_ended`), frees its weights on its replica
  and deletes its TEMPORARY checkpoints.
- A run restored from a checkpoint takes the checkpoint's LoRA shape; its base model must match.
- A full fine-tuning run (rank 0) is placed on a replica whose full-tuning budget holds it, or
  refused (409 `insufficient_memory`) before any record is made; it trains with AdamW.
- A run's optimizer family (AdamW or Dimuon) is fixed when it is made: a restored optimizer state
  brings its own, which the spec may not override.
- A sampling run is attributed to at most one of its key's training runs: the one named in its
  spec, else the one that saved its checkpoint; usage reports by run count it there.
- New sessions, training runs and sampling runs pass the `WorkGate` (gate.py) like other writes:
  none while the server drains for shutdown (503 `server_shutting_down`, Retry-After), none with
  less free disk than the reserve (507 `disk_full`); a refused one leaves no row.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import time

from ..engine.api import ADAMW, OPTIMIZERS, LoRAConfig
from ..limits import check_lora_rank, check_token_indices
from ..store import ApiKey, SamplingRun, Session, Store, TrainingRun
from ..store.keys import new_id
from . import labels as run_labels
from .activity import Activity
from .checkpoints import Checkpoints
from .commands import RunLabels, SamplingRunSpec, TrainingRunSpec
from .errors import Conflict, InvalidRequest, NotFound
from .events import Events
from .gate import WorkGate
from .inflight import Inflight
from .models import ServedModel, resolve_model
from .ownership import Ownership
from .quotas import KeyQuotas, adapter_bytes

log = logging.getLogger("trine.service")


class Runs:
    def __init__(
        self,
        *,
        store: Store,
        ownership: Ownership,
        models: dict[str, ServedModel],
        checkpoints: Checkpoints,
        activity: Activity,
        events: Events,
        quotas: KeyQuotas | None = None,
        inflight: Inflight | None = None,
        gate: WorkGate | None = None,
    ):
        self.store = store
        self.ownership = ownership
        self.models = models
        self.checkpoints = checkpoints
        self.activity = activity
        self.events = events
        self.quotas = quotas  # per-key limits on new runs
        self.inflight = inflight  # the runs' inflight targets
        self.gate = gate  # refuses new sessions and runs while draining or short of disk space

    def _admit(self, what: str) -> None:
        if self.gate is not None:
            self.gate.admit(what)

    # ------------------------------------------------------------------ sessions
    def create_session(self, key: ApiKey, sdk_version: str = "", labels: RunLabels = RunLabels()) -> Session:
        """A new session; its labels (name, tags, metadata) pass to the training runs made in it."""
        fields = run_labels.stored(run_labels.checked(labels))
        self._admit("a new session")
        now = time.time()
        s = Session(new_id("ss"), key.id, "ACTIVE", sdk_version or "", now, now, **fields)
        self.store.add_session(s)
        return s

    async def close_session(
        self, key: ApiKey, session_id: str, status: str = "ENDED", reason: str = ""
    ) -> Session:
        """End a session and its runs; `reason` is what its client reported (kept for searches)."""
        s = self.ownership.session(key, session_id)
        if s.status != "ACTIVE":
            return s
        self.store.update_session(s.id, status=status, finish_reason=reason)
        runs, _ = self.store.training_runs(key.id, session_id=s.id)
        for r in runs:
            if r.status == "ACTIVE":
                await self.end_training_run(r, status)
        for sr in self.store.sampling_runs(key.id, session_id=s.id, status="ACTIVE"):
            self.store.update_sampling_run(sr.id, status=status)
        return self.store.session(s.id)

    # ------------------------------------------------------------------ training runs
    def create_training_run(self, key: ApiKey, session_id: str, spec: TrainingRunSpec) -> TrainingRun:
        s = self.ownership.active_session(key, session_id)
        self._admit("a new training run")
        shape, source = spec.lora, None
        if spec.source_checkpoint_uri:
            source = self.ownership.restorable(key, spec.source_checkpoint_uri, spec.restore_optimizer)
            m = resolve_model(self.models, source.base_model)
            if spec.base_model and resolve_model(self.models, spec.base_model) is not m:
                raise InvalidRequest(
                    f"base_model {spec.base_model!r} differs from the checkpoint's base model "
                    f"{source.base_model!r}; leave base_model empty to use it"
                )
            seed = source.seed if shape.seed is None else shape.seed
            shape = dataclasses.replace(LoRAConfig.named_by(source), seed=seed)
        else:
            if not spec.base_model:
                raise InvalidRequest("base_model is empty: name a served model or give source_checkpoint_uri")
            m = resolve_model(self.models, spec.base_model)
        self._check_shape(shape, m)
        family = self._optimizer(spec, source)
        if shape.full and family != ADAMW:
            raise InvalidRequest(
                f"optimizer {family!r}: full fine-tuning (lora_rank 0) trains with {ADAMW}; "
                "Dimuon steps LoRA matrices",
                code="not_supported",
            )
        labels = run_labels.inherit(run_labels.checked(spec.labels), run_labels.of_record(s))
        if self.quotas is not None:
            self.quotas.check_new_run(key, m, shape)
        now = time.time()
        r = TrainingRun(
            new_id("tr"),
            key.id,
            s.id,
            self.store.count_runs(s.id) + 1,
            m.name,
            shape.rank,
            shape.train_mlp,
            shape.train_attn,
            shape.train_unembed,
            shape.seed,
            source.uri if source else "",
            bool(spec.restore_optimizer),
            "ACTIVE",
            now,
            now,
            **run_labels.stored(labels),
            optimizer_family=family,
            trainable_token_indices=_indices_text(shape),
        )
        # by load, now: refuses at once when no replica runs (or none has room for a full run)
        m.place(r.id, adapter_bytes(m, shape) if shape.full else 0)
        self.store.add_training_run(r)
        self.activity.touch(r.id)
        return r

    @staticmethod
    def _check_shape(shape: LoRAConfig, m: ServedModel) -> None:
        """A rank in range (0: full fine-tuning), something to adapt, and token rows only for full
        fine-tuning."""
        try:
            check_lora_rank(shape.rank, full=True)
            if shape.trainable_token_indices:
                check_token_indices(list(shape.trainable_token_indices), m.vocab_size)
        except ValueError as e:
            raise InvalidRequest(str(e)) from None
        if not (shape.full or shape.train_attn or shape.train_mlp or shape.train_unembed):
            raise InvalidRequest(
                "train_attn, train_mlp and train_unembed are all false: a LoRA run adapts at least "
                "one of them (full fine-tuning, lora_rank 0, always trains the norms)"
            )
        if shape.trainable_token_indices and not shape.full:
            raise InvalidRequest(
                "trainable_token_indices: only full fine-tuning trains embedding rows (lora_rank 0; "
                "the SDK's full=True); a LoRA run adapts linear layers only",
                code="not_supported",
            )

    def _optimizer(self, spec: TrainingRunSpec, source) -> str:
        """The new run's optimizer family: the spec's (AdamW when empty), or a restored state's."""
        if spec.optimizer and spec.optimizer not in OPTIMIZERS:
            raise InvalidRequest(
                f"optimizer {spec.optimizer!r} is not supported; use one of {', '.join(OPTIMIZERS)}",
                code="not_supported",
            )
        if source is None or not spec.restore_optimizer:
            return spec.optimizer or ADAMW
        saved = self.ownership.checkpoint_optimizer(source)
        if spec.optimizer and spec.optimizer != saved:
            raise InvalidRequest(
                f"optimizer {spec.optimizer!r} cannot override the {saved} optimizer state restored "
                f"from {source.uri}; restore without the optimizer state to train with {spec.optimizer}"
            )
        return saved

    def update_training_run(
        self,
        key: ApiKey,
        session_id: str,
        run_id: str,
        *,
        source_checkpoint_uri: str,
        restore_optimizer: bool,
    ) -> TrainingRun:
        """Bind a checkpoint to a run before its first event (PyTRIO `load_state`)."""
        self.ownership.session(key, session_id)
        r = self.ownership.active_run(key, run_id)
        if r.session_id != session_id:
            raise NotFound(
                f"training run {run_id} is not in session {session_id}", code="training_run_not_found"
            )
        if r.started:
            raise Conflict(
                f"training run {run_id} has already started; load a checkpoint into a new "
                "training client instead",
                code="training_run_started",
            )
        ck = self.ownership.restorable(key, source_checkpoint_uri, restore_optimizer)
        if resolve_model(self.models, ck.base_model).name != r.base_model:
            raise InvalidRequest(
                f"checkpoint {ck.uri} was trained on {ck.base_model}, this run uses {r.base_model}"
            )
        if (ck.lora_rank == 0) != (r.lora_rank == 0):
            raise InvalidRequest(
                f"checkpoint {ck.uri} holds {'full' if ck.lora_rank == 0 else 'LoRA'} weights and this "
                "run was made for the other kind: create a new training client from the checkpoint"
            )
        self.store.update_training_run(
            r.id,
            source_checkpoint_uri=ck.uri,
            restore_optimizer=bool(restore_optimizer),
            optimizer_family=self.ownership.checkpoint_optimizer(ck)
            if restore_optimizer
            else r.optimizer_family,
            lora_rank=ck.lora_rank,
            train_mlp=ck.train_mlp,
            train_attn=ck.train_attn,
            train_unembed=ck.train_unembed,
            trainable_token_indices=ck.trainable_token_indices,
        )
        return self.store.training_run(r.id)

    def heartbeat(self, key: ApiKey, run_id: str) -> None:
        self.ownership.training_run(key, run_id)
        self.activity.touch(run_id)

    async def end_training_run(self, r: TrainingRun, status: str) -> None:
        self.store.update_training_run(r.id, status=status)
        self.activity.forget(r.id)
        m = self.models.get(r.base_model)
        if m is None:
            return
        rep = m.unplace(r.id)
        if rep is not None:
            self.events.fail_waiting(
                rep, r.id, "run_ended", f"training run {r.id} ended ({status}) before this event ran"
            )
            if rep.alive:
                try:
                    await rep.engine.drop_run(r.id)
                except Exception:  # the worker is stopping or lost
                    log.debug("could not free run %s", r.id)
        if self.inflight is not None:
            await self.inflight.forget(m, r.id)
        self.checkpoints.forget_temporary(r)

    # ------------------------------------------------------------------ sampling runs
    def create_sampling_run(self, key: ApiKey, session_id: str, spec: SamplingRunSpec) -> SamplingRun:
        """A sampler of the base model or of a checkpoint; made from an inflight save's checkpoint,
        it follows the run's later inflight saves (service/inflight.py)."""
        s = self.ownership.active_session(key, session_id)
        self._admit("a new sampling run")
        ck = None
        if spec.source_checkpoint_uri:
            ck = self.ownership.readable_by_uri(key, spec.source_checkpoint_uri)
            if ck.kind == "EXTERNAL":
                raise InvalidRequest(
                    f"checkpoint {ck.uri} holds merged weights for download; sample from a "
                    "sampler checkpoint (save_weights_for_sampler)",
                    code="checkpoint_invalid_type",
                )
            m = resolve_model(self.models, ck.base_model)
            if spec.base_model and resolve_model(self.models, spec.base_model) is not m:
                raise InvalidRequest(
                    f"base_model {spec.base_model!r} differs from the checkpoint's base "
                    f"model {ck.base_model!r}"
                )
        elif not spec.base_model:
            raise InvalidRequest("base_model: required (or source_checkpoint_uri, to sample a checkpoint)")
        else:
            m = resolve_model(self.models, spec.base_model)
        owner = ck.training_run_id if ck else ""
        if spec.training_run_id:
            owner = self.ownership.training_run(key, spec.training_run_id).id
        now = time.time()
        inflight = ck is not None and ck.inflight_version > 0
        r = SamplingRun(
            new_id("sr"),
            key.id,
            s.id,
            self.store.count_runs(s.id) + 1,
            m.name,
            ck.uri if ck else "",
            ck.id if ck else "",
            "ACTIVE",
            now,
            now,
            owner,
            ck.training_run_id if inflight else "",
            ck.inflight_version if inflight else 0,
        )
        self.store.add_sampling_run(r)
        return r


def _indices_text(shape: LoRAConfig) -> str:
    """`trainable_token_indices` as a record keeps them: a JSON list, "" for none."""
    return json.dumps(list(shape.trainable_token_indices)) if shape.trainable_token_indices else ""
