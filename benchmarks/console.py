"""Console benchmark: what one refresh of a run's page costs the server on a long run.

A real store (SQLite, WAL) holds one training run of `--steps` steps: a forward_backward event per
step whose stored result carries per-token logprobs for a batch of `--batch` x `--seq` tokens (as
the service stores it, `EventResult.pack()`), and an optim_step event. The run page polls every 2 s;
each poll builds the run's steps from its events. Measured, interleaved, `--repeats` times:

- baseline: read every event with its stored result and decode all of them (the naive refresh);
- console, polling: what a refresh of `server/console/runs.py` does once the page is open: list the
  events without their results and reuse the outcomes it decoded before (only new events are read);
- console, first view: the same with an empty outcome cache (the first load of the page).

Both builds give the same steps (checked). Ratio = median(baseline) / median(console).

    .venv/bin/python benchmarks/console.py [--steps 2000] [--batch 8] [--seq 256] [--repeats 7] [--json]
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import tempfile
import time

from report import record  # benchmarks/report.py

from trine.engine.setup import configure

configure()  # before torch loads with the engine: its OpenMP wait, as under `trine serve`

# isort: split

from trine.server.console import runs as console_runs  # noqa: E402
from trine.service import EventResult  # noqa: E402
from trine.service.ownership import Ownership  # noqa: E402
from trine.service.queries import Queries  # noqa: E402
from trine.store import EventRecord, Store, TrainingRun  # noqa: E402

FB, OPT = "trainer.forward_backward", "trainer.optimize_step"


def build(store: Store, steps: int, batch: int, seq: int) -> tuple[str, str]:
    key, _ = store.create_key("bench")
    now = time.time()
    run = TrainingRun(
        "tr_bench", key.id, "ss_bench", 1, "model", 16, True, True, True, 0, "", False, "ACTIVE", now, now
    )
    store.add_training_run(run)
    rng = random.Random(0)
    idx = 0
    for s in range(steps):
        lps = [[-rng.random() * 5 for _ in range(seq)] for _ in range(batch)]
        loss = rng.random() * 3
        for typ, res in (
            (
                FB,
                EventResult(
                    "succeeded",
                    logprobs=lps,
                    metrics={"loss_sum": loss * batch * seq, "loss_mean": loss, "token_count": batch * seq},
                    train_tokens=batch * seq,
                    loss_tokens=batch * seq,
                    cost=1e-5,
                    cycle=s + 1,
                ),
            ),
            (
                OPT,
                EventResult(
                    "succeeded", metrics={"grad_norm": rng.random(), "learning_rate": 1e-4}, cycle=s + 1
                ),
            ),
        ):
            idx += 1
            store.add_event(
                EventRecord(
                    f"ev_{idx}",
                    run.id,
                    key.id,
                    idx,
                    typ,
                    s,
                    "succeeded",
                    now,
                    now,
                    cycle=s + 1,
                    response=res.pack(),
                )
            )
    return run.id, key.id


def baseline(store: Store, run_id: str):
    events = store.events(run_id)
    results = {e.id: console_runs.event_outcome(e, EventResult.of(e)) for e in events}
    return console_runs.run_steps(events, results)


def console(store: Store, queries: Queries, key, run_id: str):
    events = store.events(run_id, responses=False)
    return console_runs.run_steps(events, console_runs.outcomes(queries, key, events))


def timed(fn) -> tuple[float, object]:
    t = time.perf_counter()
    out = fn()
    return time.perf_counter() - t, out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=2000)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq", type=int, default=256)
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    console_runs.MAX_CACHED_OUTCOMES = max(console_runs.MAX_CACHED_OUTCOMES, 4 * args.steps)
    with tempfile.TemporaryDirectory() as home:
        store = Store(home)
        t0 = time.perf_counter()
        run_id, key_id = build(store, args.steps, args.batch, args.seq)
        queries, key = Queries(store=store, ownership=Ownership(store=store), models={}), store.key(key_id)
        print(f"built {2 * args.steps} events in {time.perf_counter() - t0:.1f} s", file=sys.stderr)
        base, warm, cold = [], [], []
        for _ in range(args.repeats):
            tb, steps_b = timed(lambda: baseline(store, run_id))
            console_runs._OUTCOMES.clear()
            tc, steps_c = timed(lambda: console(store, queries, key, run_id))
            tw, steps_w = timed(lambda: console(store, queries, key, run_id))
            assert steps_b == steps_c == steps_w and len(steps_b) == args.steps
            base.append(tb), cold.append(tc), warm.append(tw)
        store.close()
    med = {k: statistics.median(v) for k, v in (("baseline", base), ("first_view", cold), ("polling", warm))}
    result = {
        "steps": args.steps,
        "events": 2 * args.steps,
        "tokens_per_step": args.batch * args.seq,
        "seconds": med,
        "polling_speedup": med["baseline"] / med["polling"],
        "first_view_speedup": med["baseline"] / med["first_view"],
        "repeats": args.repeats,
    }
    record(result)  # benchmarks/results/console.jsonl
    if args.json:
        print(json.dumps(result, indent=2))
    else:
        print(
            f"{args.steps} steps ({2 * args.steps} events, {args.batch}x{args.seq} logprobs per step):\n"
            f"  baseline (read + decode all) {med['baseline'] * 1e3:8.1f} ms\n"
            f"  console, first view          {med['first_view'] * 1e3:8.1f} ms "
            f"({result['first_view_speedup']:.2f}x)\n"
            f"  console, polling             {med['polling'] * 1e3:8.1f} ms "
            f"({result['polling_speedup']:.1f}x)"
        )


if __name__ == "__main__":
    main()
