"""Fairness benchmark: one key floods the sampler, another key's short requests keep their latency.

SmolLM2-135M-Instruct by default (`--model DIR` for any checkpoint directory), fp32 on CPU, one
engine. Key A runs `--flood` concurrent sampling clients (each: a 32-token prompt, 1 sample,
`--flood-tokens` new tokens, one request after another). Key B sends one short request (16-token
prompt, 8 new tokens, greedy) every `--every` seconds. Phases alternate `--rounds` times: A alone,
then A with B (`--seconds` each), so both throughputs come from the same run.

Reported (`--json`):
- victim_p50_slowdown, victim_p99_slowdown: B's latency under the flood / B's median latency on the
  idle server (goal: p99 <= 3);
- flood_throughput_vs_alone: A's generated tokens per second with B / without B, the median over
  rounds (goal: >= 0.9, A loses at most 10 %);
- lost, doubled: requests never metered / metered twice, read from the server's usage store (0, 0).
`--fifo` runs the same with first-come-first-served admission and no per-key share (the baseline).

    .venv/bin/python benchmarks/fairness.py [--json] [--flood 200] [--seconds 20] [--rounds 2] [--fifo]
"""
from __future__ import annotations

import argparse
import collections
import json
import random
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx
import torch

from service import Wire  # benchmarks/service.py: the minimal PyTRIO wire client
from trine.server.app import start_server
from trine.store import Store


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def pct(values: list[float], q: float) -> float:
    v = sorted(values)
    return v[min(len(v) - 1, int(q * len(v)))] if v else float("nan")


class Clients:
    def __init__(self, url: str, model: str, args):
        self.url, self.model, self.args = url, model, args
        self.phase = "idle"
        self.stop = threading.Event()
        self.lock = threading.Lock()
        self.tokens: dict[str, int] = collections.Counter()  # phase -> A's tokens finished in it
        self.victim: dict[str, list[float]] = collections.defaultdict(list)  # phase -> B's latencies
        self.sent: list[str] = []
        self.failures: list[str] = []

    def wire(self, key: str, number: int) -> tuple[Wire, dict]:
        c = Wire(self.url, key)
        c.http.timeout = httpx.Timeout(600)
        c.n = number * 10**8
        return c, c.sampler(self.model)

    def request(self, c: Wire, srun: dict, rid: str, prompt: list[int], max_tokens: int, **params) -> dict | None:
        body = {"request_id": rid, "prompt": {"chunks": [{"type": "encoded_text", "tokens": prompt}]},
                "sampling_params": {"max_tokens": max_tokens, **params}, "num_samples": 1}
        with self.lock:
            self.sent.append(f"{srun['sampling_run_cuid']}/{rid}")
        try:
            return c.sample(srun, body)
        except Exception as e:
            with self.lock:
                self.failures.append(f"{rid}: {e}")
            return None

    def flood(self, key: str, i: int) -> None:
        c, srun = self.wire(key, 100 + i)
        rng = random.Random(i)
        n = 0
        while not self.stop.is_set():
            n += 1
            out = self.request(c, srun, f"a{i}-{n}", [rng.randrange(100, 40000) for _ in range(32)],
                               self.args.flood_tokens, temperature=1.0, seed=n)
            if out is not None:
                with self.lock:
                    self.tokens[self.phase] += sum(len(s["tokens"]) for s in out["sequences"])

    def probe(self, c: Wire, srun: dict, n: int) -> float:
        rng = random.Random(10**6 + n)
        t = time.perf_counter()
        self.request(c, srun, f"b{n}", [rng.randrange(100, 40000) for _ in range(16)], 8, temperature=0.0)
        return time.perf_counter() - t

    def victim_loop(self, c: Wire, srun: dict, until: float, n0: int) -> int:
        n = n0
        while time.monotonic() < until:
            n += 1
            start = time.monotonic()
            phase = self.phase
            self.victim[phase].append(self.probe(c, srun, n))
            time.sleep(max(0.0, self.args.every - (time.monotonic() - start)))
        return n


