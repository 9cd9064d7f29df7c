"""One side of benchmarks/vs_vllm.py: trine's Sampler or vLLM's offline `LLM`, driven over a pipe.

    python benchmarks/vs_vllm_side.py {trine|vllm} --model DIR --threads N --kv-gib G --reply-fd FD

The trine side runs in trine's venv, the vLLM side in `.venv-vllm` (vLLM pins its own
transformers), each in its own process; the driver sends one JSON command a line on stdin and
reads one JSON reply a line on file descriptor FD (stdout and stderr are left to the engines'
logs). Commands:

- {"op": "generate", "prompts": [[ids]], "n": k, "new": m}: every prompt sampled k times, exactly m
  new tokens each (temperature 1, no EOS stop), from an empty prefix cache. Reply: seconds, and
  the token counts: prompt tokens (per sequence for vLLM, whose `n` fans out into k requests;
  per request for trine, whose prompt is prefilled once per request), cached prompt tokens,
  sampled tokens and sequences.
- {"op": "multiturn", "first": [ids], "users": [[ids]], "new": m}: a conversation; each turn's
  prompt is the previous prompt + its own completion (m tokens) + the next user turn. A turn's
  time to first token is the time of a one-token request on its prompt, on the engine that
  served the earlier turns; then the m-token completion is generated (not timed). Reply: the TTFT
  of turns 2.. and their prompt and cached tokens.
- {"op": "gemm_peak"}: this process's best fp32 GEMM rate (GFLOP/s), torch matmul 1024^3.
- {"op": "quit"}.

Invariant: both sides see the same prompts, the same sampling settings, the same thread count
and the same KV budget; each side keeps one engine, as a server does, and a `generate` (a
conversation) starts from an empty prefix cache on both (`reset_prefix_cache` on both), and only
the engine's own call is timed.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from pathlib import Path


def gemm_peak_gflops(dtype: str = "float32", n: int = 1024, reps: int = 20) -> float:
    """As benchmarks/sampler.py's (this side may run in vLLM's venv, without trine)."""
    import torch

    a, b = torch.randn(n, n, dtype=getattr(torch, dtype)), torch.randn(n, n, dtype=getattr(torch, dtype))
    a @ b
    best = math.inf
    for _ in range(reps):
        t = time.perf_counter()
        a @ b
        best = min(best, time.perf_counter() - t)
    return 2 * n**3 / best / 1e9


class TrineSide:
    def __init__(self, model_dir: Path, threads: int, kv_gib: float, dtype: str):
        from trine.engine.setup import configure, openmp_wait

        configure()  # before torch: it sets how OpenMP's threads wait

        # isort: split
        import torch

        torch.set_num_threads(threads)
        from trine.engine.api import WeightsIdentity
        from trine.engine.model.kernels.active import active
        from trine.engine.model.lora import linear_shapes
        from trine.engine.model.tokenizer import Tokenizer
        from trine.engine.model.weights import load_model

        self.model = load_model(model_dir, "cpu", getattr(torch, dtype))
        # the kernels an engine's start builds and chooses (C kernels, the measured GEMM path), as
        # `trine serve` runs them: without this every few-row GEMM would take the unmeasured default
        kernels = active(self.model.device, self.model.dtype, linear_shapes(self.model))
        self.tok = Tokenizer(model_dir)
        self.kv_bytes = int(kv_gib * 2**30)
        self.weights = WeightsIdentity("bench")
        self.n = 0
        self._sampler = None
        self.info = dict(
            engine="trine", threads=torch.get_num_threads(), openmp_wait=openmp_wait(), kernels=kernels
        )

    def sampler(self):
        """The side's one Sampler (its KV pool allocated once, as in a server), its cache emptied."""
        from trine.engine.config import SamplerConfig
        from trine.engine.sampler.sampler import Sampler

        if self._sampler is None:
            self._sampler = Sampler(
                self.model, self.tok, SamplerConfig(kv_cache_bytes=self.kv_bytes, enable_prefix_cache=True)
            )
        self._sampler.reset_prefix_cache()
        return self._sampler

    def request(self, prompt: list[int], n: int, new: int):
        from trine.engine.api import SampleRequest, SamplingOptions

        self.n += 1
        opts = SamplingOptions(max_tokens=new, temperature=1.0, seed=self.n, stop_at_eos=False)
        return SampleRequest(f"r{self.n}", prompt, opts, self.weights, num_samples=n)

    def generate(self, prompts: list[list[int]], n: int, new: int) -> dict:
        s = self.sampler()
        reqs = [self.request(p, n, new) for p in prompts]
        before = s.stats
        t = time.perf_counter()
        res = s.run(reqs)
        dt = time.perf_counter() - t
        st = {k: v - before[k] for k, v in s.stats.items() if isinstance(v, int)}
        return dict(
            seconds=dt,
            prompt_tokens=st["prompt_tokens"],
            cached_tokens=st["cached_tokens"],
            sample_tokens=st["sample_tokens"],
            sequences=sum(len(r.sequences) for r in res),
            steps=st["steps"],
        )

    def turn(self, state, prompt: list[int], new: int):
        s = state if state is not None else self.sampler()
        t = time.perf_counter()
        first = s.run([self.request(prompt, 1, 1)])[0]
        dt = time.perf_counter() - t
        completion = s.run([self.request(prompt, 1, new)])[0].sequences[0].tokens
        return dt, first.usage.cached_tokens, completion, s


