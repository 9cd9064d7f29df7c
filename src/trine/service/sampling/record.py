"""The record stage: what a finished or cancelled sample leaves behind, and what a retry finds.

A finished call is metered (`Meter`: usage, cost and timing rows) and its protocol-neutral
`SampleOutcome` stored with its fingerprint, in one transaction off the event loop; a cancelled
call's partial work is metered (usage and timing rows, status `cancelled`), with no outcome.

Invariants
- The outcome is in memory (`_recent`, the latest `RECENT_OUTCOMES`) before the call returns, so a
  retry never misses it, whether or not the store has it yet.
- A row a full disk keeps from the store stays in `_unwritten` (and in `_recent`); it is stored,
  once and in order, before the next row (`_store_results` runs in threads, under one lock).
- Prefix diagnostics are advisory: they run in the background and never fail a request. Prompts
  with images are not diagnosed (their tokens hold placeholder ids, equal for different images).
"""

from __future__ import annotations

import asyncio
import logging
import threading
from collections import OrderedDict

from ...diskspace import DiskFull
from ...engine.api import SampleResult, SampleUsage
from ...metering.diagnostics import PrefixDiagnostics
from ...store import Store
from ..callbacks import Spawn
from ..meter import Meter
from ..models import Replica
from ..results import SampleOutcome
from .call import SampleCall

log = logging.getLogger("trine.service")
RECENT_OUTCOMES = 1024

StoredOutcome = tuple[bytes, "str | None"]  # an outcome's json and the fingerprint of its body


class Records:
    def __init__(self, *, store: Store, meter: Meter, spawn: Spawn, diagnostics: PrefixDiagnostics):
        self.store = store
        self.meter = meter  # usage, cost and timing of each finished or cancelled request
        self.diagnostics = diagnostics
        self._spawn = spawn
        # the latest stored outcomes: a retry finds them without reading the store
        self._recent: OrderedDict[tuple[str, str], StoredOutcome] = OrderedDict()
        self._unwritten: list[tuple] = []  # outcomes a full disk kept from the store
        self._unwritten_lock = threading.Lock()

    async def stored(self, dedup: tuple[str, str]) -> StoredOutcome | None:
        """The stored outcome of a request and its fingerprint: from memory, else one store read off
        the event loop (and memory again: it may have finished while the store was read)."""
        stored = self._recent.get(dedup) or await asyncio.to_thread(self.store.sample_result, *dedup)
        return stored or self._recent.get(dedup)

    async def finished(self, call: SampleCall, res: SampleResult) -> SampleOutcome:
        """Meter a finished call and store its outcome (for retries), in one transaction off the
        event loop; the outcome is in `_recent` before any retry can miss it."""
        u, r, req = res.usage, call.run, call.req
        metered = self.meter.sample(call.work(), u)
        out = SampleOutcome(
            req.request_id,
            r.id,
            call.model.name,
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
            call.replica.index,
            res.prompt_alt_tokens,
            res.prompt_alt_logprobs,
            res.target_prompt_logprobs,
        )
        stored = (out.to_json(), call.fingerprint)
        self._recent[call.dedup] = stored
        while len(self._recent) > RECENT_OUTCOMES:
            self._recent.popitem(last=False)
        row = (r.id, req.request_id, *stored, metered.usage, metered.timing)
        try:
            await asyncio.to_thread(self._store_results, row)
        except DiskFull as e:  # the caller still gets what was computed; the row is stored later
            log.error("sample %s/%s could not be stored yet (retried on the next one): %s", *row[:2], e)
        if req.generate and not req.images:  # placeholders of two images look alike: no diagnosis
            self._spawn(self._diagnose(call, res))
        return out

    def cancelled(self, call: SampleCall, usage: SampleUsage, replica: Replica | None = None) -> None:
        """Store what a cancelled call computed on `replica` (else its chosen one): its usage and
        timing rows."""
        metered = self.meter.sample(call.work(replica), usage, "cancelled")
        self.store.add_usage(metered.usage)
        self.store.add_timing(metered.timing)

    def _store_results(self, row: tuple) -> None:
        """Store `row` (an outcome with its usage) after any kept back by a full disk; a row that
        fails for a full disk stays in `_unwritten` (and in `_recent`, so a retry finds it)."""
        with self._unwritten_lock:  # runs in threads: one row stored once
            self._unwritten.append(row)
            while self._unwritten:
                self.store.add_sample_result(*self._unwritten[0])
                self._unwritten.pop(0)

    async def _diagnose(self, call: SampleCall, res: SampleResult) -> None:
        key, r, m, req = call.key, call.run, call.model, call.req
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
