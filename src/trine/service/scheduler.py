"""The clock-cycle scheduler of one base model (docs/concepts.md, "Train, step by
step").

Cycles run one after another. Each takes, for every run with work at the head of its queue, that
run's share (`RunQueue.take_cycle`) and hands the whole plan to `execute` (which batches all runs'
forward_backward into one trainer call, then applies their optim steps). A cycle starts:
- `cycle_seconds == 0`: as soon as work is waiting and no new event arrived for `gather_seconds`
  (bounded by `8 * gather_seconds`), so a client that submits forward_backward and optim_step
  back to back gets both in one cycle;
- `cycle_seconds > 0`: on fixed clock ticks, with whatever is waiting then (a shared-pool setup).
A cycle's forward events hold about `cycle_tokens` tokens at most, shared fairly by the keys with
work ready (ordering.py), so one key's long queue cannot hold back another key's step.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Awaitable, Callable

from .ordering import CyclePlan, RunQueue, plan_cycle

log = logging.getLogger("trine.scheduler")
CYCLE_TOKENS = 65536  # forward tokens per cycle, shared by the keys with work ready


class ClockScheduler:
    def __init__(
        self,
        execute: Callable[[CyclePlan], Awaitable[None]],
        *,
        cycle_seconds: float = 0.0,
        gather_seconds: float = 0.02,
        first_cycle: int = 0,
        cycle_tokens: int | None = CYCLE_TOKENS,
    ):
        if cycle_seconds < 0 or gather_seconds < 0:
            raise ValueError("cycle_seconds and gather_seconds must be >= 0")
        self.execute = execute
        self.cycle_seconds = cycle_seconds
        self.gather_seconds = gather_seconds
        self.cycle_tokens = cycle_tokens
        self.cycle = first_cycle  # number of the last cycle started
        self.queues: dict[str, RunQueue] = {}
        self._wake = asyncio.Event()
        self._last_arrival = 0.0
        self._task: asyncio.Task | None = None
        self._epoch = time.monotonic()

    def queue(self, run_id: str, next_index: int = 1, tenant: str = "") -> RunQueue:
        q = self.queues.get(run_id)
        if q is None:
            q = self.queues[run_id] = RunQueue(run_id, next_index)
        if tenant:
            q.tenant = tenant
        return q

    def drop(self, run_id: str) -> RunQueue | None:
        return self.queues.pop(run_id, None)

    def notify(self) -> None:
        """Call after adding events to a queue."""
        self._last_arrival = time.monotonic()
        self._wake.set()

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._loop())

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            try:
                await self._task
            except asyncio.CancelledError:
                pass

    def _ready(self) -> bool:
        return any(q.ready() for q in self.queues.values())

    async def _gather(self) -> None:
        if self.cycle_seconds > 0:
            elapsed = time.monotonic() - self._epoch
            wait = self.cycle_seconds - (elapsed % self.cycle_seconds)
            await asyncio.sleep(0 if wait >= self.cycle_seconds - 1e-3 else wait)
            return
        deadline = time.monotonic() + 8 * self.gather_seconds
        while True:
            quiet = time.monotonic() - self._last_arrival
            if quiet >= self.gather_seconds or time.monotonic() >= deadline:
                return
            await asyncio.sleep(min(self.gather_seconds - quiet, deadline - time.monotonic()))

    async def _loop(self) -> None:
        while True:
            await self._wake.wait()
            self._wake.clear()
            if not self._ready():
                continue
            await self._gather()
            plan = plan_cycle(self.cycle + 1, list(self.queues.values()), self.cycle_tokens)
            if not plan.runs:
                continue
            self.cycle = plan.number
            try:
                await self.execute(plan)
            except Exception:  # execute settles its own events; this is a bug, keep scheduling
                log.exception("cycle %d failed", plan.number)
            if self._ready():
                self._wake.set()
