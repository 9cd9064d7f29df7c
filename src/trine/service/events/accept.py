"""Accepting a training event: idempotent on its event id, checked against the run and the model,
its command turned into its prepared engine op (a checkpoint's directory, a save's target), then
stored, queued in index order and registered live (see __init__.py for the invariants)."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import time

from ...engine import api
from ...engine.api import Forward, Op, Save
from ...engine.prepare import prepare_forward
from ...limits import (
    CHECKPOINT_VISIBILITIES,
    check_checkpoint_name,
    check_lora_rank,
    check_ttl_seconds,
)
from ...store import ApiKey, EventRecord, TrainingRun
from ...store.keys import new_id
from .. import commands
from ..errors import REUSED_CODES, Conflict, InvalidRequest, ServiceError, TooManyRequests
from ..models import Replica, ServedModel, resolve_model
from .event import Event
from .state import EventsState


class Accepting(EventsState):
    """submit: accept a command as the next event of a run, once per event id."""

    async def submit(
        self,
        key: ApiKey,
        run_id: str,
        *,
        event_id: str,
        index: int,
        step: int,
        command: commands.TrainingCommand,
        fingerprint: str = "",
        notes: dict | None = None,
    ) -> EventRecord:
        """Accept `command` as event `index` of the run (or return the state of the event already
        accepted under `event_id`).

        Checking a large batch runs in a thread; a retry that arrives meanwhile joins this call.
        `fingerprint` identifies the request body ("" = not checked). `notes` is kept with the
        result for the front end that shapes it (the service never reads it)."""
        stored_id = self._stored_id(run_id, event_id)
        known = None if stored_id in self._accepting else self.record(stored_id)
        if known is not None:
            self.ownership.event(key, run_id, known)
            self._accepting.check(stored_id, known.fingerprint, fingerprint)
            return known
        return await self._accepting.run(
            stored_id,
            fingerprint,
            lambda: self._accept(key, run_id, stored_id, index, step, command, fingerprint, notes or {}),
        )

    async def submit_or_refuse(
        self,
        key: ApiKey,
        run_id: str,
        *,
        event_id: str,
        index: int,
        step: int,
        command: commands.TrainingCommand | ServiceError,
        fingerprint: str = "",
        notes: dict | None = None,
        shown_as: str = api.REFUSED,
    ) -> EventRecord:
        """`submit`, except that a command refused here or by its front end (`command` a
        ServiceError) still takes its index: as a `Refused` event (stored and answered as type
        `shown_as`, the type the request came as) that fails with the refusal. A
        client that numbers its calls (Tinker's seq_id, PyTRIO's index) then sees only that call
        fail, not every later call wait for the index. A refusal that took no index (a reused event
        id, a key over its limits) is raised: a retry may still take it."""
        args = dict(event_id=event_id, index=index, step=step, fingerprint=fingerprint, notes=notes)
        try:
            if isinstance(command, ServiceError):
                raise command
            return await self.submit(key, run_id, command=command, **args)
        except ServiceError as e:
            if e.code in REUSED_CODES or isinstance(e, TooManyRequests):  # the index is still free
                raise
            refused = api.Refused(code=e.code, message=e.message, shown_as=shown_as)
            return await self.submit(key, run_id, command=refused, **args)

    async def _accept(
        self,
        key: ApiKey,
        run_id: str,
        event_id: str,
        index: int,
        step: int,
        command: commands.TrainingCommand,
        fingerprint: str,
        notes: dict,
    ) -> EventRecord:
        r = self.ownership.active_run(key, run_id)
        m = self.models[r.base_model]
        if self.gate is not None:
            saves = isinstance(command, (commands.SaveByName, Save))
            self.gate.admit(f"event {event_id.split('~', 1)[0]} (index {index})", checkpoint=saves)
        if isinstance(command, Forward):
            op = await asyncio.get_running_loop().run_in_executor(None, _prepared, command, m)
            r = self.ownership.active_run(key, run_id)  # it may have ended meanwhile
        else:
            op = self._op(key, r, m, command)
        if self.quotas is not None:
            self.quotas.check_queue(key, op, self.queued_tokens(key.id))
        rep = m.place(run_id)
        type_ = api.event_type(command)
        now = time.time()
        rec = EventRecord(
            event_id, run_id, key.id, index, type_, step, "accepted", now, now, fingerprint=fingerprint
        )
        ev = Event(rec, command, op, rep, notes)
        self.store.add_event(rec)  # stored first: a failed write leaves nothing queued
        q = rep.scheduler.queue(run_id, tenant=key.id)
        try:
            q.add(ev)
        except BaseException:
            self.store.delete_event(rec.id)
            raise
        if index > q.next_index:  # a lower index has not arrived yet: wait for it, boundedly
            asyncio.get_running_loop().call_later(
                self.missing_index_seconds, self._missing_index, rep, run_id, event_id
            )
        if not r.started:
            self.store.update_training_run(r.id, started=True)
        if isinstance(command, api.OptimStep):  # the settings a run listing shows as last used
            settings = {"type": api.optimizer_of(command.params), **dataclasses.asdict(command.params)}
            self.store.update_training_run(r.id, optimizer=json.dumps(settings))
        self.live[event_id] = ev
        self.activity.touch(run_id)
        rep.scheduler.notify()
        return rec

    def _op(self, key: ApiKey, r: TrainingRun, m: ServedModel, command: commands.TrainingCommand) -> Op:
        """Check a (non-forward) command against the run and the model; its engine op."""
        if isinstance(command, commands.InitByUri):
            return api.InitRun(
                lora=self._init_shape(r, command.lora),
                checkpoint_path=self._init_checkpoint(key, r, m, command),
                load_optimizer=command.load_optimizer,
                checkpoint_uri=command.checkpoint_uri,
                optimizer=r.optimizer_family,
            )
        if isinstance(command, api.OptimStep) and api.optimizer_of(command.params) != r.optimizer_family:
            sent = "DimuonParams" if api.optimizer_of(command.params) == api.DIMUON else "AdamParams"
            wanted = "DimuonParams" if r.optimizer_family == api.DIMUON else "AdamParams"
            raise InvalidRequest(
                f"optim_step sent {sent}, but this model was made with the {r.optimizer_family} "
                f"optimizer: send {wanted} (the optimizer is chosen when the training client is created)"
            )
        if isinstance(command, commands.SaveByName):
            return self._save_target(key, r, command)
        return command

    @staticmethod
    def _init_shape(r: TrainingRun, lora: api.LoRAConfig) -> api.LoRAConfig:
        """What an init makes: the init's LoRA shape, or for a full fine-tuning run (chosen when the
        run was made, never by an init) the run's own."""
        if r.lora_rank == api.FULL_RANK:
            return api.LoRAConfig.named_by(r)
        if lora.full:
            raise InvalidRequest(
                "init_run lora_config.rank 0 (full fine-tuning) is chosen when the training run is "
                "created, not by its init: create a full fine-tuning run"
            )
        return lora

    def _init_checkpoint(self, key: ApiKey, r: TrainingRun, m: ServedModel, c: commands.InitByUri) -> str:
        """The directory of the checkpoint an init loads ("" for a fresh adapter)."""
        if c.base_model and resolve_model(self.models, c.base_model) is not m:
            raise InvalidRequest(f"init_run base_model differs from the run's model {m.name}")
        if not c.checkpoint_uri:
            _invalid_unless(check_lora_rank, self._init_shape(r, c.lora).rank, full=True)
            return ""
        ck = self.ownership.restorable(key, c.checkpoint_uri, c.load_optimizer)
        if resolve_model(self.models, ck.base_model) is not m:
            raise InvalidRequest(
                f"checkpoint {c.checkpoint_uri} was trained on {ck.base_model}, the run uses {m.name}"
            )
        if (ck.lora_rank == api.FULL_RANK) != (r.lora_rank == api.FULL_RANK):
            raise InvalidRequest(
                f"checkpoint {c.checkpoint_uri} holds {'full' if ck.lora_rank == api.FULL_RANK else 'LoRA'} "
                "weights and this run trains the other kind: create a new training client from it"
            )
        if r.lora_rank != api.FULL_RANK:
            _same_lora_shape(c.checkpoint_uri, ck, r)
        saved = self.ownership.checkpoint_optimizer(ck)
        if c.load_optimizer and saved != r.optimizer_family:
            raise InvalidRequest(
                f"checkpoint {c.checkpoint_uri} holds {saved} optimizer state and this model trains with "
                f"{r.optimizer_family}: load it without the optimizer, or make a new training client "
                "from it (create_training_client_from_state_with_optimizer), which takes its optimizer"
            )
        return ck.path

    def _save_target(self, key: ApiKey, r: TrainingRun, c: commands.SaveByName) -> Save:
        """The engine save of a save by name: its URI, a new checkpoint id and its directory ("" for
        weights kept in memory only)."""
        _invalid_unless(check_checkpoint_name, c.name)
        if c.visibility not in CHECKPOINT_VISIBILITIES:
            raise InvalidRequest(f"visibility {c.visibility!r}: use {' or '.join(CHECKPOINT_VISIBILITIES)}")
        _invalid_unless(check_ttl_seconds, c.ttl_seconds)
        if c.inflight and r.lora_rank == api.FULL_RANK:
            raise InvalidRequest(
                "inflight samplers follow LoRA runs; sample a full fine-tuning run from a weights "
                "save (save_weights_for_sampler), which is a snapshot",
                code="not_supported",
            )
        part = c.kind  # state, weights or external: the URI's kind, and the folder it is written to
        uri = f"trio://{r.id}/{part}/{c.name}"
        existing = self.store.checkpoint_by_uri(uri)
        if (existing is not None or uri in self._reserved_uris()) and not c.overwrite:
            # a merged export takes no overwrite flag (Tinker's save_weights_external has none)
            fix = "pick another name"
            if c.kind != "external":
                fix += " or save with overwrite=True"
            raise Conflict(f"checkpoint {uri} already exists; {fix}", code="checkpoint_exists")
        path = ""
        if c.kind != "weights" or c.visibility == "WORKSPACE":
            path = str(self.store.checkpoint_dir / key.id / r.id / part / c.name)
        return Save(kind=c.kind, checkpoint_id=new_id("ck"), path=path, uri=uri, inflight=c.inflight)

    def _reserved_uris(self) -> set[str]:
        return {ev.op.uri for ev in self.live.values() if isinstance(ev.op, Save) and not ev.done.is_set()}

    def _missing_index(self, rep: Replica, run_id: str, event_id: str) -> None:
        """Fail `event_id` if it still waits for a lower index (its queue's next) that never came."""
        ev = self.live.get(event_id)
        q = rep.scheduler.queues.get(run_id) if rep.scheduler else None
        if ev is None or q is None or ev.record.status != "accepted":
            return
        index = ev.index
        if q.waiting.get(index) is not ev or q.next_index >= index:
            return
        missing = q.next_index
        q.waiting.pop(index)
        self.fail(
            ev,
            "event_index_missing",
            f"metadata.index: event index {missing} of run {run_id} never arrived (waited "
            f"{self.missing_index_seconds:g} s), and events run in index order; send index {missing} "
            f"(an event the server refused took no index), then send this event ({index}) again "
            "under a new event id",
        )


