"""Where a short request waits beside a long prompt, through the server (issue 51, item 2).

`benchmarks/load.py`'s phase 0 with each probe's timeline: an idle probe (16-token prompt, 16
greedy tokens) three times, then one `--long`-token prompt-logprobs request with probes sent back to
back while it runs. Each probe's points come from the store's timings, the rows a session trace
draws: accepted, prefill begun (queued before it), first token (its prefill step), finished (its
decode). SmolLM2-135M-Instruct, fp32 on CPU.

    .venv/bin/python benchmarks/probe_timeline.py [--long 8000] [--json] [--idle-prefill-seconds S]
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import threading
import time

from trine.engine.setup import configure

configure()  # before torch loads: the engine's OpenMP wait and allocator, as under `trine serve`

# isort: split

import torch
from load import Load, client  # benchmarks/load.py
from report import record  # benchmarks/report.py

from trine.engine.config import EngineConfig, SamplerConfig
from trine.engine.model.default_model import ensure_default_model
from trine.server.app import start_server
from trine.store import Store


def timeline(store: Store, api_key: str, t0: float) -> list[dict]:
    key = store.key_by_secret(api_key)
    rows = [t for s in store.sessions(key.id, limit=None)[0] for t in store.timings(key.id, s.id)[0]]
    return [
        {
            "request": t.request_id,
            "accepted_s": round(t.accepted - t0, 3),
            "queued_s": round(t.started - t.accepted, 3),
            "prefill_s": round(t.prefilled - t.started, 3),
            "decode_s": round(t.ended - t.prefilled, 3),
            "total_s": round(t.ended - t.accepted, 3),
        }
        for t in sorted(rows, key=lambda t: t.accepted)
        if t.request_id.startswith(("probe-5", "long"))
    ]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--long", type=int, default=8000)
    ap.add_argument("--idle-prefill-seconds", type=float, default=None, help="the sampler's setting")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    load_args = argparse.Namespace(
        long_tokens=args.long, probe_every=0.5, system_tokens=64, train_tokens=64, clients=0, train_runs=0
    )
    model = ensure_default_model()
    sampler = {"kv_cache_bytes": 1 << 30}
    if args.idle_prefill_seconds is not None:
        sampler["idle_prefill_seconds"] = args.idle_prefill_seconds
    with tempfile.TemporaryDirectory() as home:
        load_args.home = home
        engine = EngineConfig(
            num_threads=torch.get_num_threads(), device="cpu", sampler=SamplerConfig(**sampler)
        )
        srv = start_server([model], home=home, engine=engine)
        try:
            load = Load(srv.url, srv.api_key, model.name, load_args)
            probe_client = client(srv.url, srv.api_key, 1)
            probe_run = probe_client.sampler(model.name)
            idle = [load.probe_once(probe_client, probe_run, n) for n in range(4)][1:]  # the first warms up
            long_client = client(srv.url, srv.api_key, 2)
            long_run = long_client.sampler(model.name)
            t0 = time.time()
            alone = threading.Thread(
                target=load.long_request, args=(long_client, long_run, "long"), daemon=True
            )
            alone.start()
            beside, n = [], 500
            while alone.is_alive():  # each probe sent while the long request runs
                n += 1
                beside.append(load.probe_once(probe_client, probe_run, n))
            long_s = time.time() - t0
            time.sleep(1.0)  # the last timings are stored as their requests settle
            store = Store(home, read_only=True)
            spans = timeline(store, srv.api_key, t0)
            store.close()
        finally:
            srv.stop()
    result = {
        "long_tokens": args.long,
        "idle_prefill_seconds": args.idle_prefill_seconds,
        "probe_idle_s": statistics.median(idle),
        "probe_beside_long_s": statistics.median(beside),
        "probe_slowdown": statistics.median(beside) / statistics.median(idle),
        "probes": len(beside),
        "long_request_s": long_s,
        "median_probe": sorted((s for s in spans if s["request"] != "long"), key=lambda s: s["total_s"])[
            len(beside) // 2
        ],
    }
    record(result)  # benchmarks/results/probe_timeline.jsonl
    if args.json:
        print(json.dumps(result))
    else:
        for s in spans:
            print(
                f"{s['request']:>10}: accepted +{s['accepted_s']:7.2f}  queued {s['queued_s']:5.2f}  "
                f"prefill {s['prefill_s']:5.2f}  decode {s['decode_s']:5.2f}  total {s['total_s']:5.2f}"
            )
        for k, v in result.items():
            print(f"{k}: {v}")


if __name__ == "__main__":
    main()