class VllmSide:
    def __init__(self, model_dir: Path, threads: int, kv_gib: float, max_model_len: int, dtype: str):
        from vllm import LLM

        # An empty prefix cache per generate, stats on for the token counters, trine's dtype.
        self.llm = LLM(
            model=str(model_dir),
            dtype=dtype,
            enable_prefix_caching=True,
            seed=0,
            max_model_len=max_model_len,
            disable_log_stats=False,
        )
        sched = self.llm.llm_engine.vllm_config.scheduler_config
        self.info = dict(
            engine="vllm",
            version=__import__("vllm").__version__,
            max_num_seqs=sched.max_num_seqs,
            max_num_batched_tokens=sched.max_num_batched_tokens,
            omp_threads_bind=os.environ.get("VLLM_CPU_OMP_THREADS_BIND"),
        )

    def counters(self) -> dict:
        names = {
            "vllm:prompt_tokens": "prompt_tokens",
            "vllm:prompt_tokens_cached": "cached_tokens",
            "vllm:generation_tokens": "sample_tokens",
        }
        out = dict.fromkeys(names.values(), 0)
        for m in self.llm.get_metrics():
            if m.name in names:
                out[names[m.name]] += int(getattr(m, "value", 0))
        return out

    def run(self, prompts: list[list[int]], n: int, new: int):
        from vllm import SamplingParams

        sp = SamplingParams(n=n, temperature=1.0, max_tokens=new, min_tokens=new, ignore_eos=True)
        return self.llm.generate([{"prompt_token_ids": p} for p in prompts], sp, use_tqdm=False)

    def generate(self, prompts: list[list[int]], n: int, new: int) -> dict:
        self.llm.reset_prefix_cache()
        before = self.counters()
        t = time.perf_counter()
        outs = self.run(prompts, n, new)
        dt = time.perf_counter() - t
        after = self.counters()
        got = {k: after[k] - before[k] for k in after}
        seqs = sum(len(o.outputs) for o in outs)
        assert sum(len(c.token_ids) for o in outs for c in o.outputs) == seqs * new
        return dict(
            seconds=dt, **got, sequences=seqs, num_cached_tokens=sum(o.num_cached_tokens or 0 for o in outs)
        )

    def turn(self, state, prompt: list[int], new: int):
        if state is None:
            self.llm.reset_prefix_cache()
        t = time.perf_counter()
        first = self.run([prompt], 1, 1)[0]
        dt = time.perf_counter() - t
        completion = list(self.run([prompt], 1, new)[0].outputs[0].token_ids)
        return dt, first.num_cached_tokens or 0, completion, True


def multiturn(side, first: list[int], users: list[list[int]], new: int) -> dict:
    prompt, state, ttft, cached, prompt_tokens = list(first), None, [], 0, 0
    for turn in range(len(users) + 1):
        dt, hit, completion, state = side.turn(state, prompt, new)
        if turn > 0:
            ttft.append(dt)
            cached += hit
            prompt_tokens += len(prompt)
        if turn < len(users):
            prompt = prompt + completion + users[turn]
    return dict(ttft=ttft, seconds=sum(ttft), prompt_tokens=prompt_tokens, cached_tokens=cached)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("engine", choices=("trine", "vllm"))
    ap.add_argument("--model", type=Path, required=True)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--kv-gib", type=float, default=2)
    ap.add_argument("--max-model-len", type=int, default=2048)
    ap.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32")
    ap.add_argument("--reply-fd", type=int, required=True)
    args = ap.parse_args()
    reply = os.fdopen(args.reply_fd, "w")
    t = time.perf_counter()
    if args.engine == "trine":
        side = TrineSide(args.model, args.threads, args.kv_gib, args.dtype)
    else:
        side = VllmSide(args.model, args.threads, args.kv_gib, args.max_model_len, args.dtype)
    reply.write(json.dumps(dict(side.info, startup_s=time.perf_counter() - t)) + "\n")
    reply.flush()
    for line in sys.stdin:
        cmd = json.loads(line)
        op = cmd.pop("op")
        if op == "quit":
            break
        if op == "generate":
            out = side.generate(**cmd)
        elif op == "multiturn":
            out = multiturn(side, **cmd)
        elif op == "gemm_peak":
            out = dict(gflops=gemm_peak_gflops(args.dtype))
        else:
            raise ValueError(f"unknown op {op!r}")
        reply.write(json.dumps(out) + "\n")
        reply.flush()


if __name__ == "__main__":  # vLLM spawns its engine process: this module must not run on import
    main()
