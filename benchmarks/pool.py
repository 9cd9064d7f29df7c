"""Engine pool benchmark: Ray replicas, prefix-aware routing, and the cost of the Ray hop.

A sampling workload of many concurrent requests whose prompts share a few system prompts (each
request: one of `--system-prompts` system prompts of `--system-len` tokens + a random user turn of
`--user-len` tokens; `--new` new tokens; fixed seeds), sent `--concurrency` at a time through the
service API (`Service.sample`, no HTTP). Every round uses fresh system prompts, so each starts cold.
SmolLM2-135M-Instruct by default (`--model DIR` for any other), fp32 on CPU, 1 torch thread per
engine. Configurations run interleaved, round by round; figures are medians over `--rounds`.

- replicas2_vs_1: requests/s with 2 Ray replicas x 1 thread over 1 Ray replica x 1 thread;
  replicas2_vs_1_rounds: that ratio in each round (its configurations ran back to back), its
  _min, _median and _max over the rounds, and replicas2_vs_1_spread: max - min, so an unstable
  gain shows as such; rps_one_replica_rounds and rps_two_replicas_rounds: each side in each
  round, to tell which side moved.
- Where the CPU goes (CPU-seconds, fairer than wall time on a shared machine): cpu_one_replica_rounds
  and cpu_two_replicas_rounds: each replica process's CPU-seconds per round; driver_cpu_ms_per_request:
  this process (service, router, Ray client) per request; cores_one_replica / cores_two_replicas: the
  replicas' CPU-seconds over the round's wall time (how much of the machine they got);
  cpu_two_over_one: the two replicas' CPU-seconds together over the one replica's for the same work;
  replicas2_vs_1_ceiling: the one replica's CPU-seconds over the busier of the two (the gain on 2
  cores nobody else wants).
- routed_cached_fraction / random_cached_fraction / single_cached_fraction: prompt tokens served
  from the prefix cache with prefix-aware routing over 2 replicas, random routing over 2 replicas,
  and one replica (the ceiling).
- ray_vs_inproc: latency of one sample request (`--latency-prompt` tokens, `--new` new tokens,
  4 samples) through one Ray replica over the in-process engine thread; ray_hop_ms: the round trip
  of a call that does no model work (`Engine.stats()`) to a Ray replica.

    .venv/bin/python benchmarks/pool.py [--rounds 3] [--requests 48] [--json] [--model DIR] \
        [--shared-session]   # replicas in the raylet's session, as before issue 32
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

from report import record  # benchmarks/report.py

from trine.engine.setup import configure

configure()  # before torch loads with the engine: its OpenMP wait, as under `trine serve`

# isort: split

from trine.engine.api import SampleRequest, SamplingOptions  # noqa: E402
from trine.engine.config import EngineConfig, SamplerConfig  # noqa: E402
from trine.engine.runtime.local import LocalEngine  # noqa: E402
from trine.engine.runtime.ray_backend import connect, ray_engines  # noqa: E402
from trine.service import SamplingRunSpec, Service  # noqa: E402
from trine.service.routing import Router  # noqa: E402
from trine.store import Store  # noqa: E402

ENGINE = EngineConfig(device="cpu", num_threads=1, sampler=SamplerConfig(kv_cache_bytes=256 << 20))


def _own_cpu() -> float:
    t = os.times()
    return t.user + t.system


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


class Config:
    """One service over its own engines, with a key and a sampling run."""

    def __init__(self, name: str, model: Path, home: Path, engines, router: Router | None = None):
        self.name = name
        store = Store(home / name)
        _, self.secret = store.create_key("bench")
        self.svc = Service(store, {model.name: model}, engines=engines, router=router)
        self.model = model.name

    async def start(self) -> None:
        await self.svc.start()
        self.key = self.svc.authenticate(self.secret)
        session = self.svc.runs.create_session(self.key, "bench")
        self.run = self.svc.runs.create_sampling_run(self.key, session.id, SamplingRunSpec(self.model))

    async def workload(self, rnd: int, args) -> dict:
        rng = random.Random(rnd)
        systems = [
            [rng.randrange(100, 40000) for _ in range(args.system_len)] for _ in range(args.system_prompts)
        ]
        prompts = [
            systems[i % len(systems)] + [rng.randrange(100, 40000) for _ in range(args.user_len)]
            for i in range(args.requests)
        ]
        opts = dict(max_tokens=args.new, temperature=1.0, seed=rnd, stop_at_eos=False)
        gate = asyncio.Semaphore(args.concurrency)

        async def one(i, prompt):
            async with gate:
                return await self.svc.sampling.sample(
                    self.key, self.run.id, SampleRequest(f"w{rnd}-{i}", prompt, SamplingOptions(**opts))
                )

        cpu0, me0 = await self.replica_cpu(), _own_cpu()
        t = time.perf_counter()
        outs = await asyncio.gather(*(one(i, p) for i, p in enumerate(prompts)))
        dt = time.perf_counter() - t
        cpu = [b - a for a, b in zip(cpu0, await self.replica_cpu())]
        cached = sum(o.usage["cached_tokens"] for o in outs)
        total = sum(o.usage["prompt_tokens"] for o in outs)
        return {
            "rps": len(outs) / dt,
            "cached_fraction": cached / total,
            "replica_cpu_s": cpu,
            "cores": sum(cpu) / dt,
            "driver_cpu_ms_per_request": (_own_cpu() - me0) * 1000 / len(outs),
        }

    async def replica_cpu(self) -> list[float]:
        """CPU-seconds each Ray replica process has used so far (empty for in-process engines)."""
        engines = [r.engine for r in self.svc.models[self.model].replicas]
        return [(await e.process())["cpu_s"] for e in engines if hasattr(e, "process")]

    async def latency(self, rnd: int, args) -> float:
        rng = random.Random(10_000 + rnd)
        prompt = [rng.randrange(100, 40000) for _ in range(args.latency_prompt)]
        spec = SampleRequest(
            f"l{rnd}",
            prompt,
            SamplingOptions(args.new, temperature=1.0, seed=1, stop_at_eos=False),
            num_samples=4,
        )
        t = time.perf_counter()
        await self.svc.sampling.sample(self.key, self.run.id, spec)
        return time.perf_counter() - t


async def run(args, model: Path, home: Path) -> dict:
    opts = dict(new_session=not args.shared_session)
    configs = {
        "one": Config("one", model, home, ray_engines(1, ENGINE, **opts)),
        "routed": Config("routed", model, home, ray_engines(2, ENGINE, **opts), Router()),
        "inproc": Config("inproc", model, home, lambda name, path: [LocalEngine(name, path, ENGINE)]),
    }
    for c in configs.values():
        await c.start()
    for c in configs.values():  # warm-up, dropped: 4 requests at once reach every replica
        await asyncio.gather(*(c.latency(-1 - i, args) for i in range(4)))
    res = {k: [] for k in ("one", "routed", "random")}
    lat = {"one": [], "inproc": []}
    pool = configs["routed"].svc.sampling  # "random": the same two replicas, routed at random
    for rnd in range(args.rounds):
        order = ["one", "routed", "random"] if rnd % 2 == 0 else ["random", "routed", "one"]
        for name in order:
            pool.router = Router("random", seed=rnd) if name == "random" else Router()
            config = configs["routed" if name == "random" else name]
            seed = rnd + 1000 if name == "random" else rnd  # its own system prompts: a cold cache
            res[name].append(await config.workload(seed, args))
            log(f"round {rnd} {name} (load {os.getloadavg()[0]:.1f}): {res[name][-1]}")
        for name in ["one", "inproc"] if rnd % 2 == 0 else ["inproc", "one"]:
            for rep in range(args.latency_repeats):
                lat[name].append(await configs[name].latency(rnd * 100 + rep, args))
    engine = configs["one"].svc.models[model.name].replicas[0].engine
    hops = []
    for _ in range(20):
        t = time.perf_counter()
        await engine.stats()
        hops.append(time.perf_counter() - t)
    for c in configs.values():
        await c.svc.stop()

    def med(name, field):
        return statistics.median(r[field] for r in res[name])

    per_round = [two["rps"] / one["rps"] for one, two in zip(res["one"], res["routed"])]
    pairs = list(zip(res["one"], res["routed"]))
    return {
        "replicas2_vs_1": med("routed", "rps") / med("one", "rps"),
        "replicas2_vs_1_rounds": [round(x, 3) for x in per_round],
        "replicas2_vs_1_min": min(per_round),
        "replicas2_vs_1_median": statistics.median(per_round),
        "replicas2_vs_1_max": max(per_round),
        "replicas2_vs_1_spread": max(per_round) - min(per_round),
        "rps_one_replica": med("one", "rps"),
        "rps_two_replicas": med("routed", "rps"),
        "rps_one_replica_rounds": [round(r["rps"], 3) for r in res["one"]],
        "rps_two_replicas_rounds": [round(r["rps"], 3) for r in res["routed"]],
        "cpu_one_replica_rounds": [[round(c, 2) for c in r["replica_cpu_s"]] for r in res["one"]],
        "cpu_two_replicas_rounds": [[round(c, 2) for c in r["replica_cpu_s"]] for r in res["routed"]],
        "cores_one_replica": med("one", "cores"),
        "cores_two_replicas": med("routed", "cores"),
        "cpu_two_over_one": statistics.median(
            sum(two["replica_cpu_s"]) / sum(one["replica_cpu_s"]) for one, two in pairs
        ),
        "replicas2_vs_1_ceiling": statistics.median(
            sum(one["replica_cpu_s"]) / max(two["replica_cpu_s"]) for one, two in pairs
        ),
        "driver_cpu_ms_per_request": med("routed", "driver_cpu_ms_per_request"),
        "routed_cached_fraction": med("routed", "cached_fraction"),
        "random_cached_fraction": med("random", "cached_fraction"),
        "single_cached_fraction": med("one", "cached_fraction"),
        "ray_vs_inproc": statistics.median(lat["one"]) / statistics.median(lat["inproc"]),
        "ray_ms": statistics.median(lat["one"]) * 1000,
        "inproc_ms": statistics.median(lat["inproc"]) * 1000,
        "ray_hop_ms": statistics.median(hops) * 1000,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", type=Path, default=None)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--requests", type=int, default=48)
    ap.add_argument("--concurrency", type=int, default=16)
    ap.add_argument("--system-prompts", type=int, default=4)
    ap.add_argument("--system-len", type=int, default=192)
    ap.add_argument("--user-len", type=int, default=24)
    ap.add_argument("--new", type=int, default=16)
    ap.add_argument("--latency-prompt", type=int, default=128)
    ap.add_argument("--latency-repeats", type=int, default=3)
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--shared-session", action="store_true", help="replicas in the raylet's session")
    args = ap.parse_args()
    if args.model is None:
        from trine.engine.model.default_model import ensure_default_model

        args.model = ensure_default_model()
    # 3 actors (1 + 2 replicas), 1 torch thread each; only one configuration works at a time
    connect(None, num_cpus=3)
    import ray

    try:
        with tempfile.TemporaryDirectory() as home:
            result = asyncio.run(run(args, args.model.resolve(), Path(home)))
    finally:
        ray.shutdown()
    result["shared_session"] = int(args.shared_session)
    record(result)  # benchmarks/results/pool.jsonl
    if args.json:
        print(json.dumps({k: v if isinstance(v, list) else round(v, 4) for k, v in result.items()}))
    else:
        for k, v in result.items():
            print(f"{k:24s} {v}" if isinstance(v, list) else f"{k:24s} {v:.3f}")


if __name__ == "__main__":
    main()
