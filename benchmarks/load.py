"""Load benchmark: many clients at once, and one huge request in the middle of them.

SmolLM2-135M-Instruct by default (`--model DIR` for any checkpoint directory), fp32 on CPU.

Phase 0: probes on the idle server, then the long request alone with probes while it runs.
Phase 1 (`--seconds`): `--clients` concurrent sampling clients (prompts sharing a system prompt,
2-4 samples, 16 new tokens each) and `--train-runs` training runs (pipelined forward_backward +
optim_step, small batches), plus a probe client sending a short sample (16-token prompt, 1 sample,
16 new tokens, greedy) every `--probe-every` seconds.
Phase 2: the same load, and one `--long-tokens`-token prompt-logprobs request sent after
`--long-after` seconds; the phase ends `--after-long` seconds after the long request returns (or
`--max-seconds` after it was sent). Then the load stops and the long request is given
`--drain-seconds` to finish before anything is counted.

Reported (`--json`):
- sample_p50_s, sample_p99_s: sampling-client request latency, both phases;
- train_step_p99_s: one training step (forward_backward + optim_step, submitted together);
- lost: requests or events that never succeeded; doubled: requests or events metered twice
  (both read from the server's usage store by request / event id); both must be 0; unfinished:
  the long request, if it was still running after the drain (neither lost nor counted);
- probe_slowdown: median probe latency while the long request runs alone / median probe latency
  on the idle server (phase 0, before the load; goal <= 3), and probe_slowdown_under_load: median
  probe latency while the long request runs in phase 2 / median probe latency in phase 1 (the same
  load without it). Also the probes' and the long request's own latencies.

    .venv/bin/python benchmarks/load.py [--json] [--seconds 40] [--model DIR] [--threads N]
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

from trine.engine.setup import configure

configure()  # before torch loads: the engine's OpenMP wait and allocator, as under `trine serve`

# isort: split

import httpx
import torch
from report import record  # benchmarks/report.py
from service import Wire  # benchmarks/service.py: the minimal PyTRIO wire client

from trine.engine.config import EngineConfig, SamplerConfig, TrainerConfig
from trine.server.app import start_server


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def pct(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    v = sorted(values)
    return v[min(len(v) - 1, int(q * len(v)))]


def client(url: str, key: str, number: int) -> Wire:
    """A wire client whose event ids cannot collide with another client's."""
    c = Wire(url, key)
    c.http.timeout = httpx.Timeout(600)
    c.n = number * 10**8
    return c


