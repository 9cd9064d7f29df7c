"""What the console shows of training runs: the run list and one run's curves, step by step, with
the metrics the user logged (`log_metrics`), its labels, LoRA shape, last optimizer settings and
its samplers (the JSON `trine runs` reads too).

Everything is read through the key-isolated service queries (`svc.ownership.training_run`,
`svc.queries.training_runs`, `run_events`, `event_results`, `checkpoints`), so another key's run is
a NotFound exactly as on the API.

A *step* is one forward_backward group (the chunks the SDK sends with the same `step` number)
closed by the optim_step that follows it. A step's loss is its chunks' `loss_mean` weighted by their
`token_count`, which for a single chunk is that event's `loss_mean`.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import asdict, dataclass, field

from ...metering.money import money
from ...service import ApiKey, EventRecord, EventResult, Service, TrainingRun
from ...service.queries import Queries
from ...sizes import fmt_size

FORWARD_BACKWARD = "trainer.forward_backward"
OPTIMIZE_STEP = "trainer.optimize_step"
FINISHED = ("succeeded", "failed")


@dataclass
class RunEventOutcome:
    """An event's result as the console reads it: protocol-neutral fields only."""

    status: str
    metrics: dict = field(default_factory=dict)
    train_tokens: int = 0
    loss_tokens: int = 0
    cost: float = 0.0
    cycle: int | None = None
    error: str | None = None


def event_outcome(rec: EventRecord, res: EventResult | None) -> RunEventOutcome:
    """The one place that reads an event's result (the service's protocol-neutral EventResult),
    keeping what the console shows and dropping the per-token lists."""
    if res is None:
        return RunEventOutcome(rec.status, cycle=rec.cycle)
    error = f"{res.error.get('code')}: {res.error.get('message')}" if res.error else None
    return RunEventOutcome(
        res.status,
        dict(res.metrics or {}),
        res.train_tokens,
        res.loss_tokens,
        res.cost,
        rec.cycle if res.cycle is None else res.cycle,
        error,
    )


# Decoded results of finished events by event id. A finished event's result never changes and
# event ids are unique, so a page that polls a long run reads and decodes each result once.
_OUTCOMES: OrderedDict[str, RunEventOutcome] = OrderedDict()
MAX_CACHED_OUTCOMES = 50_000


def outcomes(queries: Queries, key: ApiKey, events: list[EventRecord]) -> dict[str, RunEventOutcome]:
    """The outcomes of the finished events among `events` (listed without their results)."""
    done = [e for e in events if e.status in FINISHED]
    missing = [e for e in done if e.id not in _OUTCOMES]
    results = queries.event_results(key, missing) if missing else {}
    for e in missing:
        _OUTCOMES[e.id] = event_outcome(e, results.get(e.id))
    out = {}
    for e in done:
        _OUTCOMES.move_to_end(e.id)
        out[e.id] = _OUTCOMES[e.id]
    while len(_OUTCOMES) > MAX_CACHED_OUTCOMES:
        _OUTCOMES.popitem(last=False)
    return out


@dataclass
class Step:
    """One training step of a run (see the module docstring)."""

    step: int  # 1-based position among the run's steps
    loss: float | None = None
    loss_sum: float = 0.0
    token_count: int = 0
    train_tokens: int = 0  # computed positions (the whole sequences)
    loss_tokens: int = 0  # positions in the loss
    chunks: int = 0
    cycle: int | None = None  # the clock cycle that ran the step's last forward_backward
    optim_cycle: int | None = None
    grad_norm: float | None = None
    learning_rate: float | None = None
    cost: float = 0.0
    finished_at: float | None = None
    failed: int = 0  # events of this step that failed
    started_at: float | None = None  # when its first event was accepted
    seconds: float | None = None  # wall-clock: from the previous step's end (the first: its start) to its end


def run_steps(events: list[EventRecord], results: dict[str, RunEventOutcome]) -> list[Step]:
    """Fold a run's events (in index order) into steps; only finished events count."""
    steps: list[Step] = []
    cur: Step | None = None
    closed = True  # the current step has had its optim_step
    group = None  # the `step` field of the current forward_backward group
    for rec in events:
        out = results.get(rec.id)
        if rec.type not in (FORWARD_BACKWARD, OPTIMIZE_STEP) or out is None:
            continue
        if closed or (rec.type == FORWARD_BACKWARD and rec.step != group):
            cur = Step(len(steps) + 1, started_at=rec.created_at)  # (an optim_step alone is a step too)
            steps.append(cur)
            closed, group = False, rec.step
        if rec.type == FORWARD_BACKWARD:
            _add_chunk(cur, rec, out)
        else:
            closed = True
            cur.optim_cycle = rec.cycle
            cur.grad_norm = _float(out.metrics.get("grad_norm"))
            cur.learning_rate = _float(out.metrics.get("learning_rate"))
            cur.failed += out.error is not None
            cur.finished_at = rec.updated_at
    for prev, s in zip([None, *steps], steps):
        since = prev.finished_at if prev is not None else s.started_at
        s.seconds = s.finished_at - since if s.finished_at is not None and since is not None else None
    return steps


