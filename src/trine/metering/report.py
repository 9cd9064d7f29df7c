"""Usage reports: tokens and cost by phase, per group (minute, hour, day, run, model or session) and
in total.

Invariants: a report's total tokens are exactly the sums of its events' tokens, and every row's tokens
are the sums of the events in that row (rows partition the events). Costs are priced per event's
base model, so a row mixing models is still priced correctly. Every event is validated on the way in
(`UsageEvent.__post_init__`: non-negative counts, loss <= train), and prompt = prefill + prefill_cached
holds by construction.
"""
from __future__ import annotations

import time as _time
from collections import Counter
from dataclasses import asdict, dataclass, field, fields

from .events import PATTERNS, PHASES, CacheDiagnostic, UsageEvent
from .money import dumps, fmt_money, money
from .rates import BILLED_PHASES, RateCard

GROUPINGS = ("minute", "hour", "day", "run", "model", "session")
TIME_FORMATS = {"minute": "%Y-%m-%d %H:%MZ", "hour": "%Y-%m-%d %H:00Z", "day": "%Y-%m-%d"}

FIXES = {
    "retokenized_history": "build each turn by appending to the sampler's returned tokens; "
                           "do not re-tokenize the history text",
    "varying_head": "put fixed content (system prompt, tool definitions) first and varying content "
                    "(dates, ids, the question) after it",
    "split_group": "send one request with num_samples=N instead of N requests of one sample",
}


@dataclass
class PhaseTokens:
    prefill: int = 0
    prefill_cached: int = 0
    sample: int = 0
    train: int = 0
    train_loss: int = 0

    def add(self, e) -> None:
        for ph in PHASES:
            setattr(self, ph, getattr(self, ph) + getattr(e, ph))

    @property
    def prompt(self) -> int:
        return self.prefill + self.prefill_cached

    @property
    def cache_hit_rate(self) -> float | None:
        """Cached / prompt tokens; None when nothing was prompted."""
        return self.prefill_cached / self.prompt if self.prompt else None

    @property
    def loss_fraction(self) -> float | None:
        """Loss tokens / computed train tokens; None when nothing was trained."""
        return self.train_loss / self.train if self.train else None

    def to_dict(self) -> dict:
        return asdict(self)


@dataclass
class ReportRow:
    key: str  # the group: a minute, hour ("2026-01-05 13:00Z") or day, run id, model or session; or "total"
    requests: int = 0
    tokens: PhaseTokens = field(default_factory=PhaseTokens)
    cost: dict[str, float] = field(default_factory=lambda: dict.fromkeys((*BILLED_PHASES, "total"), 0.0))
    # by run: what the id stands for ({kind, name, model, created_at}; see describe_runs); else empty
    info: dict = field(default_factory=dict)

    def add(self, e: UsageEvent, cost: dict[str, float]) -> None:
        self.requests += 1
        self.tokens.add(e)
        for k, v in cost.items():
            self.cost[k] += v

    @property
    def dominant_phase(self) -> str | None:
        """The billed phase with the largest cost (None when nothing was billed)."""
        costs = {ph: self.cost[ph] for ph in BILLED_PHASES}
        best = max(costs, key=costs.get)
        return best if costs[best] > 0 else None

    def to_dict(self) -> dict:
        t = self.tokens
        return {"key": self.key, "info": self.info, "requests": self.requests,
                "tokens": {**t.to_dict(), "prompt": t.prompt},
                "cost": {k: money(v) for k, v in self.cost.items()}, "cache_hit_rate": t.cache_hit_rate,
                "loss_fraction": t.loss_fraction,
                "dominant_phase": self.dominant_phase}

    @classmethod
    def from_dict(cls, d: dict) -> ReportRow:
        tok = PhaseTokens(**{f.name: d["tokens"][f.name] for f in fields(PhaseTokens)})
        return cls(key=d["key"], requests=d["requests"], tokens=tok, cost=dict(d["cost"]), info=d.get("info") or {})


@dataclass
class PatternSummary:
    """All diagnostics of one pattern: how often, how many prompt tokens it cost, where prompts diverged."""

    pattern: str
    requests: int
    tokens_lost: int  # prompt tokens prefilled that a cache-friendly prompt would have served from cache
    cost_lost: float  # tokens_lost priced at (prefill - prefill_cached)
    diverge_position: int  # the most common divergence position
    fix: str

    def to_dict(self) -> dict:
        return {**asdict(self), "cost_lost": money(self.cost_lost)}


@dataclass
class Report:
    by: str | None
    rows: list[ReportRow]
    total: ReportRow
    diagnostics: list[PatternSummary] = field(default_factory=list)
    currency: str = "USD"
    filters: dict = field(default_factory=dict)  # session_id / run_id / since the events were selected by

    def to_dict(self) -> dict:
        return {"by": self.by, "currency": self.currency, "filters": self.filters,
                "total": self.total.to_dict(), "rows": [r.to_dict() for r in self.rows],
                "diagnostics": [d.to_dict() for d in self.diagnostics]}

    def to_json(self, **kw) -> str:
        return dumps(self.to_dict(), **kw)

    @classmethod
    def from_dict(cls, d: dict) -> Report:
        return cls(by=d["by"], rows=[ReportRow.from_dict(r) for r in d["rows"]],
                   total=ReportRow.from_dict(d["total"]),
                   diagnostics=[PatternSummary(**p) for p in d.get("diagnostics", [])],
                   currency=d.get("currency", "USD"), filters=d.get("filters", {}))


def group_key(e: UsageEvent, by: str) -> str:
    if by in TIME_FORMATS:
        return _time.strftime(TIME_FORMATS[by], _time.gmtime(e.time))
    return {"run": e.run_id, "model": e.base_model, "session": e.session_id}[by]


