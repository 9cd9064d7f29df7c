"""`trine estimate`: predicted tokens, cost and wall-clock time by phase of a job, with and without
the prefix cache."""

from __future__ import annotations

from pathlib import Path

import click

from ..home import trine_home
from ..metering import wallclock
from ..metering.estimate import JobShape, render
from ..metering.estimate import estimate as run_estimate
from ..metering.rates import RateCard
from .output import print_json


@click.command()
@click.option(
    "--model",
    default="SmolLM2-135M-Instruct",
    show_default=True,
    help="Base model, as the rate card names it (an unknown name is an error).",
)
@click.option("--steps", type=int, default=1, show_default=True, help="Training steps (sampling rounds).")
@click.option(
    "--prompts-per-step", type=int, default=1, show_default=True, help="Groups (distinct prompts) per step."
)
@click.option(
    "--group-size", type=int, default=1, show_default=True, help="Samples per prompt (num_samples)."
)
@click.option("--turns", type=int, default=1, show_default=True, help="Sampling turns per trajectory.")
@click.option(
    "--prompt-tokens",
    type=int,
    default=128,
    show_default=True,
    help="First prompt after the system prompt; new tokens (user, tool output) each later turn.",
)
@click.option(
    "--completion-tokens", type=int, default=128, show_default=True, help="Generated tokens per turn."
)
@click.option(
    "--system-tokens",
    type=int,
    default=0,
    show_default=True,
    help="Fixed prefix every prompt starts with (system prompt, tool definitions).",
)
@click.option(
    "--train-passes",
    type=int,
    default=1,
    show_default=True,
    help="forward_backward passes over each trajectory per step (0: sampling only).",
)
@click.option(
    "--trained-fraction",
    type=float,
    default=1.0,
    show_default=True,
    help="Share of trajectories trained on (GRPO skips groups whose rewards are all equal).",
)
@click.option(
    "--rates", type=click.Path(dir_okay=False, path_type=Path), help="Rate card TOML to price with."
)
@click.option(
    "--home",
    type=click.Path(file_okay=False, path_type=Path),
    help="Data dir whose rates.toml and measured throughput apply (default $TRINE_HOME).",
)
@click.option(
    "--measure",
    is_flag=True,
    help="Measure this machine's throughput for the model first (an embedded server, about a minute) "
    "and keep it in $TRINE_HOME/throughput.json for later estimates.",
)
@click.option(
    "--model-dir",
    type=click.Path(exists=True, file_okay=False, path_type=Path),
    help="With --measure: the model's directory (default $TRINE_HOME/models/MODEL; the default "
    "model is built there if missing).",
)
@click.option(
    "--threads",
    type=int,
    default=None,
    help="With --measure: CPU threads (default: torch's, as `trine serve`).",
)
@click.option("--json", "as_json", is_flag=True, help="Print the estimate as JSON.")
def estimate(
    model,
    steps,
    prompts_per_step,
    group_size,
    turns,
    prompt_tokens,
    completion_tokens,
    system_tokens,
    train_passes,
    trained_fraction,
    rates,
    home,
    measure,
    model_dir,
    threads,
    as_json,
):
    """Predict a job's prefill, cached prefill, sample and train tokens, their cost, which phase
    dominates, and how long it takes on this machine (from throughput measured here with --measure)."""
    home = Path(home) if home else trine_home()
    try:
        card = RateCard.load(rates, home=home)
        card.require(model)
        shape = JobShape(
            model=model,
            steps=steps,
            prompts_per_step=prompts_per_step,
            group_size=group_size,
            turns=turns,
            prompt_tokens=prompt_tokens,
            completion_tokens=completion_tokens,
            system_tokens=system_tokens,
            train_passes=train_passes,
            trained_fraction=trained_fraction,
        )
        est = run_estimate(shape, card)
    except ValueError as e:
        raise click.ClickException(str(e)) from None
    batch = prompts_per_step * group_size
    if measure:
        from .measure import measure as measure_throughput

        click.echo(f"measuring {model} on this machine (decode batch {batch})...", err=True)
        tp = measure_throughput(
            _model_dir(model, model_dir, home),
            model,
            batch,
            system_tokens + prompt_tokens,
            shape.trajectory_tokens,
            threads,
        )
        click.echo(f"kept in {wallclock.save(home, tp)}", err=True)
    tp = wallclock.load(home, model, batch)
    wall = wallclock.predict(shape, est.with_cache.tokens, tp) if tp else None
    if as_json:
        print_json({**est.to_dict(), "wall_clock": wall.to_dict() if wall else None})
    else:
        render(est, wall=wall)


def _model_dir(model: str, given: Path | None, home: Path) -> Path:
    if given is not None:
        return given
    from ..engine.model.default_model import REAL_MODELS, ensure_model

    if model in REAL_MODELS:
        return ensure_model(model, home)
    candidate = home / "models" / model
    if not (candidate / "config.json").is_file():
        raise click.ClickException(
            f"no model directory for {model} in {home / 'models'}: pass --model-dir DIR"
        )
    return candidate
