"""Predict a job's tokens and cost by phase from its shape, with and without the prefix cache.

The model follows how trine executes (engine/sampler/sampler.py, engine/trainer/trainer.py):
- Each step samples `prompts_per_step` groups. A group's first turn is one request with
  num_samples=group_size: its prompt (system + prompt tokens) is prefilled once, and each sample decodes
  `completion_tokens`. Later turns continue each trajectory separately (one request per sample) with
  prompt = previous prompt + completion + `prompt_tokens` new tokens.
- The prefix cache holds the KV of every computed token: prompts and generated tokens, but not a
  sequence's last sampled token (it was never fed back), to the token: full blocks and, when a
  sequence stops, its partial last block. A request reuses the longest cached prefix of
  prompt[:-1], so a full hit still computes the last prompt token. A later turn therefore computes
  its new tokens plus the previous turn's last sampled token.
- Different groups of a step share the system prompt: only the step's first group computes it.
  Training changes the weights every step (optim_step bumps the adapter version), so with
  train_passes > 0 the cache starts cold each step; without training it stays warm across steps.
- Training runs `train_passes` forward_backward passes over each trajectory; a trajectory of N tokens is
  one datum of N - 1 positions (inputs tokens[:-1], targets tokens[1:]): train tokens. Its loss tokens
  are the completions (turns x completion_tokens). `trained_fraction` scales both, for loops that train
  on only some trajectories (GRPO skips a group whose rewards are all equal: zero advantages).
Invariant: `with_cache` and `without_cache` have the same prompt, sample, train and loss tokens; only
the split of prompt tokens into computed and cached differs.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, fields

from .money import fmt_money
from .rates import RateCard
from .report import PhaseTokens, ReportRow


@dataclass(frozen=True)
class JobShape:
    model: str = "default"
    steps: int = 1
    prompts_per_step: int = 1  # groups per step
    group_size: int = 1  # samples per prompt (num_samples)
    turns: int = 1  # sampling turns per trajectory
    prompt_tokens: int = 128  # the first turn's prompt after the system prompt; each later turn's new tokens
    completion_tokens: int = 128  # per turn, per sample
    system_tokens: int = 0  # a fixed prefix every prompt starts with (system prompt, tool definitions)
    train_passes: int = 1  # forward_backward passes over each trajectory per step; 0 = sampling only
    trained_fraction: float = 1.0  # share of trajectories trained on (GRPO drops groups of equal rewards)
    prefix_sharing: bool = True  # the server trains a prefix its datums share once (trine serve's default)

    def __post_init__(self):
        minimum = {
            "steps": 1,
            "prompts_per_step": 1,
            "group_size": 1,
            "turns": 1,
            "prompt_tokens": 1,
            "completion_tokens": 0,
            "system_tokens": 0,
            "train_passes": 0,
        }
        for name, lo in minimum.items():
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < lo:
                raise ValueError(f"{name} must be an integer >= {lo}, got {v!r}")
        f = self.trained_fraction
        if isinstance(f, bool) or not isinstance(f, (int, float)) or not 0 <= f <= 1:
            raise ValueError(f"trained_fraction must be a number in [0, 1], got {f!r}")

    @property
    def trajectory_tokens(self) -> int:
        """Tokens of one finished trajectory: system + every turn's prompt tokens and completion."""
        return self.system_tokens + self.turns * (self.prompt_tokens + self.completion_tokens)


@dataclass
class Estimate:
    shape: JobShape
    with_cache: ReportRow  # requests = sampling requests
    without_cache: ReportRow
    currency: str = "USD"

    @property
    def dominant_phase(self) -> str | None:
        return self.with_cache.dominant_phase

    @property
    def cache_savings(self) -> float:
        """Cost the prefix cache saves, as a fraction of the job's cost without it."""
        before = self.without_cache.cost["total"]
        return (before - self.with_cache.cost["total"]) / before if before else 0.0

    def to_dict(self) -> dict:
        return {
            "shape": asdict(self.shape),
            "with_cache": self.with_cache.to_dict(),
            "without_cache": self.without_cache.to_dict(),
            "dominant_phase": self.dominant_phase,
            "cache_savings": self.cache_savings,
        }


def estimate(shape: JobShape, rate_card: RateCard) -> Estimate:
    rows = []
    for cache in (True, False):
        s = shape
        cold, warm = _group(s, cache, system_cached=False), _group(s, cache, system_cached=True)
        groups_warm = s.prompts_per_step - 1
        if s.train_passes > 0:  # new weights every step: each step's first group is cold
            tokens = _sum([(cold, s.steps), (warm, s.steps * groups_warm)])
        else:
            tokens = _sum([(cold, 1), (warm, s.steps * s.prompts_per_step - 1)])
        trained = s.train_passes * s.trained_fraction * s.steps * s.prompts_per_step * s.group_size
        tokens.train_sequence = round(trained * (s.trajectory_tokens - 1))
        tokens.train = tokens.train_sequence - round(s.train_passes * s.steps * _shared_per_step(s))
        tokens.train_loss = round(trained * s.turns * s.completion_tokens)
        requests = s.steps * s.prompts_per_step * (1 + (s.turns - 1) * s.group_size)
        key = "with prefix cache" if cache else "without prefix cache"
        rows.append(ReportRow(key, requests, tokens, rate_card.cost(tokens, s.model)))
    return Estimate(shape, *rows, currency=rate_card.currency)


