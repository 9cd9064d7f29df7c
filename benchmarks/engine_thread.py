"""The engine thread's OpenMP spin: a Sampler run in a second thread, after the main thread ran a
parallel torch op (as a server's engine thread does once anything in its main thread has), against
the same run in the main thread; under trine's default wait setting and under `GOMP_SPINCOUNT=3000`
alone (the default before 2026-12-02).

Why: once two threads have run parallel regions, libgomp counts more of its threads than cores and
cuts every spin to a "throttled" count, 100 pause loops unless `OMP_WAIT_POLICY=ACTIVE` (1000), so
every op of the second thread's forward paid a thread wake-up (docs/serving.md#shared-cpu-cores).

Each setting runs in a fresh process (the runtime reads it once): a decode-heavy batch (`--prompts`
x `--samples` samples, `--prompt-len`-token prompts, `--new` new tokens) `--repeats` times in each
thread, alternating which goes first, and a 64 x 576 add timed 500 times in each. Keys, per setting
(`default`, `spin3000`): `<setting>_main_s`, `<setting>_thread_s` (medians), `<setting>_thread_over_main`,
`<setting>_small_op_main_us`, `<setting>_small_op_thread_us`; `default_openmp_wait` names the default.

    .venv/bin/python benchmarks/engine_thread.py [--json] [--repeats 2] [--new 64]
"""

from __future__ import annotations

import argparse

from fresh_process import run_child  # benchmarks/fresh_process.py
from report import emit  # benchmarks/report.py

CHILD = r"""
import json, random, statistics, sys, threading, time
from trine.engine.setup import configure, openmp_wait
configure()  # before torch, as the trine CLI does
import torch
from trine.engine.config import SamplerConfig
from trine.engine.api import SampleRequest, SamplingOptions, WeightsIdentity
from trine.engine.model.default_model import ensure_default_model
from trine.engine.model.tokenizer import Tokenizer
from trine.engine.model.weights import load_model
from trine.engine.sampler.sampler import Sampler

from trine.engine.runtime.cpu_share import release_openmp_pool
prompts, samples, prompt_len, new, repeats, release = map(int, sys.argv[1:7])
torch.set_num_threads(2)
model_dir = str(ensure_default_model())
model, tok = load_model(model_dir, "cpu"), Tokenizer(model_dir)
sampler = Sampler(model, tok, SamplerConfig(kv_cache_bytes=1 << 30))
rng, ids = random.Random(0), iter(range(10**9))


def batch(out):
    reqs = [
        SampleRequest(
            f"r{next(ids)}",
            [rng.randrange(100, 40000) for _ in range(prompt_len)],
            SamplingOptions(max_tokens=new, temperature=1.0, seed=1, stop_at_eos=False),
            WeightsIdentity("bench"),
            num_samples=samples,
        )
        for _ in range(prompts)
    ]
    sampler.reset_prefix_cache()
    t = time.perf_counter()
    sampler.run(reqs)
    out.append(time.perf_counter() - t)


x = torch.randn(64, 576)


def small_op(out):
    for _ in range(20):
        x + x
    t = time.perf_counter()
    for _ in range(500):
        x + x
    out.append((time.perf_counter() - t) / 500 * 1e6)


def in_thread(fn, out):
    if release:  # as EngineWorker.start does before its thread starts
        release_openmp_pool()
    th = threading.Thread(target=fn, args=(out,))
    th.start()
    th.join()


in_main, in_second = [], []
batch([])  # warm-up, and the main thread's parallel regions: its OpenMP pool now exists
for i in range(repeats):
    for where in (("main", "thread") if i % 2 == 0 else ("thread", "main")):
        batch(in_main) if where == "main" else in_thread(batch, in_second)
op_main, op_thread = [], []
small_op(op_main)
in_thread(small_op, op_thread)
print(json.dumps(dict(
    main_s=statistics.median(in_main), thread_s=statistics.median(in_second),
    small_op_main_us=op_main[0], small_op_thread_us=op_thread[0],
    openmp_wait=openmp_wait(),
)))
"""

# name: (environment, whether the main thread releases its OpenMP pool before the thread starts)
SETTINGS = {
    "default": ({}, 1),
    "default_kept_pool": ({}, 0),
    "spin3000": ({"OMP_WAIT_POLICY": "ACTIVE", "GOMP_SPINCOUNT": "3000"}, 1),
}


def run_setting(extra: dict, release: int, args) -> dict:
    named = ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT", "KMP_BLOCKTIME")
    argv = [args.prompts, args.samples, args.prompt_len, args.new, args.repeats, release]
    return run_child(CHILD, argv, drop=named, env=extra)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--samples", type=int, default=8)
    ap.add_argument("--prompt-len", type=int, default=64)
    ap.add_argument("--new", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    result: dict = {}
    for name, (extra, release) in SETTINGS.items():
        got = run_setting(extra, release, args)
        if name == "default":
            result["default_openmp_wait"] = got["openmp_wait"]
        for key in ("main_s", "thread_s", "small_op_main_us", "small_op_thread_us"):
            result[f"{name}_{key}"] = got[key]
        result[f"{name}_thread_over_main"] = got["thread_s"] / got["main_s"]
    sizes = ("prompts", "samples", "prompt_len", "new", "repeats")
    result.update({k: getattr(args, k) for k in sizes})
    emit(result, args.json)


if __name__ == "__main__":
    main()
