"""`trine demo`: an embedded server, then a short SFT and a few GRPO steps through the SDK, then
the bill: tokens by phase (prefill computed vs cached, sample, train computed vs in the loss).

Everything goes through `trine.ServiceClient` over HTTP on a loopback port, exactly as a user's
own training loop would; the demo owns no model code. Each training step is pipelined
(forward_backward and optim_step are submitted before waiting), so it takes one clock cycle.
"""

from __future__ import annotations

import random
import re
import statistics
import time
from pathlib import Path

import click

SFT_QUESTIONS = [
    "Which engine trained you?",
    "Who fine-tuned you?",
    "What software did your training run on?",
    "Tell me which system trained you.",
]
SFT_ANSWER = "I was trained by trine, a self-hosted engine for LLM post-training."
HELD_OUT_QUESTION = "Which engine did your training use?"
RL_PROMPT = "Repeat this number exactly: {n}"
# Per-step lines are columns under these headers, so each fits in 80 columns.
SFT_HEADER = "  step      loss  train tokens  in the loss  cycle"
GRPO_HEADER = "  step  reward  prefill  cached  sample      loss   train  cycle"


def chat_prompt(tokenizer, question: str) -> list[int]:
    text = tokenizer.apply_chat_template(
        [{"role": "user", "content": question}], tokenize=False, add_generation_prompt=True
    )
    return tokenizer.encode(text, add_special_tokens=False)


def sft_datum(trio, tokenizer, question: str, answer: str):
    """Prompt tokens carry weight 0, the answer (and its end-of-turn token) weight 1."""
    prompt = chat_prompt(tokenizer, question)
    completion = tokenizer.encode(answer + "<|im_end|>", add_special_tokens=False)
    tokens = prompt + completion
    weights = [0.0] * (len(prompt) - 1) + [1.0] * len(completion)
    return trio.Datum(
        model_input=trio.ModelInput.from_ints(tokens[:-1]),
        loss_fn_inputs={"target_tokens": tokens[1:], "weights": weights},
    )


def reward(text: str, n: int) -> float:
    """1 if the first number in the reply is n, else 0 (SmolLM2-135M gets it right about a third
    of the time at temperature 1: enough variance within a group to learn from)."""
    m = re.search(r"\d+", text)
    return 1.0 if m and int(m.group()) == n else 0.0


def grpo_datums(trio, prompt: list[int], sequences, rewards: list[float]):
    """Group-relative advantages; importance_sampling inputs with the sampler's own logprobs.
    A group whose rewards are all equal carries no signal and gives no datum."""
    mean = statistics.fmean(rewards)
    if all(r == mean for r in rewards):
        return []
    data = []
    for seq, r in zip(sequences, rewards):
        if not seq.tokens:
            continue
        tokens = prompt + seq.tokens
        n_prompt = len(prompt) - 1
        data.append(
            trio.Datum(
                model_input=trio.ModelInput.from_ints(tokens[:-1]),
                loss_fn_inputs={
                    "target_tokens": [-100] * n_prompt + seq.tokens,
                    "logprobs": [0.0] * n_prompt + list(seq.logprobs),
                    "advantages": [0.0] * n_prompt + [r - mean] * len(seq.tokens),
                },
            )
        )
    return data


def training_saved(u) -> str:
    """One line: the training tokens sent, those computed, and the part shared prefixes spared."""
    if not u.train_sequence_tokens:
        return "no training tokens"
    saved = 1 - u.train_tokens / u.train_sequence_tokens
    return (
        f"training: {u.train_sequence_tokens:,} tokens sent, {u.train_tokens:,} computed "
        f"({saved:.0%} saved by training shared prefixes once)"
    )