def describe_runs(store, run_ids) -> dict[str, dict]:
    """What each run id stands for, from a store with `training_run` / `sampling_run` / `checkpoint`
    lookups: kind (training / sampling), a name (`training #N` by its index in its session; a
    sampler by the checkpoint it serves, else `base model`), model and creation time."""
    out = {}
    for rid in run_ids:
        tr = store.training_run(rid)
        if tr is not None:
            name = f"training #{tr.run_index}"
            out[rid] = {"kind": "training", "name": name, "model": tr.base_model, "created_at": tr.created_at}
            continue
        sr = store.sampling_run(rid)
        if sr is not None:
            ck = store.checkpoint(sr.checkpoint_id) if sr.checkpoint_id else None
            name = f"sampler of {ck.name}" if ck is not None else ("sampler" if sr.checkpoint_id else "base model")
            out[rid] = {"kind": "sampling", "name": name, "model": sr.base_model, "created_at": sr.created_at}
    return out


def build_report(events: list[UsageEvent], by: str | None = None, rate_card: RateCard | None = None,
                 diagnostics: list[CacheDiagnostic] = (), filters: dict | None = None,
                 run_info: dict[str, dict] | None = None) -> Report:
    """Aggregate events into a total and, with `by`, one row per group (sorted by key; by run, the
    rows carry `run_info[run_id]` as their `info`)."""
    if by is not None and by not in GROUPINGS:
        raise ValueError(f"by must be one of {GROUPINGS} or None, got {by!r}")
    rate_card = rate_card or RateCard.load()
    total, rows = ReportRow("total"), {}
    for e in events:
        c = rate_card.cost(e)
        total.add(e, c)
        if by is not None:
            k = group_key(e, by)
            rows.setdefault(k, ReportRow(k, info=(run_info or {}).get(k, {}) if by == "run" else {})).add(e, c)
    return Report(by=by, rows=[rows[k] for k in sorted(rows)], total=total,
                  diagnostics=summarize_diagnostics(diagnostics, rate_card),
                  currency=rate_card.currency, filters=filters or {})


def summarize_diagnostics(diags: list[CacheDiagnostic], rate_card: RateCard) -> list[PatternSummary]:
    out = []
    for pattern in PATTERNS:
        ds = [d for d in diags if d.pattern == pattern]
        if not ds:
            continue
        lost = sum(d.tokens_lost for d in ds)
        cost = sum(d.tokens_lost * (rate_card.price(d.base_model).prefill
                                    - rate_card.price(d.base_model).prefill_cached) / 1e6 for d in ds)
        pos = Counter(d.diverge_position for d in ds).most_common(1)[0][0]
        out.append(PatternSummary(pattern, len(ds), lost, cost, pos, FIXES[pattern]))
    return out


# ---- rendering ---------------------------------------------------------------------------------------

def render(report: Report, console=None) -> None:
    """Print the report: a table of tokens by phase per group, cost by phase, then cache diagnostics."""
    from rich.console import Console
    from rich.table import Table

    console = console or Console()
    title = "usage by phase" + (f", by {report.by}" if report.by else "")
    if report.filters:
        title += " (" + ", ".join(f"{k}={v}" for k, v in report.filters.items()) + ")"
    t = Table(title=title, title_justify="left")
    t.add_column(report.by or "", no_wrap=True)
    by_run = report.by == "run" and any(r.info for r in report.rows)
    if by_run:
        for name in ("name", "model", "created"):
            t.add_column(name, overflow="fold")
    for name in ("req", "prefill", "cached", "sample", "train", "loss", "hit"):
        t.add_column(name, justify="right")
    t.add_column(report.currency, justify="right", no_wrap=True)
    for r in report.rows + [report.total]:
        tk = r.tokens
        labels = [r.info.get("name", ""), r.info.get("model", ""), fmt_time(r.info.get("created_at"))] if by_run else []
        t.add_row(r.key, *labels, f"{r.requests:,}", f"{tk.prefill:,}", f"{tk.prefill_cached:,}", f"{tk.sample:,}",
                  f"{tk.train:,}", f"{tk.train_loss:,}", fmt_pct(tk.cache_hit_rate), fmt_money(r.cost["total"]),
                  style="bold" if r is report.total else None,
                  end_section=r is not report.total and r is report.rows[-1])
    console.print(t)
    tk, c = report.total.tokens, report.total.cost
    console.print("cached = prompt tokens served from the prefix cache; hit = cached / prompt; "
                  f"loss = train positions with non-zero weight ({fmt_pct(tk.loss_fraction)} of train)")
    parts = [f"{ph} {fmt_money(c[ph])} ({fmt_pct(c[ph] / c['total'] if c['total'] else None)})" for ph in BILLED_PHASES]
    console.print(f"cost by phase ({report.currency}): " + " · ".join(parts))
    if report.total.dominant_phase:
        console.print(f"dominant phase: [bold]{report.total.dominant_phase}[/bold]")
    if report.diagnostics:
        console.print("[bold]prefix-cache diagnostics[/bold]")
    for p in report.diagnostics:
        console.print(f"  [bold]{p.pattern}[/bold]: {p.requests:,} request(s), {p.tokens_lost:,} prompt tokens "
                      f"prefilled that could have been cached ({report.currency} {fmt_money(p.cost_lost)}); "
                      f"prompts diverge at token {p.diverge_position}\n    fix: {p.fix}")


def fmt_time(ts: float | None) -> str:
    return _time.strftime("%Y-%m-%d %H:%M", _time.localtime(ts)) if ts else ""


def fmt_pct(x: float | None) -> str:
    return "-" if x is None else f"{100 * x:.1f}%"
