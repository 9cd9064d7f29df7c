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
    train: int = 0  # computed
    train_loss: int = 0
    train_sequence: int = 0  # as sent
    prefill_image: int = 0  # of prefill, the images' vision tokens
    prefill_image_cached: int = 0  # of prefill_cached, the images' vision tokens

    def add(self, e) -> None:
        for ph in PHASES:
            setattr(self, ph, getattr(self, ph) + getattr(e, ph))

    @property
    def prompt(self) -> int:
        return self.prefill + self.prefill_cached

    @property
    def image(self) -> int:
        """The prompt tokens that were images' vision tokens, computed or cached."""
        return self.prefill_image + self.prefill_image_cached

    @property
    def cache_hit_rate(self) -> float | None:
        """Cached / prompt tokens; None when nothing was prompted."""
        return self.prefill_cached / self.prompt if self.prompt else None

    @property
    def train_saved_fraction(self) -> float | None:
        """The part of the training tokens sent that a shared prefix spared computing."""
        return 1 - self.train / self.train_sequence if self.train_sequence else None

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
    # by run: what the id stands for ({kind, name, model, created_at, ...}; see describe_runs); else empty
    info: dict = field(default_factory=dict)
    # by run, a training run's row: its own usage ("training") and its samplers' ("sampling"), which
    # partition the row; parts["sampling"].info["runs"] counts the samplers
    parts: dict[str, ReportRow] = field(default_factory=dict)

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
        out = {
            "key": self.key,
            "info": self.info,
            "requests": self.requests,
            "tokens": {**t.to_dict(), "prompt": t.prompt, "image": t.image},
            "cost": {k: money(v) for k, v in self.cost.items()},
            "cache_hit_rate": t.cache_hit_rate,
            "loss_fraction": t.loss_fraction,
            "dominant_phase": self.dominant_phase,
        }
        if self.parts:
            out["parts"] = {k: p.to_dict() for k, p in self.parts.items()}
        return out

    @classmethod
    def from_dict(cls, d: dict) -> ReportRow:
        tok = PhaseTokens(**{f.name: d["tokens"].get(f.name, 0) for f in fields(PhaseTokens)})
        return cls(
            key=d["key"],
            requests=d["requests"],
            tokens=tok,
            cost={**dict.fromkeys((*BILLED_PHASES, "total"), 0.0), **d["cost"]},
            info=d.get("info") or {},
            parts={k: cls.from_dict(p) for k, p in (d.get("parts") or {}).items()},
        )


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
        return {
            "by": self.by,
            "currency": self.currency,
            "filters": self.filters,
            "total": self.total.to_dict(),
            "rows": [r.to_dict() for r in self.rows],
            "diagnostics": [d.to_dict() for d in self.diagnostics],
        }

    def to_json(self, **kw) -> str:
        return dumps(self.to_dict(), **kw)

    @classmethod
    def from_dict(cls, d: dict) -> Report:
        return cls(
            by=d["by"],
            rows=[ReportRow.from_dict(r) for r in d["rows"]],
            total=ReportRow.from_dict(d["total"]),
            diagnostics=[PatternSummary(**p) for p in d.get("diagnostics", [])],
            currency=d.get("currency", "USD"),
            filters=d.get("filters", {}),
        )


def group_key(e: UsageEvent, by: str) -> str:
    if by in TIME_FORMATS:
        return _time.strftime(TIME_FORMATS[by], _time.gmtime(e.time))
    return {"run": e.run_id, "model": e.base_model, "session": e.session_id}[by]


