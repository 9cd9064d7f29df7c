"""The GRPO example in bf16 beside fp32: does a bf16 engine learn what an fp32 one does?

examples/grpo_arithmetic.py (SmolLM2-135M-Instruct, or `--model DIR`) runs `--steps` steps in an
embedded server of each dtype, for each of the seeds `--seeds` (the same seeds in both dtypes),
`--prompts` addition problems a step, 8 samples each, Adam at `--lr`. Keys:
- grpo_reward_{fp32,bf16}: the mean reward over the last `--last` steps, averaged over the seeds;
  `grpo_reward_{fp32,bf16}_per_seed` each seed's.
- grpo_reward_bf16_minus_fp32: the difference of the two, and grpo_reward_seed_spread: the largest
  difference between two seeds' final rewards within one dtype (what the seed alone moves it by).
- grpo_reward_first_{fp32,bf16}: the mean reward over the first `--last` steps (where both start).
- grpo_curve_{fp32,bf16}: each step's reward, averaged over the seeds.
Sampling draws differ between the dtypes from the first step (their logits differ), so the two
curves are two runs of one recipe, not one run twice: "the same reward" means a difference within
what another seed gives.

    .venv/bin/python benchmarks/grpo_dtype.py [--json] [--steps 100] [--prompts 8] [--lr 3e-4] \\
        [--last 20] [--seeds 0,1]
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import sys
from pathlib import Path

from trine.engine.setup import configure

configure()  # before torch loads: the engine's OpenMP wait, as under `trine serve`

# isort: split
from report import emit  # noqa: E402  (benchmarks/report.py)

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))
import grpo_arithmetic  # noqa: E402  (examples/grpo_arithmetic.py)

DTYPES = (("fp32", "float32"), ("bf16", "bfloat16"))


def log(msg: str) -> None:
    print(f"[grpo_dtype] {msg}", file=sys.stderr, flush=True)


def run(model_dir: Path, args) -> dict:
    seeds = [int(x) for x in args.seeds.split(",")]
    last = min(args.last, args.steps)
    out: dict = dict(model=str(model_dir), steps=args.steps, prompts=args.prompts, lr=args.lr, last=last)
    out["seeds"] = seeds
    spread = 0.0
    for name, dtype in DTYPES:
        curves = []
        for seed in seeds:
            log(f"{dtype}, seed {seed}: {args.steps} steps")
            argv = ["--steps", str(args.steps), "--dtype", dtype, "--model", str(model_dir)]
            argv += ["--seed", str(seed), "--prompts", str(args.prompts), "--lr", str(args.lr)]
            with contextlib.redirect_stdout(sys.stderr):  # its progress: stdout is the figures
                curves.append(grpo_arithmetic.main(argv)["reward_curve"])
        finals = [statistics.fmean(c[-last:]) for c in curves]
        spread = max(spread, max(finals) - min(finals))
        out[f"grpo_reward_{name}"] = statistics.fmean(finals)
        out[f"grpo_reward_{name}_per_seed"] = [round(f, 4) for f in finals]
        out[f"grpo_reward_first_{name}"] = statistics.fmean(statistics.fmean(c[:last]) for c in curves)
        out[f"grpo_curve_{name}"] = [round(statistics.fmean(r), 4) for r in zip(*curves)]
    out["grpo_reward_bf16_minus_fp32"] = out["grpo_reward_bf16"] - out["grpo_reward_fp32"]
    out["grpo_reward_seed_spread"] = spread
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", type=Path, help="model directory (default: SmolLM2-135M-Instruct)")
    ap.add_argument("--steps", type=int, default=100)
    ap.add_argument("--prompts", type=int, default=8, help="addition problems a step (8 samples each)")
    ap.add_argument("--lr", type=float, default=3e-4, help="Adam's learning rate")
    ap.add_argument("--last", type=int, default=20, help="steps the final reward averages")
    ap.add_argument("--seeds", default="0,1", help="comma-separated seeds, each run in both dtypes")
    ap.add_argument("--json", action="store_true", help="print one JSON object on stdout")
    args = ap.parse_args()
    model_dir = args.model
    if model_dir is None:
        from trine.engine.model.default_model import ensure_default_model

        model_dir = ensure_default_model()
    emit(run(model_dir, args), args.json)


if __name__ == "__main__":
    main()
