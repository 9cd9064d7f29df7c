"""What the console's Server page shows: served models with prices, each engine replica's KV pool,
prefix-cache counters and queue depths, and its recent clock cycles with the runs each one batched.

Engine figures come from the engine interface (`Engine.stats()`); training queue depths from each
replica's clock-cycle scheduler. Key isolation: engine counters are server-wide numbers and name
nobody; in the cycle lists the caller's own runs are named, other keys' runs are only counted.
"""
from __future__ import annotations

import asyncio

from ...engine.interface import EngineStats
from ...service import Service
from ...store import ApiKey

RECENT_CYCLES = 20


def _engine_json(m, rep, st: EngineStats | BaseException, own_runs: set[str]) -> dict:
    queues = list(rep.scheduler.queues.values()) if rep.scheduler else []
    out = {"model": m.name, "replica": rep.index, "alive": rep.alive and not isinstance(st, BaseException),
           "cycle": rep.scheduler.cycle if rep.scheduler else 0,
           "queues": {"train_runs_waiting": sum(1 for q in queues if q.waiting),
                      "train_events_waiting": sum(len(q.waiting) for q in queues)}}
    if isinstance(st, BaseException):
        out["error"] = f"{type(st).__name__}: {st}"
        return out
    s = st.sampler
    out["where"] = st.replica
    out["kv"] = {k: s.get(k, 0) for k in ("blocks_total", "blocks_used", "blocks_cached", "blocks_free",
                                          "block_size")}
    out["cache"] = {"hit_blocks": s.get("cache_hit_blocks", 0), "queried_blocks": s.get("cache_queried_blocks", 0),
                    "evictions": s.get("cache_evictions", 0),
                    **{k: s.get(k, 0) for k in ("requests", "prompt_tokens", "prefill_tokens", "cached_tokens",
                                                "sample_tokens")}}
    out["queues"].update(sample_waiting=s.get("waiting", 0), sample_running=s.get("running", 0),
                         engine_jobs=st.queued_jobs)
    out["held"] = {"training_runs": st.runs, "sampler_adapters": st.adapters}
    out["cycles"] = [{"cycle": c.number, "seconds": c.seconds, "events": c.events,
                      "runs": [r for r in c.runs if r in own_runs],
                      "other_runs": sum(r not in own_runs for r in c.runs)}
                     for c in reversed(st.recent_cycles[-RECENT_CYCLES:])]
    return out


async def engines(svc: Service, key: ApiKey) -> list[dict]:
    """One entry per replica of every served model (a lost replica says so)."""
    runs, _ = svc.store.training_runs(key.id)
    own = {r.id for r in runs}
    out = []
    for m in svc.models.values():
        live = [rep for rep in m.replicas if rep.alive]
        stats = dict(zip(map(id, live), await asyncio.gather(*(rep.engine.stats() for rep in live),
                                                             return_exceptions=True)))
        for rep in m.replicas:
            out.append(_engine_json(m, rep, stats.get(id(rep), RuntimeError("replica lost")), own))
    return out


async def server_stats(svc: Service, key: ApiKey) -> dict:
    card = svc.rate_card
    models = [{"name": m.name, "model_id": m.model_id, "context_length": m.max_seq_len,
               "architecture": m.info.architecture if m.info else None, "replicas": len(m.replicas),
               "pricing": card.pricing(m.name)} for m in svc.models.values()]
    return {"currency": card.currency, "models": models, "engines": await engines(svc, key),
            "cycle_seconds": svc.cycle_seconds}