class Load:
    """The sampling clients, training runs and the probe, recording into `self.records`."""

    def __init__(self, url: str, key: str, model: str, args):
        self.url, self.key, self.model, self.args = url, key, model, args
        self.phase = "idle"
        self.stop = threading.Event()
        self.lock = threading.Lock()
        self.records: dict[str, list] = collections.defaultdict(list)  # kind -> (phase, seconds, extra)
        self.sent_samples: list[str] = []
        self.sent_events: list[str] = []
        self.failures: list[str] = []
        self.long_running = threading.Event()
        rng = random.Random(0)
        self.system = [rng.randrange(100, 40000) for _ in range(args.system_tokens)]

    def record(self, kind: str, seconds: float, **extra) -> None:
        with self.lock:
            self.records[kind].append((self.phase, seconds, extra))

    def fail(self, what: str) -> None:
        with self.lock:
            self.failures.append(what)

    def sampling_client(self, i: int) -> None:
        c = client(self.url, self.key, 100 + i)
        srun = c.sampler(self.model)
        rng = random.Random(100 + i)
        n = 0
        while not self.stop.is_set():
            n += 1
            rid = f"c{i}-{n}"
            prompt = self.system + [rng.randrange(100, 40000) for _ in range(rng.randrange(16, 33))]
            body = {
                "request_id": rid,
                "prompt": {"chunks": [{"type": "encoded_text", "tokens": prompt}]},
                "sampling_params": {"max_tokens": 16, "temperature": 1.0, "seed": n},
                "num_samples": rng.randrange(2, 5),
            }
            with self.lock:
                self.sent_samples.append(f"{srun['sampling_run_cuid']}/{rid}")
            t = time.perf_counter()
            try:
                out = c.sample(srun, body)
                assert len(out["sequences"]) == body["num_samples"]
            except Exception as e:
                self.fail(f"sample {rid}: {e}")
                continue
            self.record("sample", time.perf_counter() - t)

    def training_run(self, i: int) -> None:
        c = client(self.url, self.key, 200 + i)
        run = c.trainer(self.model)
        rng = random.Random(200 + i)
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
        while not self.stop.is_set():
            data = []
            for _ in range(2):
                tokens = [rng.randrange(100, 40000) for _ in range(self.args.train_tokens)]
                data.append(
                    {
                        "model_input": {"chunks": [{"type": "encoded_text", "tokens": tokens}]},
                        "target_ids": tokens[1:] + [2],
                        "weights": [1.0] * len(tokens),
                    }
                )
            fb = {
                "data": data,
                "auto_shift": False,
                "loss": {"type": "cross_entropy", "config": {}},
                "gradient_accumulation": {
                    "total_samples": 2,
                    "total_active_tokens": 2 * self.args.train_tokens,
                    "total_advantage_tokens": 0,
                },
            }
            t = time.perf_counter()
            try:
                ids = [c.submit(run, "forward_backward", fb), c.submit(run, "optimize_step", adam)]
                with self.lock:
                    self.sent_events.extend(ids)
                for e in ids:
                    c.wait(run, e)
            except Exception as e:
                self.fail(f"train {run['training_run_cuid']}: {e}")
                continue
            self.record("train_step", time.perf_counter() - t)

    def probe_once(self, c: Wire, srun: dict, n: int) -> float:
        rng = random.Random(300 + n)
        body = {
            "request_id": f"probe-{n}",
            "num_samples": 1,
            "prompt": {
                "chunks": [{"type": "encoded_text", "tokens": [rng.randrange(100, 40000) for _ in range(16)]}]
            },
            "sampling_params": {"max_tokens": 16, "temperature": 0.0},
        }
        with self.lock:
            self.sent_samples.append(f"{srun['sampling_run_cuid']}/probe-{n}")
        t = time.perf_counter()
        c.sample(srun, body)
        return time.perf_counter() - t

    def probe(self, c: Wire, srun: dict) -> None:
        n = 1000
        while not self.stop.is_set():
            n += 1
            during_long = self.long_running.is_set()
            try:
                dt = self.probe_once(c, srun, n)
            except Exception as e:
                self.fail(f"probe {n}: {e}")
                continue
            self.record("probe", dt, during_long=during_long)  # sent while the long request ran
            self.stop.wait(self.args.probe_every)

    def long_request(self, c: Wire, srun: dict, request_id: str) -> None:
        rng = random.Random(request_id)
        tokens = [rng.randrange(100, 40000) for _ in range(self.args.long_tokens)]
        body = {
            "request_id": request_id,
            "num_samples": 1,
            "return_prompt_logprobs": True,
            "return_token_logprobs": False,
            "prompt": {"chunks": [{"type": "encoded_text", "tokens": tokens}]},
            "sampling_params": {"max_tokens": 1},
        }
        with self.lock:
            self.sent_samples.append(f"{srun['sampling_run_cuid']}/{request_id}")
        self.long_running.set()
        t = time.perf_counter()
        try:
            out = c.sample(srun, body)
            assert len(out["prompt_logprobs"]) == len(tokens)
            self.record("long", time.perf_counter() - t)
        except Exception as e:
            self.fail(f"long request: {e}")
        finally:
            self.long_running.clear()


