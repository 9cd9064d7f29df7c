"""Sampler benchmark: trine's prefix cache and continuous batching vs Hugging Face `generate`.

SmolLM2-135M-Instruct, fp32 on CPU by default (`--model DIR` for any checkpoint directory;
`--dtype bfloat16` runs both trine and HF in bf16, and the GEMM peak is then bf16's). Every
scenario runs its variants interleaved, `--repeats` times, with fresh random prompts per repeat,
and reports medians; ratios are median(baseline) / median(trine), except the no-sharing
overhead: the median of the interleaved pairs' on/off ratios, minus 1.

a. GRPO group: 4 prompts x 8 samples, 512-token prompts, 32 new tokens. trine vs
   `generate(num_return_sequences=8)` (`--no-generate` skips it) and vs HF reusing its own prefix
   cache (each prompt prefilled once, the DynamicCache expanded to 8 rows, then `generate`). Also
   the distance to this CPU's fp32 GEMM peak: trine's linear-layer FLOPs (2 x linear weights x
   tokens computed) per second against the best of a [1024 x 1024] x [1024 x 1024] torch matmul.
b. Multi-turn: 4 turns, each prompt = previous prompt + its completion + 64 new tokens. Time to
   first token of turns 2-4, prefix cache on vs off, and the cached fraction of their prompt tokens.
c. A shared 768-token preamble + 16 different 32-token questions, 8 new tokens each: cache on vs
   off, and vs HF `generate` on the batch of 16.
d. No sharing: 16 unrelated 256-token prompts, 16 new tokens: the prefix cache's overhead.

    .venv/bin/python benchmarks/sampler.py [--repeats 3] [--quick] [--json] [--model DIR] [--no-generate]
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import random
import statistics
import sys
import time
from pathlib import Path

from trine.engine.setup import configure

configure()  # before torch loads: the engine's OpenMP wait and allocator, as under `trine serve`

# isort: split

import torch
from report import emit  # benchmarks/report.py

from trine.engine.api import SampleRequest, SamplingOptions, WeightsIdentity
from trine.engine.config import SamplerConfig
from trine.engine.model.kernels.active import active
from trine.engine.model.lora import linear_shapes
from trine.engine.model.tokenizer import Tokenizer
from trine.engine.model.weights import load_model
from trine.engine.sampler.sampler import Sampler

W = WeightsIdentity("bench")
SIZES = dict(  # full / --quick
    grpo=dict(prompts=4, samples=8, prompt_len=512, new=32),
    multiturn=dict(turns=4, first_len=1024, turn_len=64, new=32),
    preamble=dict(preamble=768, questions=16, question_len=32, new=8),
    nosharing=dict(prompts=16, prompt_len=256, new=16),
)
QUICK = dict(
    grpo=dict(prompts=2, samples=8, prompt_len=128, new=8),
    multiturn=dict(turns=4, first_len=256, turn_len=32, new=8),
    preamble=dict(preamble=192, questions=8, question_len=16, new=4),
    nosharing=dict(prompts=8, prompt_len=64, new=8),
)


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


class Bench:
    def __init__(
        self,
        model_dir: Path,
        repeats: int,
        kv_cache_bytes: int,
        generate: bool = True,
        dtype: str = "float32",
    ):
        from transformers import AutoModelForCausalLM

        self.dtype = dtype
        self.model = load_model(model_dir, "cpu", getattr(torch, dtype))
        # the kernels an engine's start builds and chooses, as `trine serve` runs them
        self.kernels = active(self.model.device, self.model.dtype, linear_shapes(self.model))
        self.tok = Tokenizer(model_dir)
        self.hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=getattr(torch, dtype)).eval()
        self.repeats = repeats
        self.generate = generate
        self.kv_cache_bytes = kv_cache_bytes
        self.rng = random.Random(0)
        self.vocab = self.model.cfg.vocab_size
        self._n = 0

    # ------------------------------------------------------------------ helpers
    def sampler(self, cache: bool = True) -> Sampler:
        return Sampler(
            self.model, self.tok, SamplerConfig(kv_cache_bytes=self.kv_cache_bytes, enable_prefix_cache=cache)
        )

    def prompt(self, n: int) -> list[int]:
        return [self.rng.randrange(100, self.vocab) for _ in range(n)]

    def req(self, prompt: list[int], new: int, n: int = 1, seed: int | None = None) -> SampleRequest:
        self._n += 1
        opts = SamplingOptions(max_tokens=new, temperature=1.0, seed=seed, stop_at_eos=False)
        return SampleRequest(f"b{self._n}", prompt, opts, W, num_samples=n)

    def hf_generate(self, prompts: list[list[int]], new: int, n: int = 1, cache=None):
        ids = torch.tensor(prompts)
        kw = dict(
            do_sample=True,
            temperature=1.0,
            top_k=0,
            top_p=1.0,
            max_new_tokens=new,
            min_new_tokens=new,
            num_return_sequences=n,
            pad_token_id=0,
            attention_mask=torch.ones_like(ids),
        )
        if cache is not None:
            kw["past_key_values"] = cache
        with torch.inference_mode():
            out = self.hf.generate(ids, **kw)
        assert out.shape == (len(prompts) * n, ids.shape[1] + new), out.shape
        return out

    def hf_cached_group(self, prompts: list[list[int]], new: int, n: int):
        """HF reusing its own prefix cache: prefill prompt[:-1] once per prompt, expand the cache
        to n rows per prompt, then generate (which computes only the last prompt token)."""
        from transformers import DynamicCache

        ids = torch.tensor(prompts)
        with torch.inference_mode():
            cache = DynamicCache(config=self.hf.config)
            self.hf(ids[:, :-1], past_key_values=cache, use_cache=True, logits_to_keep=1)
            cache.batch_repeat_interleave(n)
            return self.hf_generate([p for p in prompts for _ in range(n)], new, 1, cache)

    @staticmethod
    def timed(fn):
        t = time.perf_counter()
        out = fn()
        return time.perf_counter() - t, out

    @staticmethod
    def med(xs: list[float]) -> float:
        return statistics.median(xs)

    # ------------------------------------------------------------------ scenarios
    def grpo(self, p: dict) -> dict:
        t_trine, t_gen, t_hfc, stats = [], [], [], None
        for r in range(self.repeats):
            prompts = [self.prompt(p["prompt_len"]) for _ in range(p["prompts"])]
            s = self.sampler()
            reqs = [self.req(x, p["new"], p["samples"], seed=i) for i, x in enumerate(prompts)]
            dt, res = self.timed(lambda: s.run(reqs))
            assert (
                sum(len(q.tokens) for x in res for q in x.sequences) == p["prompts"] * p["samples"] * p["new"]
            )
            t_trine.append(dt)
            stats = s.stats
            if self.generate:
                t_gen.append(self.timed(lambda: self.hf_generate(prompts, p["new"], p["samples"]))[0])
            t_hfc.append(self.timed(lambda: self.hf_cached_group(prompts, p["new"], p["samples"]))[0])
            log(
                f"  grpo #{r}: trine {dt:.2f}s  generate(n=8) {t_gen[-1] if t_gen else 0:.2f}s  "
                f"HF+cache {t_hfc[-1]:.2f}s"
            )
        linear = sum(m.weight.numel() for m in self.model.modules() if isinstance(m, torch.nn.Linear))
        flop = 2 * linear * (stats["prefill_tokens"] + stats["sample_tokens"])
        peak = gemm_peak_gflops(self.dtype)
        gen = (
            dict(grpo_generate_s=self.med(t_gen), grpo_vs_generate=self.med(t_gen) / self.med(t_trine))
            if t_gen
            else {}
        )
        return dict(
            grpo_s=self.med(t_trine),
            grpo_hf_cache_s=self.med(t_hfc),
            **gen,
            grpo_vs_hf_cache=self.med(t_hfc) / self.med(t_trine),
            grpo_linear_gflops=flop / self.med(t_trine) / 1e9,
            gemm_peak_gflops=peak,
            grpo_fraction_of_peak=flop / self.med(t_trine) / 1e9 / peak,
            grpo_tokens={
                k: stats[k] for k in ("prompt_tokens", "prefill_tokens", "cached_tokens", "sample_tokens")
            },
        )

    def _ttft(self, s: Sampler, req: SampleRequest):
        """Time from adding `req` (streamed) until the step that gives it its first token (its
        prompt may be prefilled over several steps); then finish it."""
        req = dataclasses.replace(req, stream=True)
        s.add(req)
        t = time.perf_counter()
        done, ttft = [], None
        while s.has_work():
            done += s.step()
            if any(d.request_id == req.request_id for d in s.take_deltas()) and ttft is None:
                ttft = time.perf_counter() - t
        return ttft, done[0]

    def multiturn(self, p: dict) -> dict:
        on_t, off_t, cached, prompt_toks = [], [], 0, 0
        for r in range(self.repeats):
            on, off = self.sampler(True), self.sampler(False)
            prompt = self.prompt(p["first_len"])
            tot_on = tot_off = 0.0
            for turn in range(p["turns"]):
                t_on, res = self._ttft(on, self.req(prompt, p["new"], seed=turn))
                t_off, _ = self._ttft(off, self.req(prompt, p["new"], seed=turn))
                if turn > 0:
                    tot_on, tot_off = tot_on + t_on, tot_off + t_off
                    cached += res.usage.cached_tokens
                    prompt_toks += res.usage.prompt_tokens
                prompt = prompt + res.sequences[0].tokens + self.prompt(p["turn_len"])
            on_t.append(tot_on)
            off_t.append(tot_off)
            log(f"  multiturn #{r}: TTFT turns 2-{p['turns']} cache on {tot_on:.3f}s  off {tot_off:.3f}s")
        return dict(
            multiturn_ttft_on_s=self.med(on_t),
            multiturn_ttft_off_s=self.med(off_t),
            multiturn_ttft=self.med(off_t) / self.med(on_t),
            multiturn_cached_fraction=cached / prompt_toks,
        )

    def preamble(self, p: dict) -> dict:
        on_t, off_t, hf_t, stats = [], [], [], None
        for r in range(self.repeats):
            pre = self.prompt(p["preamble"])
            prompts = [pre + self.prompt(p["question_len"]) for _ in range(p["questions"])]
            on = self.sampler(True)
            dt_on, _ = self.timed(
                lambda: on.run([self.req(x, p["new"], seed=i) for i, x in enumerate(prompts)])
            )
            stats = on.stats
            off = self.sampler(False)
            dt_off, _ = self.timed(
                lambda: off.run([self.req(x, p["new"], seed=i) for i, x in enumerate(prompts)])
            )
            dt_hf, _ = self.timed(lambda: self.hf_generate(prompts, p["new"]))
            on_t.append(dt_on)
            off_t.append(dt_off)
            hf_t.append(dt_hf)
            log(f"  preamble #{r}: cache on {dt_on:.2f}s  off {dt_off:.2f}s  HF {dt_hf:.2f}s")
        return dict(
            preamble_on_s=self.med(on_t),
            preamble_off_s=self.med(off_t),
            preamble_hf_s=self.med(hf_t),
            preamble=self.med(off_t) / self.med(on_t),
            preamble_vs_hf=self.med(hf_t) / self.med(on_t),
            preamble_tokens={
                k: stats[k] for k in ("prompt_tokens", "prefill_tokens", "cached_tokens", "sample_tokens")
            },
        )

    def nosharing(self, p: dict) -> dict:
        on_t, off_t = [], []
        for r in range(self.repeats * 2):  # the smallest effect: twice the repeats, alternating order
            prompts = [self.prompt(p["prompt_len"]) for _ in range(p["prompts"])]
            runs = {}
            for cache in (True, False) if r % 2 == 0 else (False, True):
                s = self.sampler(cache)
                reqs = [self.req(x, p["new"], seed=i) for i, x in enumerate(prompts)]
                runs[cache] = self.timed(lambda: s.run(reqs))[0]
            on_t.append(runs[True])
            off_t.append(runs[False])
            log(f"  no sharing #{r}: cache on {runs[True]:.2f}s  off {runs[False]:.2f}s")
        # the effect is far below the machine's noise: compare each interleaved pair
        return dict(
            nosharing_on_s=self.med(on_t),
            nosharing_off_s=self.med(off_t),
            no_sharing_overhead=self.med([a / b for a, b in zip(on_t, off_t)]) - 1,
        )


def gemm_peak_gflops(dtype: str = "float32", n: int = 1024, reps: int = 20) -> float:
    """This CPU's GEMM rate in `dtype` at the current thread count: the best of `reps` n x n x n matmuls."""
    a, b = torch.randn(n, n, dtype=getattr(torch, dtype)), torch.randn(n, n, dtype=getattr(torch, dtype))
    a @ b
    best = math.inf
    for _ in range(reps):
        t = time.perf_counter()
        a @ b
        best = min(best, time.perf_counter() - t)
    return 2 * n**3 / best / 1e9


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument(
        "--model", type=Path, help="model directory (default: the embedded SmolLM2-135M-Instruct)"
    )
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--quick", action="store_true", help="small sizes, for a smoke run")
    ap.add_argument("--json", action="store_true", help="print one JSON object on stdout")
    ap.add_argument("--threads", type=int, default=0, help="torch threads (default: torch's choice)")
    ap.add_argument("--kv-cache-mb", type=int, default=512)
    ap.add_argument("--only", nargs="*", choices=list(SIZES), help="run only these scenarios")
    ap.add_argument("--no-generate", action="store_true", help="grpo: skip the generate(n=8) baseline")
    ap.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32", help="both sides' dtype")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    model_dir = args.model
    if model_dir is None:
        from trine.engine.model.default_model import ensure_default_model

        model_dir = ensure_default_model()
    bench = Bench(
        model_dir, args.repeats, args.kv_cache_mb * 2**20, generate=not args.no_generate, dtype=args.dtype
    )
    sizes = QUICK if args.quick else SIZES
    out: dict = dict(
        model=str(model_dir),
        repeats=args.repeats,
        threads=torch.get_num_threads(),
        dtype=args.dtype,
        kernels=bench.kernels,
        quick=args.quick,
        sizes={k: sizes[k] for k in (args.only or sizes)},
    )
    warm = bench.sampler()  # warm-up: first calls pay for allocator and kernel setup
    warm.run([bench.req(bench.prompt(32), 2, 2)])
    bench.hf_generate([bench.prompt(32)], 2)
    for name in args.only or list(SIZES):
        log(f"{name}: {sizes[name]}")
        out.update(getattr(bench, name)(sizes[name]))
    emit(out, args.json)


if __name__ == "__main__":
    main()