def _prepared(op: Forward, m: ServedModel) -> Forward:
    """`op` prepared for `m` (engine/prepare.py): every datum checked and counted once."""
    try:
        return prepare_forward(op, m.vocab_size, m.max_seq_len, m.name)
    except ValueError as e:
        raise InvalidRequest(str(e)) from None


def _invalid_unless(check, value, **options) -> None:
    try:
        check(value, **options)
    except ValueError as e:
        raise InvalidRequest(str(e)) from None


LORA_SHAPE = ("lora_rank", "train_attn", "train_mlp", "train_unembed")


def _same_lora_shape(uri: str, ck, r: TrainingRun) -> None:
    """A LoRA checkpoint loads into a run of its own shape only: another rank or other targets
    would leave the run's recorded shape (get_info, listings, later saves' metadata) untrue."""
    differ = [f for f in LORA_SHAPE if getattr(ck, f) != getattr(r, f)]
    if differ:
        theirs = ", ".join(f"{f} {getattr(ck, f)}" for f in differ)
        ours = ", ".join(f"{f} {getattr(r, f)}" for f in differ)
        raise InvalidRequest(
            f"{differ[0]}: checkpoint {uri} has {theirs}; this training run has {ours}. Load it into a "
            "run of its shape: create a new training client from it (create_training_client_from_state)",
            code="checkpoint_shape_mismatch",
        )