def describe_runs(store, run_ids) -> dict[str, dict]:
    """What each run id stands for, from a store with `training_run` / `sampling_run` / `checkpoint`
    / `last_metrics` lookups. A training run: kind, name (its own, else `training #N` by its index
    in its session), tags, model, created_at, lora, optimizer (the last settings used, or None) and
    metrics (each logged metric's last value). A sampler: kind, name (by the checkpoint it serves,
    else `base model`), model, created_at and the training run it is attributed to
    (`training_run_id`, "" for none), which is described too."""
    out: dict[str, dict] = {}
    pending = list(run_ids)
    while pending:
        rid = pending.pop()
        if rid in out:
            continue
        tr = store.training_run(rid)
        if tr is not None:
            out[rid] = {
                "kind": "training",
                "name": tr.name or f"training #{tr.run_index}",
                "tags": tr.tag_list,
                "model": tr.base_model,
                "created_at": tr.created_at,
                "lora": {
                    "rank": tr.lora_rank,
                    "train_mlp": tr.train_mlp,
                    "train_attn": tr.train_attn,
                    "train_unembed": tr.train_unembed,
                    "seed": tr.seed,
                },
                "optimizer": tr.optimizer_settings,
                "metrics": store.last_metrics(rid),
            }
            continue
        sr = store.sampling_run(rid)
        if sr is not None:
            ck = store.checkpoint(sr.checkpoint_id) if sr.checkpoint_id else None
            name = (
                f"sampler of {ck.name}"
                if ck is not None
                else ("sampler" if sr.checkpoint_id else "base model")
            )
            owner = sr.training_run_id or ""
            out[rid] = {
                "kind": "sampling",
                "name": name,
                "model": sr.base_model,
                "created_at": sr.created_at,
                "training_run_id": owner,
            }
            if owner:
                pending.append(owner)
    return out


def build_report(
    events: list[UsageEvent],
    by: str | None = None,
    rate_card: RateCard | None = None,
    diagnostics: list[CacheDiagnostic] = (),
    filters: dict | None = None,
    run_info: dict[str, dict] | None = None,
) -> Report:
    """Aggregate events into a total and, with `by`, one row per group (sorted by key). By run, a
    sampler attributed to a training run (`run_info[sampler]["training_run_id"]`) counts in that
    run's row, which then has `parts` (training, sampling); rows carry `run_info[run_id]` as info."""
    if by is not None and by not in GROUPINGS:
        raise ValueError(f"by must be one of {GROUPINGS} or None, got {by!r}")
    rate_card = rate_card or RateCard.load()
    run_info = run_info or {}
    total, rows = ReportRow("total"), {}
    samplers: dict[str, set[str]] = {}
    for e in events:
        c = rate_card.cost(e)
        total.add(e, c)
        if by is None:
            continue
        k = group_key(e, by)
        owner = run_info.get(k, {}).get("training_run_id") if by == "run" else None
        if owner:
            samplers.setdefault(owner, set()).add(k)
            k = owner
        row = rows.setdefault(k, ReportRow(k, info=run_info.get(k, {}) if by == "run" else {}))
        row.add(e, c)
        if by == "run" and run_info.get(k, {}).get("kind") == "training":
            part = "sampling" if owner else "training"
            row.parts.setdefault(part, ReportRow(part)).add(e, c)
    for owner, ids in samplers.items():
        if "sampling" in rows[owner].parts:
            rows[owner].parts["sampling"].info = {"runs": len(ids)}
    for r in rows.values():  # a training run without samplers needs no breakdown
        r.parts = (
            {k: r.parts[k] for k in ("training", "sampling") if k in r.parts} if "sampling" in r.parts else {}
        )
    return Report(
        by=by,
        rows=[rows[k] for k in sorted(rows)],
        total=total,
        diagnostics=summarize_diagnostics(diagnostics, rate_card),
        currency=rate_card.currency,
        filters=filters or {},
    )


