"""What every example shares: its command line, a connection, chat helpers and the usage report.

An example connects to the server named by `--url` (or $TRINE_BASE_URL, with $TRINE_API_KEY); with
neither, it starts an embedded trine server on the default model (SmolLM2-135M-Instruct, built once
in $TRINE_HOME/models) or on `--model DIR`, exactly as `trine demo` does. Everything else goes
through the public SDK (`import trine as trio`).
"""
from __future__ import annotations

import argparse
import contextlib
import os
import time
from dataclasses import dataclass
from pathlib import Path

import trine as trio

DEFAULT_MODEL = "SmolLM2-135M-Instruct"


def parser(description: str, steps: int) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=description)
    p.add_argument("--steps", type=int, default=steps, help=f"training steps (default {steps})")
    p.add_argument("--model", default=None,
                   help="a model directory to serve in an embedded server, or with --url the served model's "
                        f"name (default {DEFAULT_MODEL})")
    p.add_argument("--url", default=os.environ.get("TRINE_BASE_URL"),
                   help="a running trine server (default $TRINE_BASE_URL; none: start an embedded one)")
    p.add_argument("--api-key", default=os.environ.get("TRINE_API_KEY"), help="default $TRINE_API_KEY")
    p.add_argument("--home", type=Path, default=None, help="data dir of the embedded server (default $TRINE_HOME)")
    p.add_argument("--seed", type=int, default=0)
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
    if args.url:
        with trio.ServiceClient(api_key=args.api_key, base_url=args.url) as service:
            yield Connection(service, args.model or DEFAULT_MODEL, args.url, args.api_key)
        return
    from trine.engine.default_model import ensure_default_model
    from trine.server.app import start_server

    model_dir = Path(args.model) if args.model else ensure_default_model(args.home)
    server = start_server(models=[model_dir], home=args.home, port=0)
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
    return trio.Datum(model_input=trio.ModelInput.from_ints(tokens[:-1]),
                      loss_fn_inputs={"target_tokens": tokens[1:], "weights": weights})


def policy_datum(prompt: list[int], tokens: list[int], logprobs: list[float], advantages: list[float]) -> trio.Datum:
    """An importance_sampling datum: the sampled tokens with the sampler's logprobs and per-token
    advantages; prompt positions are not trained (target -100, advantage 0)."""
    n = len(prompt) - 1
    return trio.Datum(model_input=trio.ModelInput.from_ints((prompt + tokens)[:-1]),
                      loss_fn_inputs={"target_tokens": [-100] * n + list(tokens),
                                      "logprobs": [0.0] * n + list(logprobs),
                                      "advantages": [0.0] * n + list(advantages)})


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

        from trine.cli.demo import usage_table

        console = Console()
        console.print(usage_table(self.stages, self.service.usage()))
        console.print(f"finished in {time.monotonic() - self.started:.0f} s")
