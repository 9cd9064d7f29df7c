"""Dimuon against AdamW on the SFT example's data: training and held-out loss after the same steps.

    python benchmarks/dimuon_vs_adamw.py [--model DIR] [--steps 16] [--batch 16] [--rank 16]
        [--adam-lrs 1e-3,3e-3] [--dimuon-lrs 0.01,0.03] [--threads 2] [--json]

The data and its rendering are examples/sft_chat.py's: `examples/data/chat_sft.jsonl` rendered with
the model's chat template, only the assistant's reply (and its end-of-turn token) in the loss, the
last 40 conversations held out. Every configuration trains a fresh LoRA adapter (same rank and seed)
on the same sequence of batches with trine's Trainer (the engine the server runs), one
forward_backward + optim_step per step, and reports:
- held_out_<opt>_<lr>: loss per reply token on the held-out set after the last step (before: the
  same for every configuration, `held_out_before`);
- train_<opt>_<lr>: the mean training loss per reply token of the last 4 steps;
- curve_<opt>_<lr>: the training loss per step (a list);
- best_adamw / best_dimuon: the lowest held-out loss of each optimizer over its learning rates, and
  dimuon_over_adamw = best_dimuon / best_adamw (< 1: Dimuon ends lower).
A convergence comparison on one small data set and model, not a tuned study: each optimizer gets a
small learning-rate sweep, and one seed.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time
from pathlib import Path

from trine.engine.setup import configure

configure()  # before torch loads: the engine's OpenMP wait and allocator, as under `trine serve`

# isort: split

import torch
from report import emit  # benchmarks/report.py

REPO = Path(__file__).resolve().parents[1]
DATA = REPO / "examples" / "data" / "chat_sft.jsonl"
HELD_OUT = 40


def render(tokenizer, conversation: dict):
    """(tokens, target_tokens, weights) of one conversation, as sft_chat.py renders it."""
    from trine.engine.api import TrainDatum

    messages = conversation["messages"]
    text = tokenizer.apply_chat_template(messages[:-1], tokenize=False, add_generation_prompt=True)
    prompt = tokenizer.encode(text, add_special_tokens=False)
    eot = tokenizer.convert_tokens_to_ids("<|im_end|>")
    if not isinstance(eot, int) or eot == tokenizer.unk_token_id:
        eot = tokenizer.eos_token_id
    reply = tokenizer.encode(messages[-1]["content"], add_special_tokens=False) + [eot]
    tokens = prompt + reply
    weights = [0.0] * (len(prompt) - 1) + [1.0] * len(reply)
    return TrainDatum(tokens=tokens[:-1], target_tokens=tokens[1:], weights=weights)


def per_token(results) -> float:
    r = results[0]
    return r.loss_sum / r.token_count


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", help="checkpoint dir (default: the embedded SmolLM2-135M-Instruct)")
    ap.add_argument("--steps", type=int, default=16)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--adam-lrs", default="1e-3,3e-3")
    ap.add_argument("--dimuon-lrs", default="0.01,0.03")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)

    from transformers import AutoTokenizer

    from trine.engine.api import AdamConfig, DimuonConfig, Forward, LoRAConfig, Loss
    from trine.engine.model.weights import load_model
    from trine.engine.trainer.trainer import Trainer

    if args.model is None:
        from trine.engine.model.default_model import ensure_default_model

        args.model = str(ensure_default_model())
    tokenizer = AutoTokenizer.from_pretrained(args.model)
    rows = [json.loads(line) for line in DATA.read_text().splitlines() if line.strip()]
    train = [render(tokenizer, r) for r in rows[:-HELD_OUT]]
    held = [render(tokenizer, r) for r in rows[-HELD_OUT:]]
    rng = random.Random(args.seed)
    batches = [rng.sample(train, min(args.batch, len(train))) for _ in range(args.steps)]
    ce = Loss.parse("cross_entropy")
    trainer = Trainer(load_model(args.model, "cpu"), base_model="bench")

    configs = [("adamw", float(lr)) for lr in args.adam_lrs.split(",")]
    configs += [("dimuon", float(lr)) for lr in args.dimuon_lrs.split(",")]
    out: dict = {"steps": args.steps, "batch": args.batch, "rank": args.rank}
    step_times = []
    for family, lr in configs:
        run = f"{family}-{lr:g}"
        trainer.create_run(run, LoRAConfig(rank=args.rank, seed=args.seed), optimizer=family)
        if "held_out_before" not in out:
            out["held_out_before"] = per_token(
                trainer.forward_backward([(run, Forward(held, ce))], backward=False)
            )
        settings = AdamConfig(learning_rate=lr) if family == "adamw" else DimuonConfig(learning_rate=lr)
        curve = []
        for batch in batches:
            t0 = time.perf_counter()
            curve.append(per_token(trainer.forward_backward([(run, Forward(batch, ce))])))
            trainer.optim_step(run, settings)
            step_times.append(time.perf_counter() - t0)
        name = f"{family}_{lr:g}"
        out[f"held_out_{name}"] = per_token(
            trainer.forward_backward([(run, Forward(held, ce))], backward=False)
        )
        out[f"train_{name}"] = statistics.fmean(curve[-4:])
        out[f"curve_{name}"] = [round(x, 4) for x in curve]
        print(
            f"{name:16s} held-out {out['held_out_before']:.4f} -> {out[f'held_out_{name}']:.4f}",
            file=sys.stderr,
        )
        trainer.delete_run(run)
    for family in ("adamw", "dimuon"):
        out[f"best_{family}"] = min(v for k, v in out.items() if k.startswith(f"held_out_{family}_"))
    out["dimuon_over_adamw"] = out["best_dimuon"] / out["best_adamw"]
    out["step_s_median"] = statistics.median(step_times)
    emit(out, args.json)
    return out


if __name__ == "__main__":
    main()