def summarize_diagnostics(diags: list[CacheDiagnostic], rate_card: RateCard) -> list[PatternSummary]:
    out = []
    for pattern in PATTERNS:
        ds = [d for d in diags if d.pattern == pattern]
        if not ds:
            continue
        lost = sum(d.tokens_lost for d in ds)
        cost = sum(
            d.tokens_lost
            * (rate_card.price(d.base_model).prefill - rate_card.price(d.base_model).prefill_cached)
            / 1e6
            for d in ds
        )
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
        for name in ("name", "model", "created", "lora", "optimizer", "last metrics"):
            t.add_column(name, overflow="fold")
    for name in ("req", "prefill", "cached", "image", "sample", "train", "sent", "loss", "hit"):
        t.add_column(name, justify="right")
    t.add_column(report.currency, justify="right", no_wrap=True)

    def add(key, r, labels, **style):
        tk = r.tokens
        t.add_row(
            key,
            *labels,
            f"{r.requests:,}",
            f"{tk.prefill:,}",
            f"{tk.prefill_cached:,}",
            f"{tk.image:,}",
            f"{tk.sample:,}",
            f"{tk.train:,}",
            f"{tk.train_sequence:,}",
            f"{tk.train_loss:,}",
            fmt_pct(tk.cache_hit_rate),
            fmt_money(r.cost["total"]),
            **style,
        )

    for r in report.rows + [report.total]:
        i = r.info
        labels = (
            [
                i.get("name", ""),
                i.get("model", ""),
                fmt_time(i.get("created_at")),
                fmt_lora(i.get("lora")),
                fmt_optimizer(i.get("optimizer")),
                fmt_metrics(i.get("metrics")),
            ]
            if by_run
            else []
        )
        last = r is not report.total and r is report.rows[-1]
        add(r.key, r, labels, style="bold" if r is report.total else None, end_section=last and not r.parts)
        for i, (kind, p) in enumerate(r.parts.items()):
            what = f"{p.info.get('runs', 0)} sampler(s)" if kind == "sampling" else "training"
            add(
                f"  {'└' if i == len(r.parts) - 1 else '├'} {what}",
                p,
                [""] * len(labels),
                style="dim",
                end_section=last and i == len(r.parts) - 1,
            )
    console.print(t)
    tk, c = report.total.tokens, report.total.cost
    console.print(
        "cached = prompt tokens served from the prefix cache; hit = cached / prompt; image = the "
        "prompt tokens that were images (computed or cached, counted in prefill and cached too); "
        f"loss = train positions with non-zero weight ({fmt_pct(tk.loss_fraction)} of train)"
    )
    parts = [
        f"{ph} {fmt_money(c[ph])} ({fmt_pct(c[ph] / c['total'] if c['total'] else None)})"
        for ph in BILLED_PHASES
    ]
    console.print(f"cost by phase ({report.currency}): " + " · ".join(parts))
    if report.total.dominant_phase:
        console.print(f"dominant phase: [bold]{report.total.dominant_phase}[/bold]")
    if report.diagnostics:
        console.print("[bold]prefix-cache diagnostics[/bold]")
    for p in report.diagnostics:
        console.print(
            f"  [bold]{p.pattern}[/bold]: {p.requests:,} request(s), {p.tokens_lost:,} prompt tokens "
            f"prefilled that could have been cached ({report.currency} {fmt_money(p.cost_lost)}); "
            f"prompts diverge at token {p.diverge_position}\n    fix: {p.fix}"
        )


def fmt_lora(lora: dict | None) -> str:
    """`r32 mlp+attn+unembed` (the trained parts); "" for none."""
    if not lora:
        return ""
    parts = [p for p in ("mlp", "attn", "unembed") if lora.get(f"train_{p}")]
    return f"r{lora['rank']} {'+'.join(parts) or 'nothing trained'}"


def fmt_optimizer(opt: dict | None) -> str:
    """The settings of the last optim_step: AdamW `lr 0.0001 b 0.9/0.95 wd 0 clip 0`, Dimuon
    `dimuon lr 0.02 b 0.9 clip 0`; "" before any."""
    if not opt:
        return ""
    if opt.get("type") == "dimuon":
        return f"dimuon lr {opt['learning_rate']:g} b {opt['beta1']:g} clip {opt['grad_clip_norm']:g}"
    return (
        f"lr {opt['learning_rate']:g} b {opt['beta1']:g}/{opt['beta2']:g} wd {opt['weight_decay']:g} "
        f"clip {opt['grad_clip_norm']:g}"
    )


def fmt_metrics(metrics: dict | None) -> str:
    """Logged metrics' last values: `kl=0.0033 reward=0.75`."""
    return " ".join(f"{k}={v:.4g}" for k, v in (metrics or {}).items())


def fmt_time(ts: float | None) -> str:
    return _time.strftime("%Y-%m-%d %H:%M", _time.localtime(ts)) if ts else ""


def fmt_pct(x: float | None) -> str:
    return "-" if x is None else f"{100 * x:.1f}%"
