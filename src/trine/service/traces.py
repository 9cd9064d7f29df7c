"""Session traces: where a session's time went, beside what it cost, per engine replica.

From the timings stored when each request or event settled (store `Timing`) and the usage rows
stored with them, a session's timeline is a list of spans in lanes per replica:
- `queue`: a sample request from its acceptance to the engine's first prefill of it; a training
  event from its acceptance to the start of the clock cycle it ran in;
- `prefill`: a sample request's prompt (computed and cached tokens, their cost);
- `decode`: its generated tokens (their cost);
- `cycle`: each clock cycle the session's events ran in (its events, their tokens and cost);
- `train`: each event's own step of its cycle (forward, forward_backward, optim step, save, ...;
  a batched forward is one step for all its events), with its training tokens and cost.

`chrome_trace` writes the timeline in the Chrome trace-event JSON format, which Perfetto
(ui.perfetto.dev) and chrome://tracing load: a process per replica, a thread per lane row.

Invariants
- Only the asking key's session is read (another key's is a NotFound); a trace names only its
  own runs and requests. Cycles are shared with other keys' runs: they are shown with this
  session's events only.
- Spans of one lane row never overlap (rows are packed greedily), so every viewer draws them
  without nesting rules; every span has `tokens` (by metering phase) and `cost`.
- A point that was never reached (0) draws no span: a request cancelled while queued has its
  queue span only, an event failed before running has none.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field

from ..metering.events import UsageEvent
from ..metering.rates import RateCard
from ..store import ApiKey, Store, Timing
from .ownership import Ownership

LANES = ("queue", "prefill", "decode", "cycle", "train")
SAMPLING = ("sample", "compute_logprobs")
MAX_REQUESTS = 50_000  # the latest requests and events a trace holds (bounds its JSON and build time)


@dataclass
class TraceSpan:
    lane: str  # one of LANES
    model: str
    replica: int
    name: str
    start: float  # unix seconds
    end: float
    run_id: str = ""
    request_id: str = ""  # a sample's request id or an event's id; "" for a cycle
    tokens: dict[str, int] = field(default_factory=dict)  # by metering phase
    cost: float = 0.0
    args: dict = field(default_factory=dict)
    row: int = 0  # within its lane on its replica: spans of one row never overlap


@dataclass
class Timeline:
    session_id: str
    currency: str
    spans: list[TraceSpan]
    requests: int = 0  # requests and events drawn
    left_out: int = 0  # earlier ones beyond the limit, not drawn

    @property
    def start(self) -> float:
        return min((s.start for s in self.spans), default=0.0)

    @property
    def end(self) -> float:
        return max((s.end for s in self.spans), default=0.0)


class Traces:
    def __init__(self, *, store: Store, ownership: Ownership, rate_card: RateCard):
        self._store = store
        self._ownership = ownership
        self._rates = rate_card

    def timeline(self, key: ApiKey, session_id: str, limit: int = MAX_REQUESTS) -> Timeline:
        """The key's session as spans in lanes per replica (module docstring): its latest `limit`
        requests and events."""
        s = self._ownership.session(key, session_id)
        timings, total = self._store.timings(key.id, s.id, limit)
        # a usage row is stored when its request settles, after it was accepted (a minute's margin
        # for a wall clock that was set back meanwhile)
        since = min((t.accepted for t in timings), default=None)
        since = since - 60.0 if since is not None else None
        rows = self._store.usage_events(key.id, session_id=s.id, since=since)
        usage = {(u.run_id, u.request_id): u for u in rows}
        spans: list[TraceSpan] = []
        cycles: dict[tuple[str, int, int], list[tuple[Timing, TraceSpan | None]]] = defaultdict(list)
        for t in timings:
            u = usage.get((t.run_id, t.request_id))
            if t.operation in SAMPLING:
                spans += self._sampling(t, u)
            else:
                queued, step = self._training(t, u)
                spans += [x for x in (queued, step) if x is not None]
                if t.cycle and t.started:
                    cycles[(t.base_model, t.replica, t.cycle)].append((t, step))
        spans += [_cycle_span(k, members) for k, members in cycles.items()]
        _pack(spans)
        spans.sort(key=lambda x: (x.start, LANES.index(x.lane)))
        return Timeline(s.id, self._rates.currency, spans, len(timings), total - len(timings))

    def chrome_trace(self, key: ApiKey, session_id: str, limit: int = MAX_REQUESTS) -> dict:
        """The timeline in Chrome's trace-event JSON (Perfetto loads it): one process per replica,
        one thread per lane row, a complete event ("X") per span, times in microseconds."""
        return chrome_trace(self.timeline(key, session_id, limit))

    # ------------------------------------------------------------------ spans of one row
    def _cost(self, u: UsageEvent | None) -> dict[str, float]:
        return self._rates.cost(u) if u is not None else defaultdict(float)

    def _sampling(self, t: Timing, u: UsageEvent | None) -> list[TraceSpan]:
        cost = self._cost(u)
        base = dict(model=t.base_model, replica=t.replica, run_id=t.run_id, request_id=t.request_id)
        tokens = _tokens(u, ("prefill", "prefill_cached", "sample"))
        label = f"{t.operation} {t.request_id}"
        out = []
        queue_end = t.started or t.ended
        if queue_end > t.accepted:
            out.append(
                TraceSpan(
                    "queue",
                    name=label,
                    start=t.accepted,
                    end=queue_end,
                    tokens=tokens,
                    cost=cost["total"],
                    args={"status": t.status, "waited": "for the engine"},
                    **base,
                )
            )
        if t.started and t.prefilled:
            out.append(
                TraceSpan(
                    "prefill",
                    name=f"prefill {t.request_id}",
                    start=t.started,
                    end=t.prefilled,
                    tokens={k: tokens[k] for k in ("prefill", "prefill_cached")},
                    cost=cost["prefill"] + cost["prefill_cached"],
                    args={"status": t.status},
                    **base,
                )
            )
        if t.operation == "sample" and t.prefilled and t.ended > t.prefilled:
            out.append(
                TraceSpan(
                    "decode",
                    name=f"decode {t.request_id}",
                    start=t.prefilled,
                    end=t.ended,
                    tokens={"sample": tokens["sample"]},
                    cost=cost["sample"],
                    args={"status": t.status},
                    **base,
                )
            )
        return out

    def _training(self, t: Timing, u: UsageEvent | None) -> tuple[TraceSpan | None, TraceSpan | None]:
        cost = self._cost(u)
        base = dict(model=t.base_model, replica=t.replica, run_id=t.run_id, request_id=t.request_id)
        tokens = _tokens(u, ("train",))
        if u is not None:
            tokens.update(train_loss=u.train_loss, train_sequence=u.train_sequence)
        event = t.request_id.split("~", 1)[0]
        args = {"status": t.status, "cycle": t.cycle, "event_type": t.operation}
        queued = step = None
        if t.started > t.accepted:
            queued = TraceSpan(
                "queue",
                name=f"{t.operation} {event}",
                start=t.accepted,
                end=t.started,
                tokens=tokens,
                cost=cost["total"],
                args={**args, "waited": "for a clock cycle"},
                **base,
            )
        if t.op_started and t.op_ended >= t.op_started:
            step = TraceSpan(
                "train",
                name=t.operation,
                start=t.op_started,
                end=t.op_ended,
                tokens=tokens,
                cost=cost["total"],
                args=args,
                **base,
            )
        return queued, step


def _tokens(u: UsageEvent | None, phases: tuple[str, ...]) -> dict[str, int]:
    return {ph: getattr(u, ph) if u is not None else 0 for ph in phases}


def _cycle_span(k: tuple[str, int, int], members: list[tuple[Timing, TraceSpan | None]]) -> TraceSpan:
    model, replica, number = k
    steps = [s for _, s in members if s is not None]
    return TraceSpan(
        "cycle",
        model=model,
        replica=replica,
        name=f"cycle {number}",
        start=min(t.started for t, _ in members),
        end=max(t.ended for t, _ in members),
        tokens={"train": sum(s.tokens.get("train", 0) for s in steps)},
        cost=sum(s.cost for s in steps),
        args={"cycle": number, "events": len(members), "note": "this session's events only"},
    )


def _pack(spans: list[TraceSpan]) -> None:
    """Give each span the first row of its (model, replica, lane) that is free at its start."""
    rows: dict[tuple[str, int, str], list[float]] = defaultdict(list)  # -> each row's last end
    for s in sorted(spans, key=lambda x: (x.start, x.end)):
        ends = rows[(s.model, s.replica, s.lane)]
        s.row = next((i for i, e in enumerate(ends) if e <= s.start), len(ends))
        if s.row == len(ends):
            ends.append(s.end)
        else:
            ends[s.row] = s.end


def chrome_trace(tl: Timeline) -> dict:
    """`tl` as Chrome trace-event JSON (the object form, with metadata)."""
    replicas = sorted({(s.model, s.replica) for s in tl.spans})
    pid = {r: i + 1 for i, r in enumerate(replicas)}
    events: list[dict] = []
    for (model, replica), p in pid.items():
        events.append(_meta("process_name", p, 0, name=f"{model} replica {replica}"))
        events.append(_meta("process_sort_index", p, 0, sort_index=p))
    threads = sorted({(pid[(s.model, s.replica)], s.lane, s.row) for s in tl.spans})
    for p, lane, row in threads:
        tid = _tid(lane, row)
        name = f"{lane} {row + 1}" if lane != "cycle" else "clock cycles"
        events.append(_meta("thread_name", p, tid, name=name))
        events.append(_meta("thread_sort_index", p, tid, sort_index=tid))
    for s in tl.spans:
        events.append(
            {
                "name": s.name,
                "cat": s.lane,
                "ph": "X",
                "ts": round(s.start * 1e6, 3),
                "dur": round(max(0.0, s.end - s.start) * 1e6, 3),
                "pid": pid[(s.model, s.replica)],
                "tid": _tid(s.lane, s.row),
                "args": {
                    **({"run_id": s.run_id} if s.run_id else {}),
                    **({"request_id": s.request_id} if s.request_id else {}),
                    "tokens": s.tokens,
                    "cost": round(s.cost, 9),
                    **s.args,
                },
            }
        )
    return {
        "traceEvents": events,
        "displayTimeUnit": "ms",
        "metadata": {
            "session_id": tl.session_id,
            "currency": tl.currency,
            "source": "trine",
            "requests": tl.requests,
            "left_out": tl.left_out,  # the session's earlier requests and events, beyond the limit
        },
    }


def _tid(lane: str, row: int) -> int:
    return (LANES.index(lane) + 1) * 1000 + row


def _meta(what: str, pid: int, tid: int, **args) -> dict:
    return {"name": what, "ph": "M", "pid": pid, "tid": tid, "args": args}
