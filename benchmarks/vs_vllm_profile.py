"""Where trine's sampler spends a step: torch.profiler over the vs_vllm decode-heavy and batch workloads.

The engine is not changed: its step's parts are wrapped (from outside, in this process only) in
`record_function` regions, and each region's time is split into the torch ops it calls directly,
by kind, and the Python between them. Rows:

- linear (body): aten::linear and MKL's packed linear in the body's forward (q/k/v/o, gate/up/down);
- LM head: the logits forward (one linear over the rows that sample);
- attention: SDPA and the paged attention kernel;
- KV write + gather: index_copy_/index_select on the paged pool in the forward;
- other forward ops: embedding, RMSNorm, RoPE, SiLU, residual adds, views;
- forward Python: the forward's time outside any torch op (module calls, argument handling);
- sampling: sample() and grammar masks (log-softmax, filtering, one uniform per sequence);
- token bookkeeping: _advance's per-sequence Python (appends, stop checks, results);
- KV layout: slot tables and block forks (kv_layout.py); scheduler: admission and planning;
- step glue: the rest of step()/_prefill/_decode (adapter batches, row selection).

Beside the rows, the body's linear layers inside prefill forwards alone:
prefill_linear_gflops_in_op (2 x body weights x prefill tokens over their linear time) and
prefill_linear_fraction_of_peak, against the best 1024^3 matmul in the model's dtype (`--dtype`,
fp32 by default) measured in this process before the workloads (the issue's goal: >= 0.75).

    PYTHONPATH=src .venv/bin/python benchmarks/vs_vllm_profile.py [--quick] [--json] [--threads 2]
"""

from __future__ import annotations

import argparse
import functools
import json
import random
import sys
import time
from collections import Counter
from pathlib import Path

from trine.engine.setup import configure

configure()  # before torch loads: the engine's OpenMP wait and allocator, as under `trine serve`

# isort: split

import torch
from torch.profiler import ProfilerActivity, profile, record_function, schedule

sys.path.insert(0, str(Path(__file__).resolve().parent))
from report import emit  # noqa: E402  benchmarks/report.py
from vs_vllm import QUICK, SIZES, linear_weights  # noqa: E402
from vs_vllm_side import gemm_peak_gflops  # noqa: E402

from trine.engine.config import SamplerConfig
from trine.engine.model import attention, model  # noqa: E402
from trine.engine.sampler import kv_layout, sampler, scheduler  # noqa: E402
from trine.engine.sampler.grammar import Grammars  # noqa: E402

REGIONS = {  # (owner, attribute) -> region label
    (sampler.Sampler, "step"): "step glue",
    (sampler.Sampler, "_prefill"): "step glue",
    (sampler.Sampler, "_decode"): "step glue",
    (sampler.Sampler, "_advance"): "token bookkeeping",
    (sampler, "sample"): "sampling",
    (Grammars, "mask"): "sampling",
    (model.Transformer, "hidden_states"): "forward",
    (model.Transformer, "logits"): "LM head",
    (attention, "paged_attention"): "attention",  # the C kernel (no torch op): decode attention in place
    **{
        (kv_layout.KVLayout, m): "KV layout"
        for m in ("prefill", "decode", "fork", "cache_prompt", "cache_decoded")
    },
    **{
        (scheduler.Scheduler, m): "scheduler"
        for m in (
            "schedule",
            "grow",
            "drop_stopped",
            "start",
            "prefilled",
            "decoded",
            "prompt_done",
            "release",
        )
    },
}
FORWARD_OPS = {
    "aten::linear": "linear (body)",
    "mkl::_mkl_linear": "linear (body)",  # few rows: MKL's packed weights (engine/model/kernels/packed.py)
    "mkldnn::_linear_pointwise": "linear (body)",  # few rows where oneDNN measured faster (gemm.py)
    "aten::scaled_dot_product_attention": "attention",
    "aten::index_copy_": "KV write + gather",
    "aten::index_select": "KV write + gather",
    "aten::index": "KV write + gather",
}
ROWS = (
    "linear (body)",
    "LM head",
    "attention",
    "KV write + gather",
    "other forward ops",
    "forward Python",
    "sampling",
    "token bookkeeping",
    "KV layout",
    "scheduler",
    "step glue",
)


PREFILL = "@prefill"  # marks the region of Sampler._prefill: its forwards are prefill forwards


def instrument() -> None:
    for (owner, attr), label in REGIONS.items():
        fn = getattr(owner, attr)
        name = f"#{label}{PREFILL if attr == '_prefill' else ''}"

        @functools.wraps(fn)
        def wrapped(*a, _fn=fn, _name=name, **k):
            with record_function(_name):
                return _fn(*a, **k)

        setattr(owner, attr, wrapped)