def run(url: str, key_a: str, key_b: str, model: str, args) -> dict:
    cl = Clients(url, model, args)
    b, b_run = cl.wire(key_b, 1)
    idle = [cl.probe(b, b_run, n) for n in range(args.idle_probes + 1)][1:]  # the first warms up
    log(f"B idle: {statistics.median(idle):.3f} s")
    threads = [threading.Thread(target=cl.flood, args=(key_a, i), daemon=True) for i in range(args.flood)]
    for t in threads:
        t.start()
    cl.phase = "warmup"
    time.sleep(args.warmup)
    rates: dict[str, list[float]] = collections.defaultdict(list)
    n = 100
    for r in range(args.rounds):
        for phase in ("alone", "shared"):
            label = f"{phase}{r}"
            with cl.lock:
                cl.phase = label
            t0 = time.monotonic()
            if phase == "shared":
                n = cl.victim_loop(b, b_run, t0 + args.seconds, n)
            else:
                time.sleep(args.seconds)
            rates[phase].append(cl.tokens[label] / (time.monotonic() - t0))
            log(f"{label}: A {rates[phase][-1]:.1f} tokens/s; B {len(cl.victim.get(label, []))} requests")
    cl.phase = "drain"
    cl.stop.set()
    for t in threads:
        t.join(600)

    store = Store(args.home)
    metered = collections.Counter(f"{u.run_id}/{u.request_id}" for k in store.keys()
                                  for u in store.usage_events(k.id))
    store.close()
    victim = [s for ph, v in cl.victim.items() if ph.startswith("shared") for s in v]
    base = statistics.median(idle)
    ratios = [s / a for s, a in zip(rates["shared"], rates["alone"]) if a]
    return {
        "victim_p50_slowdown": statistics.median(victim) / base if victim else float("nan"),
        "victim_p99_slowdown": pct(victim, 0.99) / base,
        "flood_throughput_vs_alone": statistics.median(ratios) if ratios else float("nan"),
        "lost": sum(1 for s in cl.sent if metered[s] == 0),
        "doubled": sum(1 for s in cl.sent if metered[s] > 1),
        "victim_idle_s": base, "victim_p50_s": statistics.median(victim) if victim else float("nan"),
        "victim_p99_s": pct(victim, 0.99), "victim_requests": len(victim),
        "flood_tokens_per_s_alone": rates["alone"], "flood_tokens_per_s_shared": rates["shared"],
        "flood_clients": args.flood, "admission": "fifo" if args.fifo else "fair",
        "failures": cl.failures[:5],
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", type=Path, default=None)
    ap.add_argument("--flood", type=int, default=200)
    ap.add_argument("--flood-tokens", type=int, default=32)
    ap.add_argument("--seconds", type=float, default=20.0)
    ap.add_argument("--warmup", type=float, default=10.0)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--every", type=float, default=1.0)
    ap.add_argument("--idle-probes", type=int, default=5)
    ap.add_argument("--max-running", type=int, default=64)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--fifo", action="store_true", help="first-come-first-served admission, no per-key share")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    if args.model is None:
        from trine.engine.default_model import ensure_default_model
        args.model = ensure_default_model()
    threads = args.threads or torch.get_num_threads()
    options = {"kv_cache_bytes": 1 << 30, "max_running": args.max_running}
    if args.fifo:
        options.update(fair=False, tenant_share=1.0)
    with tempfile.TemporaryDirectory() as home:
        args.home = home
        srv = start_server([args.model], home=home, num_threads=threads, device="cpu", sampler_options=options)
        try:
            _, key_b = srv.service.store.create_key("victim")
            result = run(srv.url, srv.api_key, key_b, args.model.name, args)
        finally:
            srv.stop()
    print(json.dumps(result) if args.json else "\n".join(f"{k}: {v}" for k, v in result.items()))


if __name__ == "__main__":
    main()