def _add_chunk(step: Step, rec: EventRecord, out: RunEventOutcome) -> None:
    step.chunks += 1
    step.finished_at = rec.updated_at
    if out.error is not None:
        step.failed += 1
        return
    n, mean = int(out.metrics.get("token_count", 0)), _float(out.metrics.get("loss_mean"))
    step.loss_sum += float(out.metrics.get("loss_sum", 0.0))
    if step.loss is None:
        step.loss = mean
    elif mean is not None and step.token_count + n:  # the token-weighted mean of the chunks' loss_mean
        step.loss = (step.loss * step.token_count + mean * n) / (step.token_count + n)
    step.token_count += n
    step.train_tokens += out.train_tokens
    step.loss_tokens += out.loss_tokens
    step.cost += out.cost
    step.cycle = rec.cycle


def _float(x) -> float | None:
    return None if x is None else float(x)


def run_json(svc: Service, key: ApiKey, r: TrainingRun, events: list[EventRecord] | None = None) -> dict:
    """A run's row in the run list: `steps` = optim steps done; last activity from its events."""
    events = svc.queries.run_events(key, r.id) if events is None else events
    last = max([r.updated_at, *(e.updated_at for e in events)])
    return {
        "id": r.id,
        "name": r.name or None,
        "tags": r.tag_list,
        "user_metadata": r.metadata,
        "model": r.base_model,
        "rank": r.lora_rank,
        "state": r.status,
        "lora": {
            "rank": r.lora_rank,
            "train_mlp": r.train_mlp,
            "train_attn": r.train_attn,
            "train_unembed": r.train_unembed,
            "seed": r.seed,
        },
        "optimizer": r.optimizer_settings,
        "last_metrics": svc.metrics.last(key, r.id),
        "samplers": len(svc.queries.sampling_runs(key, training_run_id=r.id)),
        "session_id": r.session_id,
        "steps": sum(e.type == OPTIMIZE_STEP and e.status == "succeeded" for e in events),
        "last_cycle": r.last_cycle,
        "created_at": r.created_at,
        "last_active": last,
        "events": len(events),
        "pending": sum(e.status in ("accepted", "running") for e in events),
        "source_checkpoint_uri": r.source_checkpoint_uri or None,
    }


def list_runs(svc: Service, key: ApiKey, limit: int = 200) -> list[dict]:
    """The key's training runs, newest first."""
    runs, _ = svc.queries.training_runs(key, limit=10_000, offset=0)
    runs = sorted(runs, key=lambda r: r.created_at, reverse=True)[:limit]
    return [run_json(svc, key, r) for r in runs]


def run_detail(svc: Service, key: ApiKey, run_id: str) -> dict:
    """One run (NotFound if the key does not own it): its row, its steps and its checkpoints."""
    r = svc.ownership.training_run(key, run_id)
    events = svc.queries.run_events(key, r.id)
    results = outcomes(svc.queries, key, events)
    cks, _ = svc.queries.checkpoints(key, training_run_id=r.id)
    return {
        "run": run_json(svc, key, r, events),
        "steps": [{**asdict(s), "cost": money(s.cost)} for s in run_steps(events, results)],
        "metrics": {name: [list(p) for p in pts] for name, pts in svc.metrics.series(key, r.id).items()},
        "checkpoints": [checkpoint_row(c) for c in cks],
        "failures": [
            {"index": e.idx, "type": e.type, "error": results[e.id].error}
            for e in events
            if e.status == "failed"
        ][-20:],
    }


def checkpoint_row(c) -> dict:
    return {
        "id": c.id,
        "run_id": c.training_run_id,
        "name": c.name,
        "kind": c.kind,
        "uri": c.uri,
        "size_bytes": c.size_bytes,
        "size": fmt_size(c.size_bytes),
        "visibility": c.visibility,
        "model": c.base_model,
        "rank": c.lora_rank,
        "step": c.step,
        "created_at": c.created_at,
        "expires_at": c.expires_at,
        "downloadable": bool(c.path),
    }


TRAINING_COLUMNS = (
    ("train:loss", "loss"),
    ("train:grad_norm", "grad_norm"),
    ("train:learning_rate", "learning_rate"),
    ("train:seconds", "seconds"),
)


def metrics_table(svc: Service, key: ApiKey, run_id: str) -> tuple[list[str], list[list]]:
    """A run's metrics as one table by step: the training curves (`train:*`, step = the 1-based
    training step) and every logged metric (at the step it was logged at); None where a column
    has no value at a step."""
    detail = run_detail(svc, key, run_id)
    by_step: dict[int, dict] = {}
    for s in detail["steps"]:
        by_step.setdefault(s["step"], {}).update({col: s[f] for col, f in TRAINING_COLUMNS})
    for name, points in detail["metrics"].items():
        for step, value in points:
            by_step.setdefault(step, {})[name] = value
    columns = ["step", *(c for c, _ in TRAINING_COLUMNS if detail["steps"]), *detail["metrics"]]
    return columns, [[step, *(by_step[step].get(c) for c in columns[1:])] for step in sorted(by_step)]
