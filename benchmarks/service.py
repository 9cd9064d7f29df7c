"""Service benchmark: what the HTTP server adds on top of the engine, and clock cycles per step.

SmolLM2-135M-Instruct by default (`--model DIR` for any checkpoint directory), fp32 on CPU.

1. HTTP overhead: the same sample request (a GRPO-style group: one prompt, `--samples` samples,
   `--new` new tokens) through the server's actor plane vs straight on an in-process `Sampler` over
   the same weights. Both paths run interleaved, `--repeats` times, with a fresh random prompt each
   repeat (so neither path gets prefix-cache hits the other does not); ratio = median(HTTP) /
   median(engine), target <= 1.10.
2. Clock cycles per training step, read from the `cycle` stamped on every event response:
   pipelined (submit forward_backward and optim_step, then wait for both) vs naive (wait for each
   call before sending the next). Target: 1.0 vs >= 2.

    .venv/bin/python benchmarks/service.py [--repeats 7] [--steps 6] [--json] [--model DIR]
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

from trine.engine.setup import configure

configure()  # before torch loads: the engine's OpenMP wait and allocator, as under `trine serve`

# isort: split

import httpx
import msgpack
import torch
from report import record  # benchmarks/report.py

from trine.engine.api import SampleRequest, SamplingOptions, WeightsIdentity
from trine.engine.config import EngineConfig
from trine.engine.model.tokenizer import Tokenizer
from trine.engine.model.weights import load_model
from trine.engine.sampler.sampler import Sampler
from trine.server.app import start_server


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


class Wire:
    """A minimal PyTRIO wire client (control JSON + actor msgpack)."""

    def __init__(self, url: str, key: str):
        self.http = httpx.Client(base_url=url, timeout=300, trust_env=False, headers={"X-API-Key": key})
        self.session = self.post("service-sessions", {"sdk_version": "bench"})["service_session_cuid"]
        self.n = 0

    def post(self, path: str, body: dict) -> dict:
        r = self.http.post(f"/api/openapi/v1/{path}", json=body)
        r.raise_for_status()
        return r.json()

    def sampler(self, model: str) -> dict:
        return self.post(
            f"service-sessions/{self.session}/sampling-runs",
            {"base_model": model, "source_checkpoint_uri": ""},
        )

    def sample(self, srun: dict, body: dict) -> dict:
        r = self.http.post(
            f"{srun['actor']['endpoint']}/v1/sampling-runs/{srun['sampling_run_cuid']}/sample",
            json=body,
            headers={"Authorization": f"Bearer {srun['actor_jwt']['token']}"},
        )
        r.raise_for_status()
        return r.json()

    def trainer(self, model: str) -> dict:
        run = self.post(
            f"service-sessions/{self.session}/training-runs",
            {
                "base_model": model,
                "lora_rank": 16,
                "train_mlp": True,
                "train_attn": True,
                "train_unembed": True,
                "source_checkpoint_uri": "",
                "restore_optimizer": False,
            },
        )
        run["index"] = 0
        self.wait(
            run,
            self.submit(
                run,
                "init_run",
                {
                    "base_model": run["model_id"],
                    "load_optimizer": False,
                    "lora_config": {"rank": 16, "train_mlp": True, "train_attn": True, "train_unembed": True},
                },
            ),
        )
        return run

    def submit(self, run: dict, type_: str, payload: dict) -> str:
        run["index"] += 1
        self.n += 1
        event_id = f"event_{self.n:012d}"
        body = msgpack.packb(
            {
                "version": 1,
                "event_id": event_id,
                "type": f"trainer.{type_}",
                "metadata": {
                    "index": run["index"],
                    "step": 0,
                    "timestamp": 0,
                    "sdk": "bench",
                    "sdk_version": "0",
                    "run_id": run["training_run_cuid"],
                },
                "payload": payload,
            },
            use_bin_type=True,
        )
        r = self.http.post(
            f"{run['actor']['endpoint']}/v1/events",
            content=body,
            headers={
                "Authorization": f"Bearer {run['actor_jwt']['token']}",
                "Content-Type": "application/msgpack",
            },
        )
        r.raise_for_status()
        return event_id

    def wait(self, run: dict, event_id: str) -> dict:
        while True:
            r = self.http.get(
                f"{run['actor']['endpoint']}/v1/events/{event_id}",
                headers={"Authorization": f"Bearer {run['actor_jwt']['token']}", "Prefer": "wait=60"},
            )
            r.raise_for_status()
            ev = msgpack.unpackb(r.content)
            if ev["status"] == "failed":
                raise RuntimeError(ev["error"])
            if ev["status"] == "succeeded":
                return ev


def bench_http_overhead(url: str, key: str, model_dir: Path, name: str, args) -> dict:
    wire = Wire(url, key)
    srun = wire.sampler(name)
    model = load_model(model_dir, "cpu", torch.float32)
    sampler = Sampler(model, Tokenizer(model_dir))
    rng = random.Random(0)
    opts = SamplingOptions(max_tokens=args.new, temperature=1.0, seed=1)  # as the server builds it
    http_t, engine_t = [], []
    for rep in range(args.repeats + 1):  # the first round warms both paths up and is dropped
        for path in ("http", "engine") if rep % 2 else ("engine", "http"):
            prompt = [rng.randrange(100, 40000) for _ in range(args.prompt)]
            t = time.perf_counter()
            if path == "http":
                out = wire.sample(
                    srun,
                    {
                        "request_id": f"req_{rep}_{path}",
                        "prompt": {"chunks": [{"type": "encoded_text", "tokens": prompt}]},
                        "sampling_params": {"max_tokens": args.new, "temperature": 1.0, "seed": 1},
                        "num_samples": args.samples,
                    },
                )
                assert len(out["sequences"]) == args.samples
            else:
                sampler.run(
                    [SampleRequest(f"r{rep}", prompt, opts, WeightsIdentity(name), num_samples=args.samples)]
                )
            dt = time.perf_counter() - t
            if rep:
                (http_t if path == "http" else engine_t).append(dt)
    h, e = statistics.median(http_t), statistics.median(engine_t)
    log(
        f"sample {args.samples}x{args.new} tokens, {args.prompt}-token prompt: "
        f"HTTP {h * 1000:.1f} ms, engine {e * 1000:.1f} ms (medians of {args.repeats})"
    )
    return {"http_ms": h * 1000, "engine_ms": e * 1000, "http_overhead": h / e}


def bench_cycles(url: str, key: str, name: str, args) -> dict:
    wire = Wire(url, key)
    rng = random.Random(1)
    adam = {
        "adam_params": {
            "learning_rate": 1e-4,
            "beta1": 0.9,
            "beta2": 0.95,
            "eps": 1e-12,
            "weight_decay": 0.0,
            "grad_clip_norm": 0.0,
        }
    }

    def batch():
        tokens = [rng.randrange(100, 40000) for _ in range(args.train_len)]
        return {
            "data": [
                {
                    "model_input": {"chunks": [{"type": "encoded_text", "tokens": tokens}]},
                    "target_ids": tokens[1:] + [2],
                    "weights": [1.0] * len(tokens),
                }
            ],
            "auto_shift": False,
            "loss": {"type": "cross_entropy", "config": {}},
            "gradient_accumulation": {
                "total_samples": 1,
                "total_active_tokens": len(tokens),
                "total_advantage_tokens": 0,
            },
        }

    out = {}
    for mode in ("pipelined", "naive"):
        run = wire.trainer(name)
        cycles = set()
        t = time.perf_counter()
        for _ in range(args.steps):
            if mode == "pipelined":
                ids = [wire.submit(run, "forward_backward", batch()), wire.submit(run, "optimize_step", adam)]
                evs = [wire.wait(run, i) for i in ids]
            else:
                evs = [wire.wait(run, wire.submit(run, "forward_backward", batch()))]
                evs.append(wire.wait(run, wire.submit(run, "optimize_step", adam)))
            cycles.update(ev["cycle"] for ev in evs)
        dt = time.perf_counter() - t
        out[f"cycles_per_step_{mode}"] = len(cycles) / args.steps
        out[f"seconds_per_step_{mode}"] = dt / args.steps
        log(f"{mode}: {len(cycles)} cycles for {args.steps} steps, {dt / args.steps * 1000:.0f} ms/step")
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", type=Path, default=None)
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--prompt", type=int, default=128)
    ap.add_argument("--samples", type=int, default=4)
    ap.add_argument("--new", type=int, default=32)
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--train-len", type=int, default=128)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.model is None:
        from trine.engine.model.default_model import ensure_default_model

        args.model = ensure_default_model()
    name = args.model.name
    with tempfile.TemporaryDirectory() as home:
        engine = EngineConfig(num_threads=args.threads or torch.get_num_threads(), device="cpu")
        srv = start_server([args.model], home=home, engine=engine)
        try:
            result = bench_http_overhead(srv.url, srv.api_key, args.model, name, args)
            result.update(bench_cycles(srv.url, srv.api_key, name, args))
        finally:
            srv.stop()
    record(result)  # benchmarks/results/service.jsonl
    if args.json:
        print(
            json.dumps(
                {
                    k: result[k]
                    for k in ("http_overhead", "cycles_per_step_pipelined", "cycles_per_step_naive")
                }
            )
        )
    else:
        for k, v in result.items():
            print(f"{k}: {v:.3f}")


if __name__ == "__main__":
    main()
