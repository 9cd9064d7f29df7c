"""What the console's Server page shows: served models with prices, each engine replica's KV pool,
prefix-cache counters and queue depths, and its recent clock cycles with the runs each one batched.

The figures come from the service's `Queries.replica_stats` (engine stats plus each replica's
clock-cycle queues), already key-isolated: the caller's own runs are named, other keys' runs only
counted. This module only shapes them.
"""

from __future__ import annotations

from ...service import ApiKey, ReplicaStats, Service

KV = ("blocks_total", "blocks_used", "blocks_cached", "blocks_free", "block_size")
TOKENS = ("requests", "prompt_tokens", "prefill_tokens", "cached_tokens", "sample_tokens")


def _engine_json(r: ReplicaStats) -> dict:
    out = {
        "model": r.model,
        "replica": r.replica,
        "alive": r.alive,
        "cycle": r.cycle,
        "queues": {
            "train_runs_waiting": r.train_runs_waiting,
            "train_events_waiting": r.train_events_waiting,
        },
    }
    if r.error is not None:
        out["error"] = r.error
        return out
    s = r.sampler
    out["where"] = r.where
    out["kv"] = {k: s.get(k, 0) for k in KV}
    out["cache"] = {
        "hit_blocks": s.get("cache_hit_blocks", 0),
        "queried_blocks": s.get("cache_queried_blocks", 0),
        "evictions": s.get("cache_evictions", 0),
        **{k: s.get(k, 0) for k in TOKENS},
    }
    out["queues"].update(
        sample_waiting=s.get("waiting", 0), sample_running=s.get("running", 0), engine_jobs=r.engine_jobs
    )
    out["held"] = {"training_runs": r.training_runs, "sampler_adapters": r.sampler_adapters}
    out["cycles"] = [
        {
            "cycle": c.number,
            "seconds": c.seconds,
            "events": c.events,
            "runs": c.runs,
            "other_runs": c.other_runs,
        }
        for c in r.cycles
    ]
    return out


async def server_stats(svc: Service, key: ApiKey) -> dict:
    card = svc.rate_card
    models = [
        {
            "name": m.name,  # never the model's directory: no server path leaves (server/http/refusals.py)
            "context_length": m.max_seq_len,
            "architecture": m.architecture,
            "replicas": m.replicas,
            "pricing": card.pricing(m.name),
        }
        for m in svc.queries.models()
    ]
    return {
        "currency": card.currency,
        "models": models,
        "engines": [_engine_json(r) for r in await svc.queries.replica_stats(key)],
        "cycle_seconds": svc.cycle_seconds,
    }