def run(url: str, key: str, model: str, args) -> dict:
    load = Load(url, key, model, args)
    probe_client = client(url, key, 1)
    probe_run = probe_client.sampler(model)
    idle = []
    for n in range(args.idle_probes + 1):  # the first one warms up and is dropped
        dt = load.probe_once(probe_client, probe_run, n)
        if n:
            idle.append(dt)
    log(f"idle probe: {statistics.median(idle):.3f} s")
    long_client = client(url, key, 2)
    long_run = long_client.sampler(model)
    load.phase = "isolated"
    alone = threading.Thread(
        target=load.long_request, args=(long_client, long_run, "long-alone"), daemon=True
    )
    alone.start()
    n = 500
    while alone.is_alive():  # each probe is sent while the long request runs
        n += 1
        load.record("probe", load.probe_once(probe_client, probe_run, n), during_long=True)
    log(f"long request alone: {load.records['long'][-1][1] if load.records['long'] else float('nan'):.1f} s")
    threads = [
        threading.Thread(target=load.sampling_client, args=(i,), daemon=True) for i in range(args.clients)
    ]
    threads += [
        threading.Thread(target=load.training_run, args=(i,), daemon=True) for i in range(args.train_runs)
    ]
    threads.append(threading.Thread(target=load.probe, args=(probe_client, probe_run), daemon=True))
    load.phase = "load"
    t0 = time.monotonic()
    for t in threads:
        t.start()
    time.sleep(args.seconds)
    log(f"phase 1 done: {len(load.records['sample'])} samples, {len(load.records['train_step'])} train steps")
    load.phase = "long"
    time.sleep(args.long_after)
    long_thread = threading.Thread(
        target=load.long_request, args=(long_client, long_run, "long-load"), daemon=True
    )
    long_thread.start()
    long_thread.join(args.max_seconds)
    time.sleep(args.after_long)
    load.stop.set()
    for t in threads:
        t.join(300)
    elapsed = time.monotonic() - t0
    long_thread.join(args.drain_seconds)  # let it finish: a request still running is not lost
    unfinished = [f"{long_run['sampling_run_cuid']}/long-load"] if long_thread.is_alive() else []

    # exactly-once, from the server's usage store
    store = None
    from trine.store import Store

    store = Store(args.home)
    key_id = store.key_by_secret(key).id
    metered = collections.Counter(
        f"{u.run_id}/{u.request_id}" if u.operation in ("sample", "compute_logprobs") else u.request_id
        for u in store.usage_events(key_id)
    )
    store.close()
    sent = load.sent_samples + load.sent_events
    lost = sum(1 for s in sent if metered[s] == 0 and s not in unfinished)
    doubled = sum(1 for s in sent if metered[s] > 1)

    rec = load.records
    samples = [s for _, s, _ in rec["sample"]]
    steps = [s for _, s, _ in rec["train_step"]]
    probe_load = [s for ph, s, _ in rec["probe"] if ph == "load"]
    probe_long = [s for ph, s, x in rec["probe"] if ph == "long" and x["during_long"]]
    probe_alone = [s for ph, s, _ in rec["probe"] if ph == "isolated"]
    long_s = {ph: s for ph, s, _ in rec["long"]}
    med = lambda v: statistics.median(v) if v else float("nan")
    result = {
        "sample_p50_s": statistics.median(samples) if samples else float("nan"),
        "sample_p99_s": pct(samples, 0.99),
        "train_step_p99_s": pct(steps, 0.99),
        "lost": lost,
        "doubled": doubled,
        "unfinished": len(unfinished),
        "probe_slowdown": med(probe_alone) / statistics.median(idle),
        "probe_slowdown_under_load": med(probe_long) / med(probe_load),
        "probe_idle_s": statistics.median(idle),
        "probe_during_long_alone_s": med(probe_alone),
        "probes_during_long_alone": len(probe_alone),
        "probe_load_s": med(probe_load),
        "probe_during_long_under_load_s": med(probe_long),
        "probes_during_long_under_load": len(probe_long),
        "long_request_alone_s": long_s.get("isolated", float("nan")),
        "long_request_under_load_s": long_s.get("long", float("nan")),
        "sample_p50_s_phase1": statistics.median(
            [s for ph, s, _ in rec["sample"] if ph == "load"] or [float("nan")]
        ),
        "sample_p50_s_phase2": statistics.median(
            [s for ph, s, _ in rec["sample"] if ph == "long"] or [float("nan")]
        ),
        "samples": len(samples),
        "train_steps": len(steps),
        "seconds": elapsed,
        "failures": load.failures[:5],
    }
    return result


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", type=Path, default=None)
    ap.add_argument("--clients", type=int, default=32)
    ap.add_argument("--train-runs", type=int, default=4)
    ap.add_argument("--seconds", type=float, default=40.0)
    ap.add_argument("--long-after", type=float, default=3.0)
    ap.add_argument("--max-seconds", type=float, default=120.0)
    ap.add_argument("--after-long", type=float, default=3.0)
    ap.add_argument(
        "--drain-seconds",
        type=float,
        default=900.0,
        help="after the load stops, how long to wait for the long request to finish",
    )
    ap.add_argument("--long-tokens", type=int, default=8000)
    ap.add_argument("--system-tokens", type=int, default=64)
    ap.add_argument("--train-tokens", type=int, default=64)
    ap.add_argument("--probe-every", type=float, default=0.5)
    ap.add_argument("--idle-probes", type=int, default=3)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    if args.model is None:
        from trine.engine.model.default_model import ensure_default_model

        args.model = ensure_default_model()
    threads = args.threads or torch.get_num_threads()
    with tempfile.TemporaryDirectory() as home:
        args.home = home
        srv = start_server(
            [args.model],
            home=home,
            engine=EngineConfig(
                num_threads=threads,
                device="cpu",
                sampler=SamplerConfig(kv_cache_bytes=1 << 30),
                trainer=TrainerConfig(micro_batch_tokens=512),
            ),
        )
        try:
            result = run(srv.url, srv.api_key, args.model.name, args)
        finally:
            srv.stop()
    record(result)  # benchmarks/results/load.jsonl
    if args.json:
        print(json.dumps(result))
    else:
        for k, v in result.items():
            print(f"{k}: {v}")


if __name__ == "__main__":
    main()
