"""What every example shares: its command line, a connection, chat helpers and the usage report.

An example connects to the server named by `--url` (or $TRINE_BASE_URL, with $TRINE_API_KEY); with
neither, it starts an embedded trine server on the default model (SmolLM2-135M-Instruct, built once
in $TRINE_HOME/models) or on `--model DIR`, exactly as `trine demo` does. Everything else goes
through the public SDK (`import trine as trio`).
"""

from __future__ import annotations

import argparse
import atexit
import contextlib
import os
import time
from dataclasses import dataclass
from pathlib import Path

import trine as trio

DEFAULT_MODEL = "SmolLM2-135M-Instruct"


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Each option's help is a sentence; its default follows it, except for options without one."""

    def _get_help_string(self, action):
        if action.default is None or action.default is argparse.SUPPRESS:
            return action.help
        return super()._get_help_string(action)


def parser(doc: str, steps: int | None) -> argparse.ArgumentParser:
    """The options every example has (`--steps` unless `steps` is None); examples add their own. The
    description is the first paragraph of the example's docstring `doc`."""
    description = " ".join(doc.strip().split("\n\n")[0].split())
    p = argparse.ArgumentParser(description=description, formatter_class=HelpFormatter)
    if steps is not None:
        p.add_argument("--steps", type=int, default=steps, help="Training steps to run.")
    p.add_argument(
        "--model",
        default=None,
        help="A model directory to serve in an embedded server, or with --url the name of a model "
        f"the server serves. Default: {DEFAULT_MODEL}.",
    )
    p.add_argument(
        "--url",
        default=None,
        help="A running trine server to use. Default: $TRINE_BASE_URL; with neither, the example "
        "starts an embedded server.",
    )
    p.add_argument("--api-key", default=None, help="The API key for --url. Default: $TRINE_API_KEY.")
    p.add_argument(
        "--home",
        type=Path,
        default=None,
        help="The embedded server's data dir. Default: $TRINE_HOME, else ~/.trine.",
    )
    p.add_argument("--seed", type=int, default=0, help="Seed of the example's data, sampling and LoRA init.")
    p.add_argument(
        "--dtype",
        choices=("auto", "float32", "bfloat16"),
        default="auto",
        help="The embedded server's model dtype (as `trine serve --dtype`); ignored with --url.",
    )
    return p


@dataclass
class Connection:
    service: trio.ServiceClient
    model: str  # the base model's name on the server
    url: str
    api_key: str

    def server_usage(self, run_id: str) -> dict:
        """The server's usage report for one run (tokens by phase, cost, prefix-cache diagnostics)."""
        from trine.metering.remote import get_json

        return get_json(self.url, self.api_key, "/api/trine/v1/usage", {"run_id": run_id})


@contextlib.contextmanager
def connect(args):
    """Yield a Connection; an embedded server lives as long as the block."""
    url = args.url or os.environ.get("TRINE_BASE_URL")
    if url:
        api_key = args.api_key or os.environ.get("TRINE_API_KEY")
        with trio.ServiceClient(api_key=api_key, base_url=url) as service:
            yield Connection(service, args.model or DEFAULT_MODEL, url, api_key)
        return
    from trine.engine.setup import configure

    configure()  # before the server loads torch: the engine's OpenMP wait, as under `trine serve`
    from trine.engine.config import EngineConfig
    from trine.engine.model.default_model import ensure_default_model
    from trine.server.app import start_server

    model_dir = Path(args.model) if args.model else ensure_default_model(args.home)
    server = start_server(models=[model_dir], home=args.home, port=0, engine=EngineConfig(dtype=args.dtype))
    try:
        with trio.ServiceClient(api_key=server.api_key, base_url=server.url) as service:
            yield Connection(service, model_dir.name, server.url, server.api_key)
    finally:
        server.stop()


def chat_tokens(tokenizer, messages: list[dict], generation_prompt: bool = False) -> list[int]:
    """The chat template rendered and tokenized (the template already opens with its own tokens)."""
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=generation_prompt)
    return tokenizer.encode(text, add_special_tokens=False)


def end_of_turn(tokenizer) -> int:
    """The token that closes an assistant turn (SmolLM2, Qwen: <|im_end|>; else EOS)."""
    tid = tokenizer.convert_tokens_to_ids("<|im_end|>")
    return tid if isinstance(tid, int) and tid != tokenizer.unk_token_id else tokenizer.eos_token_id


