"""Asynchronous RL benchmark: one GRPO workload run synchronously and with inflight sampling one
step ahead, on one engine and on a 2-replica Ray pool, through the trine SDK over HTTP.

Each step samples `--prompts` prompts x `--group` completions (`--new` tokens, temperature 1),
rewards each completion with the fraction of its tokens that are digits, takes group-relative
advantages, and trains one `importance_sampling` step (the sampled logprobs are the behaviour
policy) followed by an AdamW step.

- sync: every step saves a snapshot sampler (`save_weights_and_get_sampling_client`), samples the
  batch, then trains on it: sampling and training never overlap.
- async: one inflight sampler (`inflight_sampling_client`); the batch of step k+1 is sent before
  step k trains, and every step ends with an inflight save, which moves the running generations
  to the new weights between tokens (the cookbook's `sampling_steps_ahead=1`). Each token's
  weights version says how stale it was when trained on.

Keys: `async_vs_sync_pool` / `async_vs_sync_one` (steps per hour, async over sync, on the 2-replica
pool / one in-process engine), `steps_per_hour_*`, `max_staleness_steps` (optimizer steps between
the weights that produced a trained token and the weights it trained), `reward_curve_sync` /
`reward_curve_async` (mean reward per step, pool runs, first round). Modes alternate round by
round on the same two servers; figures are medians over `--rounds`. SmolLM2-135M-Instruct by
default (`--model DIR` for another), fp32 on CPU, 1 torch thread per engine.

    .venv/bin/python benchmarks/async_rl.py [--rounds 2] [--steps 6] [--json] [--model DIR]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

from report import record  # benchmarks/report.py

from trine.engine.setup import configure

configure()  # before torch loads with the engine: its OpenMP wait, as under `trine serve`

# isort: split

import trine as trio  # noqa: E402
from trine.engine.config import EngineConfig, SamplerConfig, TrainerConfig  # noqa: E402
from trine.server.app import start_server  # noqa: E402

ENGINE = EngineConfig(
    device="cpu",
    num_threads=1,
    sampler=SamplerConfig(kv_cache_bytes=256 << 20, max_batch_tokens=1024),
    trainer=TrainerConfig(micro_batch_tokens=2048),
)
PROMPTS = [
    "Write a number:",
    "Count to five:",
    "What is 12 times 7?",
    "The year was",
    "My phone number is",
    "Add 3 and 4:",
    "List some digits:",
    "Pi starts with",
]


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


class Workload:
    def __init__(self, client: trio.ServiceClient, model: str, args):
        self.args = args
        self.trainer = client.create_lora_training_client(model, rank=8, seed=0)
        tok = self.trainer.get_tokenizer()
        self.digits = {i for d in "0123456789" for i in tok.encode(d, add_special_tokens=False)}
        self.prompts = [tok.encode(p, add_special_tokens=False) for p in PROMPTS[: args.prompts]]
        self.steps_done = 0
        self.version_steps: dict[int, int] = {}  # inflight version -> optimizer steps behind it
        self.rewards: list[float] = []
        self.staleness: list[int] = []

    def send(self, sampler: trio.SamplingClient, step: int) -> list:
        params = trio.SamplingParams(max_tokens=self.args.new, temperature=1.0, seed=step, stop=[])
        return [
            (p, sampler.sample(trio.ModelInput.from_ints(p), self.args.group, params)) for p in self.prompts
        ]

    @staticmethod
    def collect(sent: list) -> list:
        return [(p, future.result().sequences) for p, future in sent]

    def inflight_save(self) -> trio.SamplingClient:
        """An inflight save (the run's next version: the server counts them the same way)."""
        sampler = self.trainer.inflight_sampling_client()
        self.version_steps[len(self.version_steps) + 1] = self.steps_done
        return sampler

    def train(self, batch: list) -> None:
        data, rewards = [], []
        for prompt, seqs in batch:
            r = [sum(t in self.digits for t in s.tokens) / max(len(s.tokens), 1) for s in seqs]
            mean = sum(r) / len(r)
            rewards += r
            for s, ri in zip(seqs, r):
                if s.weights_versions:  # steps between its oldest token's weights and these
                    self.staleness.append(self.steps_done - self.version_steps[min(s.weights_versions)])
                n, c = len(prompt), len(s.tokens)
                data.append(
                    trio.Datum(
                        model_input=trio.ModelInput.from_ints(prompt + s.tokens[:-1]),
                        loss_fn_inputs={
                            "target_tokens": [0] * (n - 1) + s.tokens,
                            "logprobs": [0.0] * (n - 1) + list(s.logprobs),
                            "advantages": [0.0] * (n - 1) + [ri - mean] * c,
                        },
                    )
                )
        self.rewards.append(sum(rewards) / len(rewards))
        self.trainer.forward_backward(data, "importance_sampling")
        self.trainer.optim_step(trio.AdamParams(learning_rate=self.args.lr))
        self.steps_done += 1

    def run_sync(self, steps: int) -> None:
        for step in range(steps):
            sampler = self.trainer.save_weights_and_get_sampling_client()
            self.train(self.collect(self.send(sampler, step)))
        self.trainer.save_weights_and_get_sampling_client()  # waits for the last step

    def run_async(self, steps: int) -> None:
        sampler = self.inflight_save()
        pending = self.send(sampler, 0)
        for step in range(steps):
            batch = self.collect(pending)
            if step + 1 < steps:
                pending = self.send(sampler, step + 1)
            self.train(batch)  # batch k+1 decodes meanwhile
            # moves every running generation to the new weights; the new client needs them
            sampler = self.inflight_save()


def one_round(client, model: str, mode: str, args) -> dict:
    w = Workload(client, model, args)
    getattr(w, f"run_{mode}")(1)  # warm-up step, not timed
    w.rewards, w.staleness = [], []
    t = time.perf_counter()
    getattr(w, f"run_{mode}")(args.steps)
    dt = time.perf_counter() - t
    return {
        "steps_per_hour": args.steps * 3600 / dt,
        "rewards": w.rewards,
        "max_staleness": max(w.staleness, default=0),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", type=Path, default=None)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--prompts", type=int, default=4)
    ap.add_argument("--group", type=int, default=4)
    ap.add_argument("--new", type=int, default=24)
    ap.add_argument("--lr", type=float, default=5e-3)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    if args.model is None:
        from trine.engine.model.default_model import ensure_default_model

        args.model = ensure_default_model()
    model = args.model.resolve()
    import os

    # the shared machine's other work can push memory past Ray's 95% kill threshold: keep the replicas
    os.environ.setdefault("RAY_memory_monitor_refresh_ms", "0")
    from trine.engine.runtime.ray_backend import connect, ray_engines

    connect(None, num_cpus=2)
    import ray

    res: dict[str, list[dict]] = {f"{m}_{e}": [] for m in ("sync", "async") for e in ("one", "pool")}
    try:
        with tempfile.TemporaryDirectory() as home:
            servers = {
                "one": start_server([model], home=Path(home) / "one", engine=ENGINE),
                "pool": start_server([model], home=Path(home) / "pool", engines=ray_engines(2, ENGINE)),
            }
            clients = {e: trio.ServiceClient(api_key=s.api_key, base_url=s.url) for e, s in servers.items()}
            try:
                for rnd in range(args.rounds):
                    modes = ("sync", "async") if rnd % 2 == 0 else ("async", "sync")
                    for engine in ("one", "pool"):
                        for mode in modes:
                            out = one_round(clients[engine], model.name, mode, args)
                            res[f"{mode}_{engine}"].append(out)
                            log(
                                f"round {rnd} {mode} {engine}: {out['steps_per_hour']:.0f} steps/h, "
                                f"staleness {out['max_staleness']}"
                            )
            finally:
                for c in clients.values():
                    c.close()
                for s in servers.values():
                    s.stop()
    finally:
        ray.shutdown()

    def sph(name):
        return statistics.median(r["steps_per_hour"] for r in res[name])

    result = {
        "async_vs_sync_pool": sph("async_pool") / sph("sync_pool"),
        "async_vs_sync_one": sph("async_one") / sph("sync_one"),
        **{f"steps_per_hour_{k}": sph(k) for k in res},
        "max_staleness_steps": max(r["max_staleness"] for k in ("async_one", "async_pool") for r in res[k]),
        "reward_curve_sync": [round(x, 4) for x in res["sync_pool"][0]["rewards"]],
        "reward_curve_async": [round(x, 4) for x in res["async_pool"][0]["rewards"]],
    }
    record(result)  # benchmarks/results/async_rl.jsonl
    if args.json:
        print(json.dumps({k: round(v, 4) if isinstance(v, float) else v for k, v in result.items()}))
    else:
        for k, v in result.items():
            print(f"{k:24s} {v}")


if __name__ == "__main__":
    main()
