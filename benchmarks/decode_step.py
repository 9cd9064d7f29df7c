"""Decode-step benchmark: the seconds of one sampler step as a function of how many sequences decode.

SmolLM2-135M-Instruct by default (`--model DIR`), fp32 on CPU. For each batch size n, n requests
(a `--prompt`-token random prompt, one sample, `--new` new tokens) are sampled together on a fresh
`Sampler`; the median of the decode-only steps (after the first two) is reported, with the seconds
per sequence. On a CPU a step's cost is far from flat in n, which is what bounds how fast another
key's short request can finish beside a large running batch (docs/serving.md, "Fair share between
keys"): every step of it decodes that batch too.

    .venv/bin/python benchmarks/decode_step.py [--json] [--sizes 1,8,16,32,48,64] [--repeats 3]
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time
from pathlib import Path

from trine.engine.setup import configure

configure()  # before torch loads: the engine's OpenMP wait and allocator, as under `trine serve`

# isort: split

import torch
from report import record  # benchmarks/report.py

from trine.engine.api import SampleRequest, SamplingOptions, WeightsIdentity
from trine.engine.config import SamplerConfig
from trine.engine.model.tokenizer import Tokenizer
from trine.engine.model.weights import load_model
from trine.engine.sampler.sampler import Sampler


def step_seconds(model, tok, n: int, prompt: int, new: int, rng: random.Random) -> float:
    s = Sampler(model, tok, SamplerConfig(kv_cache_bytes=1 << 30))
    opts = SamplingOptions(max_tokens=new, temperature=1.0, seed=0, stop_at_eos=False)
    for i in range(n):
        s.add(
            SampleRequest(
                f"r{i}", [rng.randrange(100, 40000) for _ in range(prompt)], opts, WeightsIdentity("b")
            )
        )
    times = []
    while s.has_work():
        t = time.perf_counter()
        s.step()
        times.append(time.perf_counter() - t)
    return statistics.median(times[2:])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", type=Path, default=None)
    ap.add_argument("--sizes", default="1,8,16,32,48,64")
    ap.add_argument("--prompt", type=int, default=32)
    ap.add_argument("--new", type=int, default=24)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    if args.model is None:
        from trine.engine.model.default_model import ensure_default_model

        args.model = ensure_default_model()
    if args.threads:
        torch.set_num_threads(args.threads)
    model, tok = load_model(args.model, "cpu", torch.float32), Tokenizer(args.model)
    rng = random.Random(0)
    sizes = [int(x) for x in args.sizes.split(",")]
    step_seconds(model, tok, 4, args.prompt, 8, rng)  # warm up
    runs = {n: [] for n in sizes}
    for _ in range(args.repeats):  # sizes interleaved, so the machine's drift hits all of them
        for n in sizes:
            runs[n].append(step_seconds(model, tok, n, args.prompt, args.new, rng))
    out = {"threads": torch.get_num_threads(), "steps": {}}
    for n in sizes:
        sec = statistics.median(runs[n])
        out["steps"][n] = {
            "step_s": sec,
            "per_sequence_ms": 1000 * sec / n,
            "vs_one": sec / statistics.median(runs[sizes[0]]),
        }
    record(out)  # benchmarks/results/decode_step.jsonl
    if args.json:
        print(json.dumps(out))
    else:
        for n, r in out["steps"].items():
            print(
                f"{n:4d} sequences: {r['step_s'] * 1000:7.1f} ms a step, "
                f"{r['per_sequence_ms']:6.2f} ms a sequence, "
                f"{r['vs_one']:.2f}x the first size"
            )


if __name__ == "__main__":
    main()