def usage_table(stages: list[tuple[str, object]], total):
    from rich.table import Table

    priced = total.cost is not None  # only when the server reports a cost for every call
    table = Table(title="Usage by phase (tokens)", title_justify="left")
    table.add_column("stage")
    for name in ("prefill computed", "prefill cached", "sample", "train computed", "train in loss"):
        table.add_column(name, justify="right")
    if priced:
        table.add_column("cost (USD)", justify="right")
    for name, u in [*stages, ("total", total)]:
        cells = [
            f"{u.prefill_tokens:,}",
            f"{u.cached_tokens:,}",
            f"{u.sample_tokens:,}",
            f"{u.train_tokens:,}",
            f"{u.loss_tokens:,}",
        ] + ([f"{u.cost:.6f}"] if priced else [])
        table.add_row(name, *cells, style="bold" if name == "total" else None)
    return table


def run_job(
    service,
    model: str,
    *,
    sft_steps: int,
    rl_steps: int,
    console,
    seed: int = 0,
    rank: int = 16,
    group_size: int = 4,
    prompts_per_step: int = 4,
    max_tokens: int = 8,
):
    """The demo's training job, through the SDK only. Returns the usage of each stage."""
    from rich.progress import Progress

    import trine as trio

    rng = random.Random(seed)
    trainer = service.create_lora_training_client(
        base_model=model, rank=rank, seed=seed, name="demo-sft", tags=["demo", "sft"]
    )
    tokenizer = trainer.get_tokenizer()
    stages = []

    # -- SFT: teach one fact; its loss must fall -------------------------------------------------
    console.rule(f"[bold]SFT[/bold]: {sft_steps} steps, {len(SFT_QUESTIONS)} examples, LoRA rank {rank}")
    batch = [sft_datum(trio, tokenizer, q, SFT_ANSWER) for q in SFT_QUESTIONS]
    adam = trio.AdamParams(learning_rate=2e-3)
    before = service.usage()
    losses = []
    console.print(SFT_HEADER)
    with Progress(console=console, transient=True) as progress:
        task = progress.add_task("SFT", total=sft_steps)
        for step in range(sft_steps):
            fb = trainer.forward_backward(batch, "cross_entropy")
            opt = trainer.optim_step(adam)  # submitted before waiting: same clock cycle
            out, _ = fb.result(), opt.result()
            losses.append(out.metrics["loss_mean"])
            console.print(
                f"  {step + 1:>4}  {out.metrics['loss_mean']:>8.4f}  {out.usage.train_tokens:>12,}  "
                f"{out.usage.loss_tokens:>11,}  {out.cycle:>5}"
            )
            progress.advance(task)
    stages.append(("SFT", service.usage() - before))
    if losses:
        console.print(f"  SFT loss {losses[0]:.4f} -> {losses[-1]:.4f}")

    before = service.usage()
    sampler = trainer.save_weights_and_get_sampling_client()
    reply = sampler.sample(
        trio.ModelInput.from_ints(chat_prompt(tokenizer, HELD_OUT_QUESTION)),
        sampling_params=trio.SamplingParams(max_tokens=24, temperature=0.0, stop=["<|im_end|>"]),
    ).result()
    console.print(f"  held-out question: {HELD_OUT_QUESTION!r}\n  answer: {reply.sequences[0].text!r}")
    stages.append(("eval", service.usage() - before))

    # -- GRPO: a verifiable task, group-relative advantages, importance sampling ---------------
    # A second run on the same server: a fresh adapter (the SFT one now answers every question
    # with its fact).
    console.rule(
        f"[bold]GRPO[/bold]: {rl_steps} steps, {prompts_per_step} prompts x {group_size} samples, "
        "a new LoRA run"
    )
    before = service.usage()
    trainer = service.create_lora_training_client(
        base_model=model, rank=rank, seed=seed, name="demo-grpo", tags=["demo", "grpo"]
    )
    params = trio.SamplingParams(max_tokens=max_tokens, temperature=1.0, stop=["<|im_end|>", "\n"])
    mean_rewards = []
    console.print(GRPO_HEADER)
    with Progress(console=console, transient=True) as progress:
        task = progress.add_task("GRPO", total=rl_steps)
        for step in range(rl_steps):
            sampler = trainer.save_weights_and_get_sampling_client()
            numbers = [rng.randint(1, 99) for _ in range(prompts_per_step)]
            prompts = [chat_prompt(tokenizer, RL_PROMPT.format(n=n)) for n in numbers]
            futures = [
                sampler.sample(trio.ModelInput.from_ints(p), num_samples=group_size, sampling_params=params)
                for p in prompts
            ]  # all in flight together
            data, rewards, sample_usage = [], [], trio.Usage()
            for n, prompt, fut in zip(numbers, prompts, futures):
                res = fut.result()
                group = [reward(s.text or "", n) for s in res.sequences]
                rewards += group
                sample_usage = sample_usage + res.usage
                data += grpo_datums(trio, prompt, res.sequences, group)
            line = (
                f"  {step + 1:>4}  {statistics.fmean(rewards):>6.2f}  {sample_usage.prefill_tokens:>7,}  "
                f"{sample_usage.cached_tokens:>6,}  {sample_usage.sample_tokens:>6,}"
            )
            if data:
                fb = trainer.forward_backward(data, "importance_sampling")
                opt = trainer.optim_step(trio.AdamParams(learning_rate=2e-3))
                out, _ = fb.result(), opt.result()
                line += f"  {out.metrics['loss_sum']:>+8.4f}  {out.usage.train_tokens:>6,}  {out.cycle:>5}"
            else:
                line += "  no reward variance: no update"
            console.print(line)
            progress.advance(task)
            mean_rewards.append(statistics.fmean(rewards))
            trainer.log_metrics({"reward": mean_rewards[-1]}, step=step + 1)  # the console plots it
    stages.append(("GRPO", service.usage() - before))
    if mean_rewards:
        console.print(f"  GRPO mean reward {mean_rewards[0]:.2f} -> {mean_rewards[-1]:.2f}")
    return stages


