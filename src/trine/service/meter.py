"""The `Meter`: what one finished sample or training event cost, built in one place.

A piece of work that finished (or was cancelled after computing something) gets a `Metered`: its
usage row (`UsageEvent`: tokens by phase), its price from the rate card, and its timing row (store
`Timing`: where its wall-clock time went, for session traces). The sampling and training pipelines
store what it builds; neither builds a usage row, a cost or a timing itself.

Invariants
- A sample's usage adds up: prompt tokens = prefill computed + cached (`UsageEvent.from_counts`
  raises otherwise).
- Only forward, forward_backward and optim_step events are metered (`METERED_EVENTS`); every event
  that ran is timed.
- `cost` is the rate card's total for the usage row, 0 for work that is not metered.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from ..engine.api import EventOutcome, SampleUsage
from ..limits import FORWARD, FORWARD_BACKWARD, OPTIMIZE_STEP
from ..metering.events import UsageEvent
from ..metering.rates import RateCard
from ..store import EventRecord, Timing

# an event type -> the operation its usage row names (the other types are not metered)
METERED_EVENTS = {FORWARD: "forward", FORWARD_BACKWARD: "forward_backward", OPTIMIZE_STEP: "optim_step"}


@dataclass(frozen=True)
class Metered:
    """One piece of work's rows: `usage` is None for an event that is not metered (init, save, end)."""

    usage: UsageEvent | None
    cost: float
    timing: Timing


@dataclass(frozen=True)
class SampleWork:
    """Who asked for a sample and where it ran: what its usage and timing rows name."""

    api_key_id: str
    session_id: str
    run_id: str  # the sampling run
    base_model: str
    request_id: str  # the client's request id
    generate: bool  # sample (True) or compute_logprobs (False)
    replica: int
    accepted: float  # unix seconds the service accepted it

    @property
    def operation(self) -> str:
        return "sample" if self.generate else "compute_logprobs"


class Meter:
    """Builds `Metered` rows, priced by `rate_card`."""

    def __init__(self, *, rate_card: RateCard):
        self.rate_card = rate_card

    def sample(self, work: SampleWork, usage: SampleUsage, status: str = "succeeded") -> Metered:
        """A sample's rows from the engine's counters. `status`: succeeded or cancelled. Its timing
        runs from acceptance through the engine's prefill stamps to now."""
        now = time.time()
        event = UsageEvent.from_counts(
            prompt_tokens=usage.prompt_tokens,
            prefill=usage.prefill_tokens,
            prefill_cached=usage.cached_tokens,
            time=now,
            api_key_id=work.api_key_id,
            session_id=work.session_id,
            run_id=work.run_id,
            base_model=work.base_model,
            operation=work.operation,
            request_id=work.request_id,
            sample=usage.sample_tokens,
            prefill_image=usage.image_tokens,
            prefill_image_cached=usage.cached_image_tokens,
        )
        timing = Timing(
            api_key_id=work.api_key_id,
            session_id=work.session_id,
            run_id=work.run_id,
            request_id=work.request_id,
            operation=work.operation,
            base_model=work.base_model,
            replica=work.replica,
            status=status,
            accepted=work.accepted,
            started=usage.started_at,
            prefilled=usage.prefilled_at,
            ended=now,
        )
        return Metered(event, self.rate_card.cost(event)["total"], timing)

    def event(
        self,
        record: EventRecord,
        out: EventOutcome,
        *,
        session_id: str,
        base_model: str,
        replica: int,
        cycle: int | None,
        span: tuple[float, float] = (0.0, 0.0),
        full: bool = False,
    ) -> Metered:
        """A settled training event's rows. `span`: the wall-clock start and end of the clock cycle
        it ran in; `full`: its run fine-tunes every weight (priced from the `:full` rate row); a
        failed event is timed but not metered."""
        usage = None
        if not out.error and record.type in METERED_EVENTS:
            usage = UsageEvent(
                time=time.time(),
                api_key_id=record.api_key_id,
                session_id=session_id,
                run_id=record.run_id,
                base_model=base_model,
                operation=METERED_EVENTS[record.type],
                request_id=record.id,
                train=out.train_tokens,
                train_loss=out.loss_tokens,
                train_sequence=out.train_sequence_tokens,
                full_fine_tuning=full,
            )
        timing = Timing(
            api_key_id=record.api_key_id,
            session_id=session_id,
            run_id=record.run_id,
            request_id=record.id,
            operation=record.type.rsplit(".", 1)[-1],
            base_model=base_model,
            replica=replica,
            status="failed" if out.error else "succeeded",
            accepted=record.created_at,
            started=span[0],
            op_started=out.started_at,
            op_ended=out.ended_at,
            ended=span[1],
            cycle=cycle or 0,
        )
        return Metered(usage, self.rate_card.cost(usage)["total"] if usage else 0.0, timing)
