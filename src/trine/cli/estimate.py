"""`trine estimate`: predicted tokens and cost by phase of a job, with and without the prefix cache."""
from __future__ import annotations

from pathlib import Path

import click

from ..metering.estimate import JobShape, estimate as run_estimate, render
from ..metering.rates import RateCard
from .output import print_json


@click.command()
@click.option("--model", default="SmolLM2-135M-Instruct", show_default=True, help="Base model (priced by the rate card).")
@click.option("--steps", type=int, default=1, show_default=True, help="Training steps (sampling rounds).")
@click.option("--prompts-per-step", type=int, default=1, show_default=True, help="Groups (distinct prompts) per step.")
@click.option("--group-size", type=int, default=1, show_default=True, help="Samples per prompt (num_samples).")
@click.option("--turns", type=int, default=1, show_default=True, help="Sampling turns per trajectory.")
@click.option("--prompt-tokens", type=int, default=128, show_default=True,
              help="First prompt after the system prompt; new tokens (user, tool output) each later turn.")
@click.option("--completion-tokens", type=int, default=128, show_default=True, help="Generated tokens per turn.")
@click.option("--system-tokens", type=int, default=0, show_default=True,
              help="Fixed prefix every prompt starts with (system prompt, tool definitions).")
@click.option("--train-passes", type=int, default=1, show_default=True,
              help="forward_backward passes over each trajectory per step (0: sampling only).")
@click.option("--trained-fraction", type=float, default=1.0, show_default=True,
              help="Share of trajectories trained on (GRPO skips groups whose rewards are all equal).")
@click.option("--block-size", type=int, default=16, show_default=True, help="The server's KV cache block size.")
@click.option("--rates", type=click.Path(dir_okay=False, path_type=Path), help="Rate card TOML to price with.")
@click.option("--home", type=click.Path(file_okay=False, path_type=Path),
              help="Data dir whose rates.toml applies (default $TRINE_HOME).")
@click.option("--json", "as_json", is_flag=True, help="Print the estimate as JSON.")
def estimate(model, steps, prompts_per_step, group_size, turns, prompt_tokens, completion_tokens, system_tokens,
             train_passes, trained_fraction, block_size, rates, home, as_json):
    """Predict a job's prefill, cached prefill, sample and train tokens and their cost, and which phase dominates."""
    try:
        shape = JobShape(model=model, steps=steps, prompts_per_step=prompts_per_step, group_size=group_size,
                         turns=turns, prompt_tokens=prompt_tokens, completion_tokens=completion_tokens,
                         system_tokens=system_tokens, train_passes=train_passes,
                         trained_fraction=trained_fraction, block_size=block_size)
        est = run_estimate(shape, RateCard.load(rates, home=home))
    except ValueError as e:
        raise click.ClickException(str(e)) from None
    if as_json:
        print_json(est.to_dict())
    else:
        render(est)
