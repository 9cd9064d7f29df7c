"""bf16 beside fp32 on this CPU, in one run: is bf16 worth it here, and what does it cost in numerics?

SmolLM2-135M-Instruct (`--model DIR` for another), `--threads` torch threads. Each pair runs
interleaved (alternating which goes first), `--repeats` times; a ratio is the median of the pairs'.
- bf16_sampler_grpo_speedup, bf16_sampler_decode_speedup: fp32 seconds / bf16 seconds of trine's
  Sampler on a GRPO group (4 prompts x 8 samples, 512-token prompts, 32 new tokens) and a
  decode-heavy batch (8 x 8, 64-token prompts, 128 new), the workloads of benchmarks/vs_vllm.py.
- bf16_trainer_speedup: fp32 / bf16 seconds of one LoRA step (forward_backward + optim_step, rank
  16, a batch of 8 x 256 tokens).
- sampler_vs_trainer_{fp32,bf16}_max_abs / _mean_abs (nats): the logprobs the Sampler reported for
  its sampled tokens against the Trainer's forward of the same tokens (one adapter, 3 prompts x 2
  samples x 32 tokens); `_batch_invariant` the same with `--batch-invariant` kernels (0: the
  contract of docs/numerics.md).
- bf16_vs_fp32_logprob_max_abs / _mean_abs: the Trainer's logprobs of those tokens, bf16 vs fp32.
- dtype_auto_speedup / dtype_auto: what `--dtype auto` measures and picks here (dtype_choice.py).
(The GRPO example's reward in each dtype: benchmarks/grpo_dtype.py.)

    .venv/bin/python benchmarks/bf16.py [--json] [--quick] [--repeats 3]
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import time
from pathlib import Path

from trine.engine.setup import configure

configure()  # before torch loads: the engine's OpenMP wait, as under `trine serve`

# isort: split
import torch  # noqa: E402
from report import emit  # noqa: E402  (benchmarks/report.py)

from trine.engine.api import (  # noqa: E402
    AdamConfig,
    Forward,
    LoRAConfig,
    Loss,
    SampleRequest,
    SamplingOptions,
    TrainDatum,
)
from trine.engine.config import SamplerConfig  # noqa: E402
from trine.engine.model import invariant  # noqa: E402
from trine.engine.model.kernels.active import active  # noqa: E402
from trine.engine.model.lora import linear_shapes  # noqa: E402
from trine.engine.model.tokenizer import Tokenizer  # noqa: E402
from trine.engine.model.weights import auto_dtype, load_model  # noqa: E402
from trine.engine.sampler.sampler import Sampler  # noqa: E402
from trine.engine.trainer.trainer import Trainer  # noqa: E402

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
SIZES = dict(
    grpo=dict(prompts=4, samples=8, prompt_len=512, new=32),
    decode=dict(prompts=8, samples=8, prompt_len=64, new=128),
    train=dict(batch=8, seq=256),
)
QUICK = dict(
    grpo=dict(prompts=2, samples=4, prompt_len=128, new=8),
    decode=dict(prompts=2, samples=4, prompt_len=32, new=32),
    train=dict(batch=2, seq=64),
)


def log(msg: str) -> None:
    print(f"[bf16] {msg}", file=sys.stderr, flush=True)


class Side:
    """One dtype's model, Sampler and Trainer (with one run, `r`)."""

    def __init__(self, model_dir: Path, dtype: torch.dtype):
        self.model = load_model(model_dir, "cpu", dtype)
        # the kernels an engine's start builds and chooses, as `trine serve` runs them
        self.kernels = active(self.model.device, self.model.dtype, linear_shapes(self.model))
        self.tok = Tokenizer(model_dir)
        self.sampler = Sampler(self.model, self.tok, SamplerConfig(kv_cache_bytes=1 << 30))
        self.trainer = Trainer(self.model, base_model="bench")
        self.trainer.create_run("r", LoRAConfig(rank=16, alpha=32.0, seed=0))
        with torch.no_grad():  # a trained adapter, so that sampler and trainer run it
            for b in self.trainer.adapter("r").B.values():
                b.copy_(torch.randn(b.shape, generator=torch.Generator().manual_seed(2)).mul_(0.02))
        self.n = 0

    def generate(self, prompts: list[list[int]], samples: int, new: int) -> float:
        self.sampler.reset_prefix_cache()
        reqs = [self.request(p, samples, new) for p in prompts]
        t = time.perf_counter()
        self.sampler.run(reqs)
        return time.perf_counter() - t

    def request(self, prompt: list[int], samples: int, new: int, seed: int | None = None):
        self.n += 1
        opts = SamplingOptions(max_tokens=new, temperature=1.0, seed=seed or self.n, stop_at_eos=False)
        ident = self.trainer.weights_identity("r")
        return SampleRequest(f"r{self.n}", prompt, opts, ident, num_samples=samples), self.trainer.snapshot(
            "r"
        )

    def train_step(self, batch: list[TrainDatum]) -> float:
        t = time.perf_counter()
        self.trainer.forward_backward([("r", Forward(batch, Loss.parse("cross_entropy")))])
        self.trainer.optim_step("r", AdamConfig(learning_rate=1e-5))
        return time.perf_counter() - t

    def sampled_and_scored(self, prompts: list[list[int]]) -> tuple[list[TrainDatum], list[list[float]]]:
        """Seeded samples' training data and the logprobs the Sampler reported for their tokens. The
        prefix cache starts empty: a prompt's KV from the other kernel mode must not serve it."""
        self.sampler.reset_prefix_cache()
        res = self.sampler.run([self.request(p, 2, 32, seed=7 + i) for i, p in enumerate(prompts)])
        data, reported = [], []
        for p, r in zip(prompts, res):
            for seq in r.sequences:
                data.append(TrainDatum(p + seq.tokens[:-1], [-100] * (len(p) - 1) + seq.tokens))
                reported.append(seq.logprobs)
        return data, reported

    def scored(self, data: list[TrainDatum]) -> list[list[float]]:
        out = self.trainer.forward_backward(
            [("r", Forward(data, Loss.parse("cross_entropy")))], backward=False
        )
        return out[0].logprobs


