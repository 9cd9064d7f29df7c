"""The shortest shared prefix worth sharing in training: prefix_groups.MIN_SHARED_TOKENS.

    python benchmarks/prefix_threshold.py [--model DIR] [--datums 4] [--suffix 48]
        [--prefixes 2,4,8,16,32] [--iters 5] [--threads N] [--json]

For each prefix length P, `--datums` datums share P tokens and then differ for `--suffix` tokens
(a GRPO group with a short prompt). A shared step computes the prefix once but needs a second
pass of the body (the suffixes attend to the prefix's keys through the K/V pool, shared_prefix.py);
a plain step computes every datum whole. Both forward_backward an importance_sampling loss on
the same data, interleaved (each pair back to back, alternating which goes first); the figure for
P is the median of the per-iteration ratios plain / shared. `min_worth_sharing` is the smallest
P from which every measured ratio is >= 1.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

from trine.engine.setup import configure

configure()  # before torch loads: the engine's OpenMP wait and allocator, as under `trine serve`

# isort: split

import torch


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", help="checkpoint dir (default: the embedded SmolLM2-135M-Instruct)")
    ap.add_argument("--datums", type=int, default=4)
    ap.add_argument("--suffix", type=int, default=48)
    ap.add_argument("--prefixes", default="2,4,8,16,32")
    ap.add_argument("--iters", type=int, default=5)
    ap.add_argument("--threads", type=int, default=torch.get_num_threads())
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    from trine.engine.api import Forward, LoRAConfig, Loss, TrainDatum
    from trine.engine.config import TrainerConfig
    from trine.engine.model.weights import load_model
    from trine.engine.trainer.trainer import Trainer

    if args.model is None:
        from trine.engine.model.default_model import ensure_default_model

        args.model = str(ensure_default_model())
    model = load_model(args.model, "cpu")
    trainers = {}
    for sharing in (True, False):
        trainers[sharing] = Trainer(
            model, base_model="bench", config=TrainerConfig(prefix_sharing=sharing, min_shared_tokens=1)
        )
        trainers[sharing].create_run("r", LoRAConfig(rank=16, alpha=32.0, train_unembed=False))
    g = torch.Generator().manual_seed(0)
    loss = Loss.parse("importance_sampling")
    ratios: dict[int, float] = {}
    for p in (int(x) for x in args.prefixes.split(",")):
        prefix = torch.randint(0, model.cfg.vocab_size, (p,), generator=g).tolist()
        data = []
        for _ in range(args.datums):
            tokens = prefix + torch.randint(0, model.cfg.vocab_size, (args.suffix,), generator=g).tolist()
            n = len(tokens)
            data.append(
                TrainDatum(
                    tokens=tokens,
                    target_tokens=tokens[1:] + [-100],
                    logprobs=[-10.0] * n,
                    advantages=[0.0] * p + [1.0] * (n - p),
                )
            )
        batch = [("r", Forward(data, loss))]
        usage = trainers[True].forward_backward(batch)[0].usage  # warm-up, and a check that it shares
        assert usage.train_tokens == p + args.datums * args.suffix, usage
        trainers[False].forward_backward(batch)
        times = {True: [], False: []}
        for it in range(args.iters):
            for sharing in (True, False) if it % 2 else (False, True):
                t = time.perf_counter()
                trainers[sharing].forward_backward(batch)
                times[sharing].append(time.perf_counter() - t)
        ratios[p] = statistics.median(u / s for u, s in zip(times[False], times[True]))
        if not args.json:
            print(
                f"prefix {p:4d}: plain / shared {ratios[p]:.3f}  "
                f"(shared {statistics.median(times[True]):.3f}s)",
                flush=True,
            )
    worth = [p for p in ratios if all(ratios[q] >= 1 for q in ratios if q >= p)]
    result = {
        "ratios": ratios,
        "min_worth_sharing": min(worth) if worth else None,
        "datums": args.datums,
        "suffix": args.suffix,
        "iters": args.iters,
        "threads": args.threads,
        "model": args.model,
    }
    print(json.dumps(result) if args.json else f"min_worth_sharing {result['min_worth_sharing']}")


if __name__ == "__main__":
    main()
