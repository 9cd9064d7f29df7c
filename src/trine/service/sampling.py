"""Sampling: validate a request, pick a replica, run it, meter it, store the outcome for retries.

Invariants
- A request id is served once per sampling run: a retry joins the request still running or gets
  the stored outcome; nothing is metered twice. The same id with a different request (another
  fingerprint) is a 409.
- Metered tokens add up: prompt = prefill computed + cached, from the engine's usage.
- The stored outcome is protocol-neutral (`SampleOutcome`); each front end shapes it on read.
- A metered request is timed too (store `Timing`, for session traces: accepted here, prefill begun
  and done in the engine, finished), in the same transaction as its usage when it finishes.
- A sampler made from a TEMPORARY snapshot that only one replica holds in memory is served there.
- A stream its consumer closes early (a client that went away) is cancelled in the engine at once
  and metered for what it computed: its client may already hold every token but the last. So is a
  request its client cancels (`cancel`, Tinker's cancel_future).
- An inflight sampling run's requests run on its training run's inflight target, at the run's
  version or newer (inflight.py); their outcomes name each token's weights version. On a pool
  they go to replicas other than the one training the run, so sampling overlaps training there
  (PipelineRL's and AReaL's split of inference and training workers).
- A finished request whose outcome a full disk keeps from the store still answers its caller (and
  a retry, from `_recent`); the outcome and its usage are stored with the next request's.
- New requests pass the `WorkGate` (gate.py). At a shutdown's deadline `cancel_all` cancels the
  requests still running, all at once and without waiting on a busy engine for longer than its
  bound, meters what each computed (once, when its engine answers), and their callers get 503
  `server_shutting_down` (the actor plane breaks off a response whose 200 already began).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import functools
import logging
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import AsyncIterator

from ..diskspace import DiskFull
from ..engine.api import (
    EngineLost,
    SampleCancelled,
    SampleDelta,
    SampleRequest,
    SampleResult,
    SampleUsage,
    WeightsIdentity,
)
from ..metering.diagnostics import PrefixDiagnostics
from ..store import ApiKey, SamplingRun, Store
from .adapters import AdapterCache
from .callbacks import ReplicaLost, Spawn
from .errors import Conflict, InvalidRequest, ServiceError, ShuttingDown
from .gate import RESTART_SECONDS, WorkGate
from .idempotency import SingleFlight
from .inflight import Inflight
from .meter import Meter, SampleWork
from .models import Replica, ServedModel
from .ownership import Ownership
from .results import SampleOutcome
from .routing import Router

log = logging.getLogger("trine.service")
RECENT_OUTCOMES = 1024


@dataclass(kw_only=True)
class Sampling:
    store: Store
    ownership: Ownership
    models: dict[str, ServedModel]
    adapters: AdapterCache
    meter: Meter  # usage, cost and timing of each finished or cancelled request
    spawn: Spawn
    on_lost: ReplicaLost
    router: Router = field(default_factory=Router)
    diagnostics: PrefixDiagnostics = field(default_factory=PrefixDiagnostics)
    _running: SingleFlight = field(
        default_factory=lambda: SingleFlight(what=lambda k: f"request_id {k[1]}", code="request_id_reused")
    )
    # the latest stored outcomes (json, fingerprint): a retry finds them without reading the store
    _recent: OrderedDict = field(default_factory=OrderedDict)
    _serving: dict[tuple[str, str], Replica] = field(default_factory=dict)  # request -> its replica
    inflight: Inflight | None = None  # the inflight targets inflight sampling runs follow
    gate: WorkGate | None = None  # refuses new requests while draining or short of disk space
    # request -> (key, run, request) while it runs, to meter it if shutdown cancels it
    _callers: dict[tuple[str, str], tuple] = field(default_factory=dict)
    _metered: set[str] = field(default_factory=set)  # engine request ids cancel_all metered
    _unanswered: set = field(default_factory=set)  # cancel_all's cancels no engine has answered yet
    _unwritten: list[tuple] = field(default_factory=list)  # outcomes a full disk kept from the store
    _unwritten_lock: threading.Lock = field(default_factory=threading.Lock)

    async def sample(
        self, key: ApiKey, sampling_run_id: str, req: SampleRequest, fingerprint: str = ""
    ) -> SampleOutcome:
        """Run one sampling request (`req` as the front end built it: the client's request id, no
        weights). Retries (same request_id) get the stored outcome, or join the request still
        running; `fingerprint` identifies the body a retry must repeat ("" = unchecked)."""
        r = self.ownership.sampling_run(key, sampling_run_id)
        dedup = (r.id, req.request_id)
        if dedup not in self._running:
            stored = await self._stored(dedup)
            if stored is not None:
                self._running.check(dedup, stored[1], fingerprint)
                return SampleOutcome.from_json(stored[0])
            if r.status != "ACTIVE":
                raise Conflict(
                    f"sampling run {r.id} has ended ({r.status}); create a new sampling client",
                    code="run_ended",
                )
            self._admit(req)
        return await self._running.run(dedup, fingerprint, lambda: self._sample(key, r, req, fingerprint))

    async def _stored(self, dedup: tuple[str, str]) -> tuple[bytes, str | None] | None:
        """The stored outcome of a request and its fingerprint: from memory, else one store read off
        the event loop (and memory again: it may have finished while the store was read)."""
        stored = self._recent.get(dedup) or await asyncio.to_thread(self.store.sample_result, *dedup)
        return stored or self._recent.get(dedup)

    async def _sample(
        self, key: ApiKey, r: SamplingRun, req: SampleRequest, fingerprint: str
    ) -> SampleOutcome:
        accepted = time.time()
        m = self.models[r.base_model]
        engine_req = self._engine_request(key, m, r, req)
        for attempt in range(len(m.replicas)):  # a lost replica: reroute to another one
            rep = self._route(m, r, req)
            try:
                async with self._serving_on(rep, key, r, req, accepted):
                    await self._ensure_weights(rep, r)
                    res: SampleResult = await rep.engine.sample(engine_req)
                break
            except EngineLost as e:
                self.on_lost(m, rep, str(e))
                if attempt == len(m.replicas) - 1:
                    raise Conflict(
                        f"every engine replica of {m.name} was lost; try again later",
                        code="worker_lost",
                        status=503,
                    ) from None
        return await self._record(key, r, m, req, res, rep, accepted, fingerprint)

    async def sample_stream(
        self, key: ApiKey, sampling_run_id: str, req: SampleRequest
    ) -> AsyncIterator[SampleDelta | SampleOutcome]:
        """Token chunks as the engine produces them (one per sequence per engine step), then the
        SampleOutcome (stored and metered like `sample`). Closing the iterator early cancels the
        request, which frees its KV blocks at once; what it computed until then is metered."""
        r = self.ownership.sampling_run(key, sampling_run_id)
        dedup = (r.id, req.request_id)
        stored = await self._stored(dedup)
        if stored is not None or dedup in self._running:
            raise Conflict(
                f"request_id {req.request_id!r} was already used in sampling run {r.id}; send a new id",
                code="request_id_conflict",
            )
        if r.status != "ACTIVE":
            raise Conflict(
                f"sampling run {r.id} has ended ({r.status}); create a new sampling client", code="run_ended"
            )
        self._admit(req)
        accepted = time.time()
        m = self.models[r.base_model]
        engine_req = self._engine_request(key, m, r, req)
        rep = self._route(m, r, req)
        res = None
        try:
            async with self._serving_on(rep, key, r, req, accepted):
                await self._ensure_weights(rep, r)
                async with contextlib.aclosing(rep.engine.sample_stream(engine_req)) as items:
                    async for item in items:  # closing this iterator closes the engine's: it cancels
                        if isinstance(item, SampleResult):
                            res = item
                        else:  # named as the client named the request
                            yield dataclasses.replace(item, request_id=req.request_id)
        except EngineLost as e:
            self.on_lost(m, rep, str(e))
            raise Conflict(
                "the engine replica serving this request was lost; send it again",
                code="worker_lost",
                status=503,
            ) from None
        finally:
            if res is None:  # closed early, or failed: meter what the engine computed (if anything)
                self.spawn(self._record_cancelled(key, r, m, req, rep, engine_req.request_id, accepted))
        yield await self._record(key, r, m, req, res, rep, accepted)

    async def _record_cancelled(
        self,
        key: ApiKey,
        r: SamplingRun,
        m: ServedModel,
        req: SampleRequest,
        rep: Replica,
        engine_request_id: str,
        accepted: float,
    ) -> None:
        """Meter a cancelled request's partial work; engine.cancel() answers it once per request
        (a refused or already-finished request answers None)."""
        try:
            partial = await rep.engine.cancel(engine_request_id)
        except Exception:  # the replica is gone: it has nothing to report
            return
        if engine_request_id in self._metered:  # cancel_all metered it
            self._metered.discard(engine_request_id)
            return
        if partial is not None and partial.usage.prompt_tokens:
            self._store_cancelled(_work(key, r, m, req, rep, accepted), partial.usage)

    @contextlib.asynccontextmanager
    async def _serving_on(
        self, rep: Replica, key: ApiKey, r: SamplingRun, req: SampleRequest, accepted: float
    ):
        """Count the request against `rep`'s load while it runs; engine ValueErrors become 400s,
        a cancellation by shutdown a 503."""
        rep.inflight_samples += 1
        self._serving[(r.id, req.request_id)] = rep
        self._callers[(r.id, req.request_id)] = (key, r, req, accepted)
        try:
            yield
        except ServiceError:
            raise
        except ValueError as e:
            raise InvalidRequest(str(e)) from None
        except SampleCancelled:
            if self.gate is None or not self.gate.draining:
                raise
            raise ShuttingDown(
                f"request_id {req.request_id}: the server is shutting down and stopped this sample "
                "(what it computed is metered); send it again once the server has restarted",
                retry_after=RESTART_SECONDS,
            ) from None
        finally:
            rep.inflight_samples -= 1
            self._serving.pop((r.id, req.request_id), None)
            self._callers.pop((r.id, req.request_id), None)

    def _admit(self, req: SampleRequest) -> None:
        if self.gate is not None:
            self.gate.admit(f"sample request_id {req.request_id}")

    def running(self) -> int:
        return len(self._serving)

    async def cancel_all(self, wait: float = 2.0) -> int:
        """Cancel every running request at once (a shutdown's deadline); how many. What each
        computed is metered (once) as its engine answers: waited for up to `wait` seconds, then
        left to answer later (an engine inside a training step answers when the step ends)."""
        answers = []
        for (run_id, request_id), rep in list(self._serving.items()):
            caller = self._callers.get((run_id, request_id))
            engine_id = f"{run_id}/{request_id}"
            answer = asyncio.ensure_future(rep.engine.cancel(engine_id))
            answer.add_done_callback(functools.partial(self._meter_answer, engine_id, caller, rep))
            answer.add_done_callback(self._unanswered.discard)
            self._unanswered.add(answer)
            answers.append(answer)
        if answers:
            await asyncio.wait(answers, timeout=wait)
        return len(answers)

    async def await_cancels(self, timeout: float) -> int:
        """Wait up to `timeout` seconds for the engines to answer `cancel_all`'s cancels (an engine
        inside a training step answers when the step ends), so what those samples computed is
        metered before the engines stop; how many are still unanswered."""
        if self._unanswered:
            await asyncio.wait(set(self._unanswered), timeout=timeout)
        return len(self._unanswered)

    def _meter_answer(self, engine_id: str, caller: tuple | None, rep: Replica, answer: asyncio.Future):
        if answer.cancelled() or answer.exception() is not None:  # the replica is gone: nothing to report
            return
        try:
            self._meter_partial(engine_id, caller, answer.result(), rep)
        except Exception:  # a full disk, a closed store: the operator's log says so
            log.exception("metering the cancelled sample %s failed", engine_id)

    def _meter_partial(self, engine_id: str, caller: tuple | None, partial, rep: Replica) -> None:
        """Meter what a request cancelled while running computed (its prompt, the tokens sampled
        so far), with its timing. The engine answers a cancel once per request, so whoever got the
        answer meters it; `_metered` tells the request's own stream not to meter it again."""
        if partial is None or caller is None or not partial.usage.prompt_tokens:
            return
        key, r, req, accepted = caller
        m = self.models[r.base_model]
        self._metered.add(engine_id)
        self._store_cancelled(_work(key, r, m, req, rep, accepted), partial.usage)

    async def cancel(self, key: ApiKey, sampling_run_id: str, request_id: str) -> bool:
        """Cancel a running request (its client abandoned it): the engine frees its sequences and KV
        blocks at once, its waiters get SampleCancelled, and what it computed until then (its prompt,
        the tokens sampled so far) is metered, once: the engine answers a cancel once per request.
        False if it is not running."""
        r = self.ownership.sampling_run(key, sampling_run_id)
        rep = self._serving.get((r.id, request_id))
        caller = self._callers.get((r.id, request_id))
        if rep is None:
            return False
        engine_id = f"{r.id}/{request_id}"
        self._meter_partial(engine_id, caller, await rep.engine.cancel(engine_id), rep)
        return True

    async def _ensure_weights(self, rep: Replica, r: SamplingRun) -> None:
        """Make `rep` hold the weights `r` samples from: its inflight target, or its checkpoint."""
        if r.inflight_run_id:
            await self.inflight.ensure(rep, r)
        elif r.checkpoint_id:
            await self.adapters.ensure(rep, r.checkpoint_id)

    def _engine_request(
        self, key: ApiKey, m: ServedModel, r: SamplingRun, req: SampleRequest
    ) -> SampleRequest:
        """`req` as the engine runs it: an engine-wide id, the run's weights (an inflight target's
        version is the engine's to resolve) and the caller as its tenant. The engine checks it."""
        return dataclasses.replace(
            req,
            request_id=f"{r.id}/{req.request_id}",
            weights=WeightsIdentity(m.name, _weights_name(r), 0),
            inflight=bool(r.inflight_run_id),
            tenant=key.id,
        )

    async def _record(
        self,
        key: ApiKey,
        r: SamplingRun,
        m: ServedModel,
        req: SampleRequest,
        res: SampleResult,
        rep: Replica,
        accepted: float,
        fingerprint: str = "",
    ) -> SampleOutcome:
        """Meter a finished request and store its outcome (for retries), in one transaction off the
        event loop; the outcome is in `_recent` before any retry can miss it."""
        u = res.usage
        metered = self.meter.sample(_work(key, r, m, req, rep, accepted), u)
        out = SampleOutcome(
            req.request_id,
            r.id,
            m.name,
            res.sequences,
            res.prompt_logprobs,
            res.topk_prompt_logprobs,
            {
                "prompt_tokens": u.prompt_tokens,
                "prefill_tokens": u.prefill_tokens,
                "cached_tokens": u.cached_tokens,
                "sample_tokens": u.sample_tokens,
            },
            metered.cost,
            rep.index,
            res.prompt_alt_tokens,
            res.prompt_alt_logprobs,
            res.target_prompt_logprobs,
        )
        stored = (out.to_json(), fingerprint)
        self._recent[(r.id, req.request_id)] = stored
        while len(self._recent) > RECENT_OUTCOMES:
            self._recent.popitem(last=False)
        row = (r.id, req.request_id, *stored, metered.usage, metered.timing)
        try:
            await asyncio.to_thread(self._store_results, row)
        except DiskFull as e:  # the caller still gets what was computed; the row is stored later
            log.error("sample %s/%s could not be stored yet (retried on the next one): %s", *row[:2], e)
        if req.generate:
            self.spawn(self._diagnose(key, r, m, req, res))
        return out

    def _store_results(self, row: tuple) -> None:
        """Store `row` (an outcome with its usage) after any kept back by a full disk; a row that
        fails for a full disk stays in `_unwritten` (and in `_recent`, so a retry finds it)."""
        with self._unwritten_lock:  # runs in threads: one row stored once
            self._unwritten.append(row)
            while self._unwritten:
                self.store.add_sample_result(*self._unwritten[0])
                self._unwritten.pop(0)

    def _store_cancelled(self, work: SampleWork, usage: SampleUsage) -> None:
        """Store what a cancelled request computed: its usage and timing rows."""
        metered = self.meter.sample(work, usage, "cancelled")
        self.store.add_usage(metered.usage)
        self.store.add_timing(metered.timing)

    def _route(self, m: ServedModel, r: SamplingRun, req: SampleRequest) -> Replica:
        live = m.live_replicas()
        if not live:
            raise Conflict(
                f"no engine replica of {m.name} is running; try again later", code="worker_lost", status=503
            )
        if r.checkpoint_id and not r.inflight_run_id:
            ck = self.store.checkpoint(r.checkpoint_id)
            if ck is not None and not ck.path:  # held in memory by the replica that trained it
                holders = self.adapters.holders(live, r.checkpoint_id)
                if holders:
                    return holders[0]
        identity = f"{m.name}\0{_weights_name(r) or ''}"
        replicas = m.replicas
        if r.inflight_run_id:  # sample beside the training, not on its replica (when the pool has more)
            trainer = m.placement.get(r.inflight_run_id)
            replicas = [rep for rep in live if rep is not trainer] or live
        return self.router.route(replicas, identity, req.prompt, m.info.block_size)

    async def _diagnose(
        self, key: ApiKey, r: SamplingRun, m: ServedModel, req: SampleRequest, res: SampleResult
    ) -> None:
        try:
            found = await asyncio.get_running_loop().run_in_executor(
                None,
                lambda: self.diagnostics.observe(
                    key.id,
                    r.session_id,
                    r.id,
                    m.name,
                    req.request_id,
                    req.prompt,
                    res.usage.cached_tokens,
                    [s.tokens for s in res.sequences],
                    m.tokenizer.decode,
                ),
            )
            for d in found:
                self.store.add_diagnostic(d)
        except Exception:  # diagnostics are advisory; never fail a request over them
            log.exception("prefix diagnostics failed")


def _work(
    key: ApiKey, r: SamplingRun, m: ServedModel, req: SampleRequest, rep: Replica, accepted: float
) -> SampleWork:
    """What a request's usage and timing rows name: its caller, its run, where it ran, when it came."""
    return SampleWork(key.id, r.session_id, r.id, m.name, req.request_id, req.generate, rep.index, accepted)


def _weights_name(r: SamplingRun) -> str | None:
    """What a sampling run's requests name as their adapter: its inflight target (the training run
    id), its checkpoint id, or None for the base model."""
    return r.inflight_run_id or r.checkpoint_id or None
