"""Fairness benchmark: one key floods the sampler, another key's short requests keep their latency.

SmolLM2-135M-Instruct by default (`--model DIR` for any checkpoint directory), fp32 on CPU, one
engine. Key A runs `--flood` concurrent sampling clients (each: a 32-token prompt, 1 sample,
`--flood-tokens` new tokens, one request after another). Key B sends one short request (16-token
prompt, 8 new tokens, greedy) every `--every` seconds. Phases alternate `--rounds` times: A alone,
then A with B (`--seconds` each), so both throughputs come from the same run; B's idle latency is
measured last, on the drained server. A and B each run in their own process, as real clients
would, so their threads do not share the server's interpreter.

Reported (`--json`):
- victim_p50_slowdown, victim_p99_slowdown: B's latency under the flood / B's median latency on the
  idle server (goal: p99 <= 3);
- flood_throughput_vs_alone: A's generated tokens per second with B / without B, the median over
  rounds (goal: >= 0.9, A loses at most 10 %); only the first alone phase has never seen B (see
  `run`), so the default is one round;
- lost, doubled: requests never metered / metered twice, read from the server's usage store (0, 0).
`--fifo` runs the same with first-come-first-served admission and no per-key share (the baseline).

    .venv/bin/python benchmarks/fairness.py [--json] [--flood 200] [--seconds 30] [--rounds 1]
    [--tenant-share 0.5] [--fifo]
"""

from __future__ import annotations

import argparse
import collections
import json
import multiprocessing as mp
import random
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

from trine.engine.setup import configure

configure()  # before torch loads: the engine's OpenMP wait and allocator, as under `trine serve`

# isort: split

import httpx
import torch
from report import record  # benchmarks/report.py
from service import Wire  # benchmarks/service.py: the minimal PyTRIO wire client

from trine.engine.config import TENANT_SHARE, EngineConfig, SamplerConfig
from trine.server.app import start_server
from trine.store import Store


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def pct(values: list[float], q: float) -> float:
    v = sorted(values)
    return v[min(len(v) - 1, int(q * len(v)))] if v else float("nan")


def wire(url: str, key: str, model: str, number: int) -> tuple[Wire, dict]:
    c = Wire(url, key)
    c.http.timeout = httpx.Timeout(600)
    c.n = number * 10**8
    return c, c.sampler(model)


def request(
    c: Wire, srun: dict, rid: str, prompt: list[int], max_tokens: int, out: dict, **params
) -> dict | None:
    body = {
        "request_id": rid,
        "prompt": {"chunks": [{"type": "encoded_text", "tokens": prompt}]},
        "sampling_params": {"max_tokens": max_tokens, **params},
        "num_samples": 1,
    }
    out["sent"].append(f"{srun['sampling_run_cuid']}/{rid}")
    try:
        return c.sample(srun, body)
    except Exception as e:
        out["failures"].append(f"{rid}: {e}")
        return None