def diff(a: list[list[float]], b: list[list[float]]) -> tuple[float, float]:
    """(max, mean) |a - b| over the last len(b_i) entries of each pair (the sampled tokens)."""
    d = torch.cat([(torch.tensor(x[-len(y) :]) - torch.tensor(y)).abs() for x, y in zip(a, b)])
    return float(d.max()), float(d.mean())


def paired(fn_a, fn_b, repeats: int) -> float:
    """Median of a's seconds / b's seconds over interleaved pairs (alternating order)."""
    ratios = []
    for r in range(repeats):
        first, second = (fn_a, fn_b) if r % 2 == 0 else (fn_b, fn_a)
        t1, t2 = first(), second()
        ta, tb = (t1, t2) if r % 2 == 0 else (t2, t1)
        ratios.append(ta / tb)
    return statistics.median(ratios)


def numerics(sides: dict[str, Side], rng: random.Random, vocab: int) -> dict:
    prompts = [[rng.randrange(100, vocab) for _ in range(n)] for n in (9, 40, 70)]
    out: dict = {}
    for mode in ("", "_batch_invariant"):
        invariant.enable(bool(mode))
        try:
            scored = {}
            for name, side in sides.items():
                data, reported = side.sampled_and_scored(prompts)
                scored[name] = side.scored(data)
                (
                    out[f"sampler_vs_trainer_{name}_max_abs{mode}"],
                    out[f"sampler_vs_trainer_{name}_mean_abs{mode}"],
                ) = diff(scored[name], reported)
                if name == "bf16":  # the fp32 Trainer on the tokens the bf16 Sampler drew
                    fp32 = sides["fp32"].scored(data)
                    (
                        out[f"bf16_vs_fp32_logprob_max_abs{mode}"],
                        out[f"bf16_vs_fp32_logprob_mean_abs{mode}"],
                    ) = diff(scored[name], [x[-len(r) :] for x, r in zip(fp32, reported)])
        finally:
            invariant.enable(False)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument(
        "--model", type=Path, help="model directory (default: the embedded SmolLM2-135M-Instruct)"
    )
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--quick", action="store_true", help="small sizes, for a smoke run")
    ap.add_argument("--json", action="store_true", help="print one JSON object on stdout")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    model_dir = args.model
    if model_dir is None:
        from trine.engine.model.default_model import ensure_default_model

        model_dir = ensure_default_model()
    sizes = QUICK if args.quick else SIZES
    sides = {name: Side(model_dir, dt) for name, dt in DTYPES.items()}
    vocab = sides["fp32"].model.cfg.vocab_size
    rng = random.Random(0)
    out: dict = dict(model=str(model_dir), repeats=args.repeats, threads=args.threads, quick=args.quick)
    out["sizes"] = sizes
    auto = auto_dtype(model_dir, torch.device("cpu"))
    out["dtype_auto"], out["dtype_auto_speedup"] = str(auto.dtype).removeprefix("torch."), auto.speedup
    for name in ("grpo", "decode"):
        p = sizes[name]
        prompts = [[rng.randrange(100, vocab) for _ in range(p["prompt_len"])] for _ in range(p["prompts"])]
        for side in sides.values():  # warm-up
            side.generate(prompts[:1], 2, 2)
        fp32, bf16 = (lambda s=s: s.generate(prompts, p["samples"], p["new"]) for s in sides.values())
        out[f"bf16_sampler_{name}_speedup"] = paired(fp32, bf16, args.repeats)
        log(f"sampler {name}: bf16 {out[f'bf16_sampler_{name}_speedup']:.2f}x fp32")
    t = sizes["train"]
    batch = []
    for _ in range(t["batch"]):
        ids = [rng.randrange(100, vocab) for _ in range(t["seq"])]
        batch.append(TrainDatum(ids, ids[1:] + [-100]))
    for side in sides.values():
        side.train_step(batch)  # warm-up
    fp32, bf16 = (lambda s=s: s.train_step(batch) for s in sides.values())
    out["bf16_trainer_speedup"] = paired(fp32, bf16, args.repeats)
    log(f"trainer: bf16 {out['bf16_trainer_speedup']:.2f}x fp32")
    out.update(numerics(sides, rng, vocab))
    del sides
    emit(out, args.json)


if __name__ == "__main__":
    main()