def _shared_per_step(s: JobShape) -> float:
    """Training tokens a step's shared prefixes spare (engine/trainer/prefix_groups.py): the step's
    trajectories share the system prompt, and a group's share its first prompt. A shared segment
    shorter than the trainer's MIN_SHARED_TOKENS is computed in each datum instead."""
    if not s.prefix_sharing:
        return 0.0
    # torch-free, imported here so that `import trine` (whose types use metering) loads no engine
    from ..engine.trainer.prefix_groups import MIN_SHARED_TOKENS

    trajectories = s.trained_fraction * s.prompts_per_step * s.group_size
    groups = trajectories / s.group_size
    saved, group_segment = 0.0, s.system_tokens + s.prompt_tokens
    if s.system_tokens >= MIN_SHARED_TOKENS and trajectories > 1:
        saved += (trajectories - 1) * s.system_tokens
        group_segment = s.prompt_tokens
    if group_segment >= MIN_SHARED_TOKENS:
        saved += (trajectories - groups) * group_segment
    return saved


def _group(s: JobShape, cache: bool, system_cached: bool) -> PhaseTokens:
    """Sampling tokens of one group: turn 1 as one request of group_size samples, later turns per sample."""
    t = PhaseTokens()
    n = s.system_tokens + s.prompt_tokens
    hit = min(s.system_tokens, n - 1) if cache and system_cached else 0
    t.prefill, t.prefill_cached = n - hit, hit
    t.sample = s.group_size * s.completion_tokens
    for _ in range(1, s.turns):
        computed_kv = n + s.completion_tokens - 1  # the previous turn's KV: all but its last sampled token
        n += s.completion_tokens + s.prompt_tokens
        hit = min(computed_kv, n - 1) if cache else 0
        t.prefill += s.group_size * (n - hit)
        t.prefill_cached += s.group_size * hit
        t.sample += s.group_size * s.completion_tokens
    return t


def _sum(parts: list[tuple[PhaseTokens, int]]) -> PhaseTokens:
    out = PhaseTokens()
    for t, k in parts:
        for f in fields(PhaseTokens):
            setattr(out, f.name, getattr(out, f.name) + k * getattr(t, f.name))
    return out


def render(est: Estimate, console=None, wall=None) -> None:
    """Print tokens and cost by phase, with and without the prefix cache, the dominant phase, and
    the wall-clock time on this machine when a measurement is given (`wallclock.WallClock`)."""
    from rich.console import Console
    from rich.table import Table

    console = console or Console()
    s, w, wo = est.shape, est.with_cache, est.without_cache
    console.print(
        f"[bold]{s.model}[/bold]: {s.steps} steps × {s.prompts_per_step} prompts × group "
        f"{s.group_size}, {s.turns} turn(s) of {s.prompt_tokens} prompt + {s.completion_tokens} "
        f"completion tokens, system {s.system_tokens}, {s.train_passes} training pass(es)"
        + (f" over {100 * s.trained_fraction:.0f}% of trajectories" if s.trained_fraction < 1 else "")
    )
    t = Table(title_justify="left")
    t.add_column("phase", no_wrap=True)
    for name in ("tokens", "cost", "tokens, no cache", "cost, no cache"):
        t.add_column(name, justify="right")
    for ph in ("prefill", "prefill_cached", "sample", "train"):
        t.add_row(
            ph,
            f"{getattr(w.tokens, ph):,}",
            fmt_money(w.cost[ph]),
            f"{getattr(wo.tokens, ph):,}",
            fmt_money(wo.cost[ph]),
        )
    t.add_row("train_loss", f"{w.tokens.train_loss:,}", "", f"{wo.tokens.train_loss:,}", "")
    t.add_row(
        "train_sequence (sent)", f"{w.tokens.train_sequence:,}", "", f"{wo.tokens.train_sequence:,}", ""
    )
    t.add_row("total", "", fmt_money(w.cost["total"]), "", fmt_money(wo.cost["total"]), style="bold")
    console.print(t)
    hit = w.tokens.cache_hit_rate
    console.print(
        f"sampling requests: {w.requests:,} · prefix-cache hit rate: "
        f"{'-' if hit is None else f'{100 * hit:.1f}%'} · the cache saves {100 * est.cache_savings:.1f}%"
    )
    if est.dominant_phase:
        share = w.cost[est.dominant_phase] / w.cost["total"]
        console.print(f"dominant phase: [bold]{est.dominant_phase}[/bold] ({100 * share:.0f}% of the cost)")
    if wall is None:
        console.print(
            "wall clock: not measured on this machine for this model yet; add --measure "
            "(a short benchmark through an embedded server, about a minute)"
        )
        return
    from .wallclock import describe, fmt_duration

    sec = wall.seconds
    console.print(
        f"wall clock on this machine: [bold]about {fmt_duration(sec['total'])}[/bold] for "
        f"{fmt_money(w.cost['total'])} {est.currency} (prefill {fmt_duration(sec['prefill'])}, "
        f"sample {fmt_duration(sec['sample'])}, train {fmt_duration(sec['train'])}; phases added, "
        "not overlapped)"
    )
    console.print(f"  throughput {describe(wall.throughput)}")