def tally(events) -> Counter:
    """Microseconds by row: each region's direct op children by kind, the rest of it as its own."""
    out = Counter()
    for ev in events:
        if not ev.name.startswith("#"):
            continue
        label = ev.name[1:].removesuffix(PREFILL)
        rest = ev.cpu_time_total
        in_prefill = label == "forward" and _within_prefill(ev)
        for c in ev.cpu_children:
            rest -= c.cpu_time_total
            if c.name.startswith("#"):
                continue  # counted as its own region
            if label == "forward":
                row = FORWARD_OPS.get(c.name, "other forward ops")
                out[row] += c.cpu_time_total
                if in_prefill and row == "linear (body)":
                    out["prefill linear"] += c.cpu_time_total  # a part of "linear (body)"
            else:
                out[label] += c.cpu_time_total
        out["forward Python" if label == "forward" else label] += rest
    return out


def _within_prefill(ev) -> bool:
    while ev is not None:
        if ev.name.endswith(PREFILL):
            return True
        ev = ev.cpu_parent
    return False


def run(name: str, p: dict, m, tok, kv_bytes: int, weights: tuple[int, int]) -> dict:
    from trine.engine.api import SampleRequest, SamplingOptions, WeightsIdentity

    rng = random.Random(0)
    prompts = [
        [rng.randrange(100, m.cfg.vocab_size) for _ in range(p["prompt_len"])] for _ in range(p["prompts"])
    ]
    opts = [
        SamplingOptions(max_tokens=p["new"], temperature=1.0, seed=i, stop_at_eos=False)
        for i in range(len(prompts))
    ]
    reqs = [
        SampleRequest(f"{name}{i}", x, o, WeightsIdentity("bench"), num_samples=p["samples"])
        for i, (x, o) in enumerate(zip(prompts, opts))
    ]
    s = sampler.Sampler(m, tok, SamplerConfig(kv_cache_bytes=kv_bytes, enable_prefix_cache=True))
    for r in reqs:
        s.add(r)
    us = Counter()
    # One profile per 16 steps, tallied and dropped: a whole run's events do not fit in memory.
    every_step = schedule(wait=0, warmup=0, active=16)
    with profile(
        activities=[ProfilerActivity.CPU],
        schedule=every_step,
        on_trace_ready=lambda p: us.update(tally(p.events())),
    ) as prof:
        t = time.perf_counter()
        while s.has_work():
            s.step()
            prof.step()
        wall = time.perf_counter() - t
    st = s.stats
    prefill_linear_s = us.pop("prefill linear", 0) / 1e6
    total = sum(us.values()) / 1e6
    body, _ = weights
    computed = st["prefill_tokens"] + st["sample_tokens"] - p["prompts"] * p["samples"]
    linear_s = us["linear (body)"] / 1e6
    return dict(
        wall_s=wall,
        accounted_s=total,
        steps=st["steps"],
        prefill_forwards=st["prefill_forwards"],
        decode_forwards=st["decode_forwards"],
        ms_per_step=1e3 * wall / st["steps"],
        seconds={r: us[r] / 1e6 for r in ROWS},
        share={r: us[r] / 1e6 / total for r in ROWS},
        body_linear_gflops_in_op=2 * body * computed / linear_s / 1e9 if linear_s else 0.0,
        prefill_linear_s=prefill_linear_s,
        prefill_linear_gflops_in_op=(
            2 * body * st["prefill_tokens"] / prefill_linear_s / 1e9 if prefill_linear_s else 0.0
        ),
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", type=Path)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--kv-gib", type=int, default=2)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--only", nargs="*", choices=("decode", "batch", "grpo"), default=["decode", "batch"])
    ap.add_argument(
        "--dtype", choices=("float32", "bfloat16"), default="float32", help="the model's and the peak's dtype"
    )
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    from trine.engine.model.kernels.active import active
    from trine.engine.model.lora import linear_shapes
    from trine.engine.model.tokenizer import Tokenizer
    from trine.engine.model.weights import load_model

    model_dir = args.model
    if model_dir is None:
        from trine.engine.model.default_model import ensure_default_model

        model_dir = ensure_default_model()
    m, tok = load_model(model_dir, "cpu", getattr(torch, args.dtype)), Tokenizer(model_dir)
    # the kernels an engine's start builds and chooses, as `trine serve` runs them
    kernels = active(m.device, m.dtype, linear_shapes(m))
    instrument()
    sizes, kv_bytes = (QUICK if args.quick else SIZES), args.kv_gib * 2**30
    run("warm", QUICK["decode"], m, tok, kv_bytes, linear_weights(model_dir))
    peak = gemm_peak_gflops(args.dtype)
    out: dict = dict(
        threads=torch.get_num_threads(),
        dtype=args.dtype,
        quick=args.quick,
        gemm_peak_gflops=peak,
        kernels=kernels,
    )
    for name in args.only:
        print(f"[vs_vllm_profile] {name}: {sizes[name]}", file=sys.stderr, flush=True)
        out[name] = run(name, sizes[name], m, tok, kv_bytes, linear_weights(model_dir))
        out[name]["prefill_linear_fraction_of_peak"] = out[name]["prefill_linear_gflops_in_op"] / peak
        print(json.dumps(out[name]), file=sys.stderr, flush=True)
    emit(out, args.json)


if __name__ == "__main__":
    main()
