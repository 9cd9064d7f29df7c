"""Probe beside a long prompt, at the sampler (issue 32, item 4): how long a short request takes
when it arrives while an N-token prompt-logprobs request (nothing decodes) holds the engine.

SmolLM2-135M fp32 on CPU, one `Sampler` per setting, stepped in this thread. Per
`idle_prefill_seconds` setting (1e9 = the old whole-`max_batch_tokens` chunks when nothing decodes):
the median latency of 2 probes (16-token prompt, 16 greedy tokens) on the idle sampler, then the
long request alone for 3 s of steps, then a probe added between two steps; its latency over the
idle one is the slowdown (`benchmarks/load.py` probe_slowdown measures the same through the server,
with arrivals mid-step). Also the long request's total seconds (what the smaller chunks cost it).

    .venv/bin/python benchmarks/probe_prefill.py [--long 8000] [--settings 1e9,1.0]
"""

from __future__ import annotations

import argparse
import random
import statistics
import time

from trine.engine.setup import configure

configure()  # before torch: the engine's OpenMP wait policy

# isort: split
from trine.engine.api import SampleRequest, SamplingOptions, WeightsIdentity  # noqa: E402
from trine.engine.config import SamplerConfig  # noqa: E402
from trine.engine.model.default_model import ensure_default_model  # noqa: E402
from trine.engine.model.tokenizer import Tokenizer  # noqa: E402
from trine.engine.model.weights import load_model  # noqa: E402
from trine.engine.sampler.sampler import Sampler  # noqa: E402
from trine.home import trine_home  # noqa: E402

W = WeightsIdentity("b")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--long", type=int, default=8000, help="tokens of the prompt-logprobs request")
    ap.add_argument("--settings", default="1e9,1.0", help="idle_prefill_seconds values to compare")
    args = ap.parse_args()
    path = ensure_default_model(trine_home(None))
    model, tok = load_model(path, device="cpu"), Tokenizer(path)
    rng = random.Random(0)

    def probe(name: str) -> SampleRequest:
        opts = SamplingOptions(max_tokens=16, temperature=0.0, stop_at_eos=False)
        return SampleRequest(name, [rng.randrange(100, 40000) for _ in range(16)], opts, W)

    def finish(s: Sampler, rid: str) -> float:
        t = time.perf_counter()
        while rid in s._live:
            s.step()
        return time.perf_counter() - t

    for idle in (float(x) for x in args.settings.split(",")):
        s = Sampler(model, tok, SamplerConfig(kv_cache_bytes=1 << 30, idle_prefill_seconds=idle))
        idle_lat = []
        for i in range(2):
            s.add(probe(f"idle{i}"))
            idle_lat.append(finish(s, f"idle{i}"))
        prompt = [rng.randrange(100, 40000) for _ in range(args.long)]
        s.add(
            SampleRequest(
                "long", prompt, SamplingOptions(max_tokens=1), W, generate=False, prompt_logprobs=True
            )
        )
        t0 = time.perf_counter()
        while time.perf_counter() - t0 < 3.0 and "long" in s._live:
            s.step()
        s.add(probe("beside"))
        beside = finish(s, "beside")
        while "long" in s._live:
            s.step()
        base = statistics.median(idle_lat)
        print(
            f"idle_prefill_seconds={idle:g}: idle probe {base:.2f} s, probe beside the long request "
            f"{beside:.2f} s, slowdown {beside / base:.1f}; long request {time.perf_counter() - t0:.1f} s",
            flush=True,
        )


if __name__ == "__main__":
    main()
