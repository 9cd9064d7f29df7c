"""Memory benchmark: what training runs hold, and whether closing their session gives it back.

SmolLM2-135M-Instruct by default (`--model DIR` for any checkpoint directory), fp32 on CPU, an
embedded server in this process (so the process's resident memory is the server's).

Each round opens a session through the trine SDK, creates `--runs` LoRA training runs of rank
`--rank` (attention, MLP and unembedding; the SDK allows ranks 4-64, as PyTRIO does), gives each one
forward_backward + optim_step (so its
adapter, gradients and both Adam moments exist), then closes the session. Resident memory (RSS,
from /proc/self/statm) is read before the round, with the runs live, and `--settle` seconds after
the close.

Reported (`--json`), per round and in all:
- held_mib: RSS with the runs live minus RSS before the round (what the runs hold);
- returned_fraction: (RSS with the runs live - RSS after the close) / held_mib;
- growth_after_rounds_mib: RSS after the last close minus RSS before the first round (what stays
  behind; the first round also pays one-time costs such as the trainer's workspace).

    .venv/bin/python benchmarks/memory.py [--json] [--runs 8] [--rank 64] [--rounds 3]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

from report import record  # benchmarks/report.py

from trine.engine.setup import configure

configure()  # before torch loads with the engine: its OpenMP wait, as under `trine serve`

# isort: split

import trine as trio  # noqa: E402
from trine.server.app import start_server  # noqa: E402

PAGE = os.sysconf("SC_PAGE_SIZE")


def rss_mib() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * PAGE / 2**20


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def one_round(url: str, key: str, model: str, args) -> dict:
    before = rss_mib()
    tokens = list(range(100, 100 + args.tokens))
    datum = trio.Datum(
        model_input=trio.ModelInput.from_ints(tokens[:-1]),
        loss_fn_inputs={"target_tokens": tokens[1:], "weights": [1.0] * (len(tokens) - 1)},
    )
    with trio.ServiceClient(api_key=key, base_url=url) as service:
        runs = [service.create_lora_training_client(model, rank=args.rank, seed=i) for i in range(args.runs)]
        for tc in runs:
            tc.forward_backward([datum], "cross_entropy").result()
            tc.optim_step(trio.AdamParams(learning_rate=1e-4)).result()
        live = rss_mib()
    time.sleep(args.settle)  # the close is sent as the client exits; the server ends the runs
    after = rss_mib()
    held = live - before
    return {
        "before_mib": before,
        "live_mib": live,
        "after_mib": after,
        "held_mib": held,
        "returned_fraction": (live - after) / held if held > 0 else float("nan"),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", type=Path, default=None)
    ap.add_argument("--runs", type=int, default=8)
    ap.add_argument("--rank", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--settle", type=float, default=3.0)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    if args.model is None:
        from trine.engine.model.default_model import ensure_default_model

        args.model = ensure_default_model()
    with tempfile.TemporaryDirectory() as home:
        server = start_server(models=[args.model], home=Path(home), port=0)
        try:
            warm = one_round(
                server.url,
                server.api_key,
                args.model.name,
                argparse.Namespace(**{**vars(args), "runs": 1, "rank": 8}),
            )
            log(f"warm-up round (1 run of rank 8): held {warm['held_mib']:.0f} MiB")
            start = rss_mib()
            rounds = []
            for i in range(args.rounds):
                r = one_round(server.url, server.api_key, args.model.name, args)
                rounds.append(r)
                log(
                    f"round {i + 1}: {args.runs} runs of rank {args.rank} held {r['held_mib']:.0f} MiB, "
                    f"{100 * r['returned_fraction']:.0f}% returned after the close"
                )
            end = rss_mib()
        finally:
            server.stop()
    out = {
        "runs": args.runs,
        "rank": args.rank,
        "rounds": rounds,
        "held_mib_per_run": sorted(r["held_mib"] for r in rounds)[len(rounds) // 2] / args.runs,
        "returned_fraction_min": min(r["returned_fraction"] for r in rounds),
        "growth_after_rounds_mib": end - start,
    }
    record(out)  # benchmarks/results/memory.jsonl
    if args.json:
        print(json.dumps(out))
    else:
        print(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
