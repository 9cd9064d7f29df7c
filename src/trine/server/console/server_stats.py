"""What the console's Server page shows: served models with prices, each engine's KV pool, prefix
cache counters and queue depths, and the recent clock cycles with the runs each one batched.

Key isolation: engine counters are server-wide numbers and name nobody; in the cycle list the
caller's own runs are named, other keys' runs are only counted.
"""
from __future__ import annotations

from ...service import Service
from ...store import ApiKey


def engine_stats(svc: Service) -> list[dict]:
    """One entry per engine (per base model; per replica with an engine pool). The one place that
    reads engine internals; a snapshot read from the event loop without stopping the engine."""
    out = []
    for m in svc.models.values():
        s = dict(getattr(m.worker.sampler, "stats", None) or {})
        queues = list(m.scheduler.queues.values()) if m.scheduler else []
        out.append({
            "model": m.name, "replica": 0,
            "kv": {k: s.get(k, 0) for k in ("blocks_total", "blocks_used", "blocks_cached",
                                            "blocks_free", "block_size")},
            "cache": {"hit_blocks": s.get("cache_hit_blocks", 0),
                      "queried_blocks": s.get("cache_queried_blocks", 0),
                      "evictions": s.get("cache_evictions", 0),
                      **{k: s.get(k, 0) for k in ("requests", "prompt_tokens", "prefill_tokens",
                                                  "cached_tokens", "sample_tokens")}},
            "queues": {"sample_waiting": s.get("waiting", 0), "sample_running": s.get("running", 0),
                       "train_runs_waiting": sum(1 for q in queues if q.waiting),
                       "train_events_waiting": sum(len(q.waiting) for q in queues)},
            "cycle": m.scheduler.cycle if m.scheduler else 0,
        })
    return out


def recent_cycles(svc: Service, key: ApiKey, limit: int = 20) -> list[dict]:
    """The last `limit` clock cycles, newest first: when, the caller's runs, how many others."""
    cycles: dict[int, dict] = {}
    for cycle, run_id, key_id, n_events, finished in svc.store.recent_cycles(limit):
        c = cycles.setdefault(cycle, {"cycle": cycle, "finished_at": finished, "runs": [],
                                      "other_runs": 0, "events": 0})
        c["finished_at"] = max(c["finished_at"], finished)
        c["events"] += n_events
        if key_id == key.id:
            c["runs"].append(run_id)
        else:
            c["other_runs"] += 1
    return sorted(cycles.values(), key=lambda c: -c["cycle"])


def server_stats(svc: Service, key: ApiKey) -> dict:
    card = svc.rate_card
    models = [{"name": m.name, "model_id": m.model_id, "context_length": m.max_seq_len,
               "architecture": m.worker.model.cfg.model_type if m.worker.model else None,
               "pricing": card.pricing(m.name)} for m in svc.models.values()]
    return {"currency": card.currency, "models": models, "engines": engine_stats(svc),
            "cycles": recent_cycles(svc, key), "cycle_seconds": svc.cycle_seconds}
