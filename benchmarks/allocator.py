"""The C allocator's thresholds (engine/malloc.py): a decode-heavy batch with trine's setting (freed
per-step tensors kept in the heap) against glibc's default (`TRINE_MALLOC=default`).

Why: a decode step's logits, their softmax and log-softmax ([64, 49152] fp32, 12.5 MB each) are
freed at the end of the step; glibc's default trims them back to the kernel, and the next step
page-faults them in afresh.

Each setting runs in a fresh process (the setting is made at import), alternating which goes
first: `--prompts` x `--samples` samples of `--prompt-len`-token prompts, `--new` new tokens, after
a warm-up run. Keys, per setting (`trine`, `glibc_default`): `<setting>_s` (the batch's seconds),
`<setting>_sampling_s` (the part in `sample()`: logits to tokens), `<setting>_page_faults` (minor
faults during the batch; medians over `--repeats` processes each), and `speedup` (glibc_default_s /
trine_s), `sampling_speedup`.

    .venv/bin/python benchmarks/allocator.py [--json] [--repeats 2] [--new 128]
"""

from __future__ import annotations

import argparse
import statistics

from fresh_process import run_child  # benchmarks/fresh_process.py
from report import emit  # benchmarks/report.py

from trine.engine.malloc import ENV_NAMES

CHILD = r"""
import json, random, resource, sys, time
from trine.engine.setup import configure
configure()  # as an engine's start does
import torch
from trine.engine.config import SamplerConfig
from trine.engine.api import SampleRequest, SamplingOptions, WeightsIdentity
from trine.engine.malloc import keep_freed_memory
from trine.engine.model.default_model import ensure_default_model
from trine.engine.model.tokenizer import Tokenizer
from trine.engine.model.weights import load_model
from trine.engine.sampler import sampler as sampler_module

prompts, samples, prompt_len, new = map(int, sys.argv[1:5])
torch.set_num_threads(2)
model_dir = str(ensure_default_model())
model, tokenizer = load_model(model_dir, "cpu"), Tokenizer(model_dir)
sampler = sampler_module.Sampler(model, tokenizer, SamplerConfig(kv_cache_bytes=1 << 30))
rng = random.Random(0)
in_sample = [0.0]
sample = sampler_module.sample


def timed_sample(*args, **kw):
    t = time.perf_counter()
    try:
        return sample(*args, **kw)
    finally:
        in_sample[0] += time.perf_counter() - t


sampler_module.sample = timed_sample


def batch(tag):
    opts = SamplingOptions(max_tokens=new, temperature=1.0, seed=1, stop_at_eos=False)
    reqs = [
        SampleRequest(f"{tag}{i}", [rng.randrange(100, 40000) for _ in range(prompt_len)], opts,
                      WeightsIdentity("bench"), num_samples=samples)
        for i in range(prompts)
    ]
    sampler.reset_prefix_cache()
    in_sample[0] = 0.0
    faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    t = time.perf_counter()
    sampler.run(reqs)
    return dict(s=time.perf_counter() - t, sampling_s=in_sample[0],
                page_faults=resource.getrusage(resource.RUSAGE_SELF).ru_minflt - faults)


batch("warm")
print(json.dumps(dict(batch("measured"), malloc=keep_freed_memory())))
"""

SETTINGS = {"trine": {}, "glibc_default": {"TRINE_MALLOC": "default"}}
KEYS = ("s", "sampling_s", "page_faults")


def run_setting(extra: dict, args) -> dict:
    argv = [args.prompts, args.samples, args.prompt_len, args.new]
    return run_child(CHILD, argv, drop=ENV_NAMES, env=extra)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--samples", type=int, default=8)
    ap.add_argument("--prompt-len", type=int, default=64)
    ap.add_argument("--new", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    runs: dict[str, list[dict]] = {name: [] for name in SETTINGS}
    for i in range(args.repeats):
        for name in list(SETTINGS) if i % 2 == 0 else list(SETTINGS)[::-1]:
            runs[name].append(run_setting(SETTINGS[name], args))
    result: dict = {"trine_malloc": runs["trine"][0]["malloc"]}
    for name, got in runs.items():
        for key in KEYS:
            result[f"{name}_{key}"] = statistics.median(r[key] for r in got)
    result["speedup"] = result["glibc_default_s"] / result["trine_s"]
    result["sampling_speedup"] = result["glibc_default_sampling_s"] / result["trine_sampling_s"]
    result.update({k: getattr(args, k) for k in ("prompts", "samples", "prompt_len", "new", "repeats")})
    emit(result, args.json)


if __name__ == "__main__":
    main()
