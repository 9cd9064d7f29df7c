"""The GEMM kernel chosen by measurement (engine/model/kernels/gemm_choice.py) on this CPU: what each
candidate costs per weight shape and row bucket, and what the choice gains in the default model's
decode steps and prefill chunks against forcing MKL's packed weights or plain F.linear.

SmolLM2-135M-Instruct by default (`--model DIR`), fp32 on CPU. First the engine start's measurement,
run here (not read from the cache): per shape (fused q/k/v, o_proj, gate/up, down, LM head) and
bucket, each candidate's median microseconds and the one chosen. Then, for `--gemm auto`, `packed`
and `linear` interleaved `--repeats` times, so the machine's drift hits all three: the median decode
step of `--decode` sequences (decode-only steps, after the first two) and the prefill chunk of one
`--prefill`-token prompt (the first step of a request alone), each a median over the repeats. The
CPU is named as `lscpu` names it.

    .venv/bin/python benchmarks/gemm_choice.py [--json] [--decode 32] [--prefill 512] [--repeats 3]
"""

from __future__ import annotations

import argparse
import random
import statistics
import subprocess
import time
from pathlib import Path

from report import emit  # benchmarks/report.py

from trine.engine.setup import configure

configure()  # trine's OpenMP settings, before torch starts its threads

# isort: split
import torch  # noqa: E402

from trine.engine.api import SampleRequest, SamplingOptions, WeightsIdentity  # noqa: E402
from trine.engine.config import SamplerConfig  # noqa: E402
from trine.engine.model.kernels import gemm, gemm_choice  # noqa: E402
from trine.engine.model.lora import linear_shapes  # noqa: E402
from trine.engine.model.tokenizer import Tokenizer  # noqa: E402
from trine.engine.model.weights import load_model  # noqa: E402
from trine.engine.sampler.sampler import Sampler  # noqa: E402

MODES = ("auto", "packed", "linear")


def lscpu_model() -> str:
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True, timeout=10).stdout
    except (OSError, subprocess.SubprocessError):
        return "unknown"
    return next(
        (ln.split(":", 1)[1].strip() for ln in out.splitlines() if ln.startswith("Model name")), "unknown"
    )


def step_times(model, tok, n: int, prompt: int, new: int, rng: random.Random) -> list[float]:
    """Seconds of every sampler step of n requests (a `prompt`-token random prompt, `new` tokens each)."""
    s = Sampler(model, tok, SamplerConfig(kv_cache_bytes=1 << 30, enable_prefix_cache=False))
    opts = SamplingOptions(max_tokens=new, temperature=1.0, seed=0, stop_at_eos=False)
    for i in range(n):
        tokens = [rng.randrange(100, 40000) for _ in range(prompt)]
        s.add(SampleRequest(f"r{i}", tokens, opts, WeightsIdentity("b")))
    times = []
    while s.has_work():
        t = time.perf_counter()
        s.step()
        times.append(time.perf_counter() - t)
    return times


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", type=Path, default=None)
    ap.add_argument("--decode", type=int, default=32, help="sequences of the decode steps timed")
    ap.add_argument("--new", type=int, default=16, help="tokens each decoding sequence samples")
    ap.add_argument("--prefill", type=int, default=512, help="prompt tokens of the prefill chunk timed")
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
    shapes = linear_shapes(model)
    names = [c.name for c in gemm.CANDIDATES.values() if c.available(torch.float32)]
    start = time.monotonic()
    chosen, times = gemm_choice.measure(shapes, names)
    measure_s = time.monotonic() - start
    per_shape = {
        f"{o}x{i}": {
            b: {
                **{f"{n}_us": round(t * 1e6, 1) if t else None for n, t in got.items()},
                "choice": chosen[o, i][b],
            }
            for b, got in per.items()
        }
        for (o, i), per in times.items()
    }
    rng = random.Random(0)
    decode = {m: [] for m in MODES}
    prefill = {m: [] for m in MODES}
    for mode in MODES:  # a warm-up under each: every weight's packed and oneDNN copies made
        gemm.set_choice(mode, chosen if mode == "auto" else {})
        step_times(model, tok, args.decode, 8, 3, rng)
        step_times(model, tok, 1, args.prefill, 1, rng)
    for _ in range(args.repeats):
        for mode in MODES:  # interleaved
            gemm.set_choice(mode, chosen if mode == "auto" else {})
            decode[mode].append(statistics.median(step_times(model, tok, args.decode, 8, args.new, rng)[2:]))
            prefill[mode].append(step_times(model, tok, 1, args.prefill, 1, rng)[0])
    gemm.set_choice("auto", chosen)
    dec = {m: statistics.median(v) * 1e3 for m, v in decode.items()}
    pre = {m: statistics.median(v) * 1e3 for m, v in prefill.items()}
    out = {
        "cpu": lscpu_model(),
        "threads": torch.get_num_threads(),
        "choice": gemm.summary(),
        "measure_s": measure_s,
        "decode_step_ms": dec,
        "prefill_chunk_ms": pre,
        "decode_packed_over_auto": dec["packed"] / dec["auto"],
        "decode_linear_over_auto": dec["linear"] / dec["auto"],
        "prefill_packed_over_auto": pre["packed"] / pre["auto"],
        "prefill_linear_over_auto": pre["linear"] / pre["auto"],
        "gemm": per_shape,
    }
    emit(out, args.json)  # benchmarks/results/gemm_choice.jsonl


if __name__ == "__main__":
    main()
