"""CPU-share benchmark (issue 32, item 3): does the sampler keep its fair share of a busy CPU?

A fixed decode workload (8 sequences, `--new` tokens each, SmolLM2-135M fp32 by default) runs in a
fresh process, alone and then beside a 1-core and an N-core CPU hog (busy-loop processes), for each
OpenMP wait setting given (`--policies`): "default" is trine's own (the workload calls
`trine.engine.setup.configure()` before torch, so with nothing in the environment its settings
apply); "PASSIVE" or "ACTIVE" set OMP_WAIT_POLICY; "spin:N" sets OMP_WAIT_POLICY=ACTIVE and
GOMP_SPINCOUNT=N (libgomp's threads spin N times, then sleep), the form `configure()` uses. `--share
on,off`: whether the workload's loop calls `CpuShare.adapt()` between steps, as the engine worker
does (engine/runtime/cpu_share.py: fewer threads while other processes keep cores busy), or keeps
its threads. Reported: decode tokens/s per setting and the ratio to "alone". A fair share beside a
1-core hog on 2 cores is 50 %; OpenMP threads that spin while waiting for each other collapse far
below it when a core is taken.

    .venv/bin/python benchmarks/cpu_share.py [--json] [--new 64] [--rounds 3] \
        [--policies default,PASSIVE,spin:3000] [--share on,off]
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import statistics
import subprocess
import sys
import time

from report import record  # benchmarks/report.py

WORKLOAD = r"""
import random, sys, time
from trine.engine.setup import configure
configure()  # before torch: its OpenMP wait settings apply where the environment has none
import torch
from trine.engine.config import SamplerConfig
from trine.engine.runtime.cpu_share import CpuShare
from trine.engine.api import SampleRequest, SamplingOptions, WeightsIdentity
from trine.engine.model.default_model import ensure_default_model
from trine.engine.model.tokenizer import Tokenizer
from trine.engine.model.weights import load_model
from trine.engine.sampler.sampler import Sampler
from trine.home import trine_home

new, share = int(sys.argv[1]), CpuShare(enabled=sys.argv[2] == "on")
path = ensure_default_model(trine_home(None))
model, tok = load_model(path, device="cpu"), Tokenizer(path)
rng = random.Random(0)
def run(n_new):
    s = Sampler(model, tok, SamplerConfig(kv_cache_bytes=256 << 20))
    opts = SamplingOptions(max_tokens=n_new, temperature=1.0, seed=0, stop_at_eos=False)
    for i in range(8):
        prompt = [rng.randrange(100, 40000) for _ in range(32)]
        s.add(SampleRequest(f"r{i}", prompt, opts, WeightsIdentity("b")))
    t = time.perf_counter()
    while s.has_work():
        share.adapt()
        s.step()
    return time.perf_counter() - t
run(2)  # warm up
print(8 * new / run(new))
"""


def hog() -> None:
    while True:
        pass


def tokens_per_second(policy: str, share: str, new: int) -> float:
    env = {k: v for k, v in os.environ.items() if k not in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")}
    if policy.startswith("spin:"):  # libgomp spins this many times, then sleeps
        env.update(OMP_WAIT_POLICY="ACTIVE", GOMP_SPINCOUNT=policy.removeprefix("spin:"))
    elif policy != "default":
        env["OMP_WAIT_POLICY"] = policy
    out = subprocess.run(
        [sys.executable, "-c", WORKLOAD, str(new), share], env=env, capture_output=True, text=True, check=True
    )
    return float(out.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--new", type=int, default=64, help="new tokens per sequence")
    ap.add_argument("--rounds", type=int, default=3, help="runs per setting (the median is reported)")
    ap.add_argument("--policies", default="default,PASSIVE")
    ap.add_argument("--share", default="on,off", help="CpuShare in the loop: on, off or both")
    ap.add_argument("--hogs", default=f"0,1,{os.cpu_count()}", help="busy processes beside the workload")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    results: dict[str, dict[str, float]] = {}
    settings = [(p, sh) for p in args.policies.split(",") for sh in args.share.split(",")]
    for policy, share in settings:
        name = f"{policy} share:{share}"
        results[name] = {}
        for n in (int(h) for h in args.hogs.split(",")):
            procs = [multiprocessing.Process(target=hog, daemon=True) for _ in range(n)]
            for p in procs:
                p.start()
            time.sleep(0.5)
            try:
                runs = [tokens_per_second(policy, share, args.new) for _ in range(args.rounds)]
            finally:
                for p in procs:
                    p.terminate()
                    p.join()
            results[name][f"hogs{n}"] = statistics.median(runs)
            results[name][f"hogs{n}_spread"] = max(runs) - min(runs)
        alone = results[name].get("hogs0")
        if alone:
            for key in [k for k in results[name] if k.startswith("hogs") and not k.endswith("spread")]:
                results[name][f"{key}_vs_alone"] = results[name][key] / alone
    record(results)  # benchmarks/results/cpu_share.jsonl
    if args.json:
        print(json.dumps(results, indent=2))
        return
    for name, r in results.items():
        print(name)
        for k, v in r.items():
            print(f"  {k:22s} {v:8.3f}")


if __name__ == "__main__":
    main()