def sft_datum(prompt: list[int], completion: list[int]) -> trio.Datum:
    """Next-token prediction on the completion only: prompt positions carry weight 0."""
    tokens = prompt + completion
    weights = [0.0] * (len(prompt) - 1) + [1.0] * len(completion)
    return trio.Datum(
        model_input=trio.ModelInput.from_ints(tokens[:-1]),
        loss_fn_inputs={"target_tokens": tokens[1:], "weights": weights},
    )


def policy_datum(
    prompt: list[int], tokens: list[int], logprobs: list[float], advantages: list[float]
) -> trio.Datum:
    """An importance_sampling datum: the sampled tokens with the sampler's logprobs and per-token
    advantages; prompt positions are not trained (target -100, advantage 0)."""
    n = len(prompt) - 1
    return trio.Datum(
        model_input=trio.ModelInput.from_ints((prompt + tokens)[:-1]),
        loss_fn_inputs={
            "target_tokens": [-100] * n + list(tokens),
            "logprobs": [0.0] * n + list(logprobs),
            "advantages": [0.0] * n + list(advantages),
        },
    )


class StepTimer:
    """Seconds per step, tokens per second and an ETA for a loop of `total` steps, appended to each
    step's line; in a terminal, also a progress bar below the lines. Tokens are everything the
    server computed for this client meanwhile (prefill, sampled and training tokens).

        timer = StepTimer(service, args.steps)
        for step in range(args.steps):
            ...
            timer.done(f"step {step + 1}  loss {loss:.3f}")   # prints the line with the timing
    """

    def __init__(self, service, total: int, unit: str = "step"):
        from rich.console import Console

        self.service, self.total, self.unit = service, total, unit
        self.console = Console(highlight=False)
        self.count, self.seconds = 0, 0.0
        self._last_time, self._last_usage = time.monotonic(), service.usage()
        self._bar = None
        if self.console.is_terminal and total > 1:
            from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

            self._bar = Progress(
                TextColumn(f"{unit}s"),
                BarColumn(),
                MofNCompleteColumn(),
                TextColumn("ETA"),
                TimeRemainingColumn(),
                console=self.console,
                transient=True,
            )
            self._task = self._bar.add_task("", total=total)
            self._bar.start()
            atexit.register(self.close)

    def done(self, line: str = "") -> dict:
        """One step finished: print `line` with its timing (and move the bar); returns the timing."""
        now, usage = time.monotonic(), self.service.usage()
        dt, used = now - self._last_time, usage - self._last_usage
        self._last_time, self._last_usage = now, usage
        self.count += 1
        self.seconds += dt
        tokens = used.prefill_tokens + used.sample_tokens + used.train_tokens
        eta = (self.total - self.count) * self.seconds / self.count
        timing = {"seconds": dt, "tokens_per_s": tokens / dt if dt > 0 else 0.0, "eta_s": eta}
        self.console.print(
            f"{line}  [{dt:.1f} s/{self.unit}, {timing['tokens_per_s']:,.0f} tok/s, "
            f"ETA {duration(eta)}]".lstrip(),
            soft_wrap=True,
        )  # one line, as print() writes
        if self._bar is not None:
            self._bar.advance(self._task)
            if self.count >= self.total:
                self.close()
        return timing

    def close(self) -> None:
        if self._bar is not None:
            self._bar.stop()
            self._bar = None


def duration(seconds: float) -> str:
    """`12 s`, `3 min 05 s`, `1 h 02 min`."""
    s = int(round(seconds))
    if s < 60:
        return f"{s} s"
    if s < 3600:
        return f"{s // 60} min {s % 60:02d} s"
    return f"{s // 3600} h {s % 3600 // 60:02d} min"


class Phases:
    """Usage by phase of each stage of an example: `with phases("train"): ...`, then `report()`."""

    def __init__(self, service):
        self.service = service
        self.stages: list[tuple[str, trio.Usage]] = []
        self.started = time.monotonic()

    @contextlib.contextmanager
    def __call__(self, name: str):
        before = self.service.usage()
        try:
            yield
        finally:
            used = self.service.usage() - before
            for i, (stage, u) in enumerate(self.stages):  # a stage entered again adds up
                if stage == name:
                    self.stages[i] = (stage, u + used)
                    break
            else:
                self.stages.append((name, used))

    def report(self) -> None:
        from rich.console import Console

        from trine.cli.demo import training_saved, usage_table

        console = Console()
        console.print(usage_table(self.stages, self.service.usage()))
        console.print(training_saved(self.service.usage()))
        console.print(f"finished in {time.monotonic() - self.started:.0f} s")