def flood(url: str, key: str, model: str, args, stop, results) -> None:
    """Key A (its own process): `--flood` threads, each sampling one request after another until
    `stop` is set; puts "ready" once every thread has its sampler, then what it recorded: (finish
    time, tokens) per request, in monotonic seconds (the same clock in every process)."""
    out = {"sent": [], "failures": [], "done": []}
    lock = threading.Lock()
    ready = threading.Barrier(args.flood, action=lambda: results.put("ready"))

    def client(i: int) -> None:
        c, srun = wire(url, key, model, 100 + i)
        ready.wait()
        rng, n, mine = random.Random(i), 0, {"sent": [], "failures": []}
        while not stop.is_set():
            n += 1
            res = request(
                c,
                srun,
                f"a{i}-{n}",
                [rng.randrange(100, 40000) for _ in range(32)],
                args.flood_tokens,
                mine,
                temperature=1.0,
                seed=n,
            )
            if res is not None:
                with lock:
                    out["done"].append((time.monotonic(), sum(len(q["tokens"]) for q in res["sequences"])))
        with lock:
            out["sent"] += mine["sent"]
            out["failures"] += mine["failures"]

    threads = [threading.Thread(target=client, args=(i,)) for i in range(args.flood)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    results.put(out)


def victim(url: str, key: str, model: str, args, windows: list[tuple[float, float]] | None, results) -> None:
    """Key B (its own process): one short greedy request every `--every` seconds inside each window
    (monotonic start, end); with no windows, `--idle-probes` back-to-back probes (after one warm-up).
    Records (start time, latency)."""
    c, srun = wire(url, key, model, 1)
    out = {"sent": [], "failures": [], "latencies": []}
    n = 0

    def probe() -> None:
        nonlocal n
        n += 1
        rng = random.Random(10**6 + n)
        t = time.monotonic()
        request(c, srun, f"b{n}", [rng.randrange(100, 40000) for _ in range(16)], 8, out, temperature=0.0)
        out["latencies"].append((t, time.monotonic() - t))

    if windows is None:
        for _ in range(args.idle_probes + 1):
            probe()
        out["latencies"] = out["latencies"][1:]  # the first warms up
    for start, end in windows or []:
        time.sleep(max(0.0, start - time.monotonic()))
        while time.monotonic() < end:
            t0 = time.monotonic()
            probe()
            time.sleep(max(0.0, args.every - (time.monotonic() - t0)))
    results.put(out)


SPAWN = mp.get_context("spawn")


def spawn(target, *a):
    q = SPAWN.Queue()
    p = SPAWN.Process(target=target, args=(*a, q))
    p.start()
    return p, q


def run(url: str, key_a: str, key_b: str, model: str, args) -> dict:
    """A's flood with phases alone / shared (B probing) alternating, then B's idle baseline on the
    drained server. The first alone phase is A's only one with B never seen: after B's requests,
    A holds at most `tenant_share` of `max_running` for the scheduler's `tenant_window` (60 s)."""
    stop = SPAWN.Event()
    fp, fq = spawn(flood, url, key_a, model, args, stop)
    assert fq.get() == "ready"
    t0 = time.monotonic() + args.warmup
    phases = [
        (kind, r, t0 + (2 * r + i) * args.seconds, t0 + (2 * r + i + 1) * args.seconds)
        for r in range(args.rounds)
        for i, kind in enumerate(("alone", "shared"))
    ]
    vp, vq = spawn(victim, url, key_b, model, args, [(a, b) for kind, _, a, b in phases if kind == "shared"])
    time.sleep(max(0.0, phases[-1][3] - time.monotonic()))
    stop.set()
    shared_b, flood_out = vq.get(), fq.get()  # both before join: a queue's feeder must drain first
    vp.join(), fp.join()
    p, q = spawn(victim, url, key_b, model, args, None)
    idle = q.get()
    p.join()
    base = statistics.median(l for _, l in idle["latencies"])
    log(f"B idle: {base:.3f} s")
    rates: dict[str, list[float]] = collections.defaultdict(list)
    for kind, r, a, b in phases:
        rates[kind].append(sum(n for t, n in flood_out["done"] if a <= t < b) / (b - a))
        log(f"{kind}{r}: A {rates[kind][-1]:.1f} tokens/s")
    victim_s = [l for _, l in shared_b["latencies"]]

    store = Store(args.home)
    metered = collections.Counter(
        f"{u.run_id}/{u.request_id}" for k in store.keys() for u in store.usage_events(k.id)
    )
    store.close()
    sent = idle["sent"] + shared_b["sent"] + flood_out["sent"]
    ratios = [s / a for s, a in zip(rates["shared"], rates["alone"]) if a]
    return {
        "victim_p50_slowdown": statistics.median(victim_s) / base if victim_s else float("nan"),
        "victim_p99_slowdown": pct(victim_s, 0.99) / base,
        "flood_throughput_vs_alone": statistics.median(ratios) if ratios else float("nan"),
        "lost": sum(1 for s in sent if metered[s] == 0),
        "doubled": sum(1 for s in sent if metered[s] > 1),
        "victim_idle_s": base,
        "victim_p50_s": statistics.median(victim_s) if victim_s else float("nan"),
        "victim_p99_s": pct(victim_s, 0.99),
        "victim_requests": len(victim_s),
        "flood_tokens_per_s_alone": rates["alone"],
        "flood_tokens_per_s_shared": rates["shared"],
        "flood_clients": args.flood,
        "admission": "fifo" if args.fifo else "fair",
        "tenant_share": args.tenant_share,
        "max_running": args.max_running,
        "failures": (idle["failures"] + shared_b["failures"] + flood_out["failures"])[:5],
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", type=Path, default=None)
    ap.add_argument("--flood", type=int, default=200)
    ap.add_argument("--flood-tokens", type=int, default=32)
    ap.add_argument("--seconds", type=float, default=30.0)
    ap.add_argument("--warmup", type=float, default=10.0)
    ap.add_argument("--rounds", type=int, default=1)
    ap.add_argument("--every", type=float, default=1.0)
    ap.add_argument("--idle-probes", type=int, default=5)
    ap.add_argument("--max-running", type=int, default=64)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument(
        "--tenant-share",
        type=float,
        default=TENANT_SHARE,
        help="share of max_running one key may hold while another key is active",
    )
    ap.add_argument("--fifo", action="store_true", help="first-come-first-served admission, no per-key share")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    if args.model is None:
        from trine.engine.model.default_model import ensure_default_model

        args.model = ensure_default_model()
    threads = args.threads or torch.get_num_threads()
    options = {"kv_cache_bytes": 1 << 30, "max_running": args.max_running, "tenant_share": args.tenant_share}
    if args.fifo:
        options.update(fair=False, tenant_share=1.0)
        args.tenant_share = 1.0
    engine = EngineConfig(num_threads=threads, device="cpu", sampler=SamplerConfig(**options))
    with tempfile.TemporaryDirectory() as home:
        args.home = home
        srv = start_server([args.model], home=home, engine=engine)
        try:
            _, key_b = srv.service.store.create_key("victim")
            result = run(srv.url, srv.api_key, key_b, args.model.name, args)
        finally:
            srv.stop()
    record(result)  # benchmarks/results/fairness.jsonl
    print(json.dumps(result) if args.json else "\n".join(f"{k}: {v}" for k, v in result.items()))


if __name__ == "__main__":
    main()