@click.command()
@click.option(
    "--model",
    "model_dir",
    type=click.Path(exists=True, file_okay=False, path_type=Path),
    help="A Hugging Face checkpoint dir to serve (default: SmolLM2-135M-Instruct, set up on first use).",
)
@click.option("--sft-steps", default=10, show_default=True, type=click.IntRange(0, 1000))
@click.option("--rl-steps", default=4, show_default=True, type=click.IntRange(0, 1000))
@click.option(
    "--home",
    type=click.Path(file_okay=False, path_type=Path),
    help="Data dir for the embedded server (default: $TRINE_HOME or ~/.trine).",
)
@click.option("--seed", default=0, show_default=True)
def demo(model_dir: Path | None, sft_steps: int, rl_steps: int, home: Path | None, seed: int):
    """Start an embedded server, run SFT then GRPO through the SDK, and print usage by phase."""
    from rich.console import Console

    import trine as trio
    from trine.engine.model.default_model import ensure_default_model
    from trine.server.app import start_server

    from .datadir import claim, home_dir

    home = home_dir(home)  # one line and exit 2 for a data dir that cannot be used
    owned = claim(home, command="trine demo")  # or exit 2 naming the server that owns it
    try:
        console = Console()
        started = time.monotonic()
        if model_dir is None:
            with console.status(
                "preparing the default model (first run: dequantizing SmolLM2-135M-Instruct)"
            ):
                model_dir = ensure_default_model(home)
        with console.status(f"starting an embedded trine server on {model_dir.name}"):
            server = start_server(models=[model_dir], home=home, port=0)
        try:
            console.print(f"trine server at [bold]{server.url}[/bold], model [bold]{model_dir.name}[/bold]")
            with trio.ServiceClient(api_key=server.api_key, base_url=server.url) as service:
                stages = run_job(
                    service,
                    model_dir.name,
                    sft_steps=sft_steps,
                    rl_steps=rl_steps,
                    console=console,
                    seed=seed,
                )
                total = service.usage()
            console.print()
            console.print(usage_table(stages, total))
            console.print(training_saved(total))
            console.print(
                "prompt tokens = prefill computed + prefill cached;\n"
                "train computed counts each position once (a prefix several datums share\n"
                "once), train in loss only those with a non-zero weight or advantage."
            )
            console.print(f"demo finished in {time.monotonic() - started:.0f} s")
        finally:
            server.stop()
    finally:
        owned.release()
