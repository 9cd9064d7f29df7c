"""`GET /metrics`: the operator's view in Prometheus' text format, built with `prometheus_client`.

What it exposes (names and labels are documented on the Serving page, "Metrics"):
- per route: requests by method, route template and status, and their latency (a histogram);
- per engine replica (`model`, `replica`): the sampler's queue depth, requests in flight, running
  sequences, KV blocks used / cached / total, prefix-cache hit and queried blocks (the hit rate is
  their ratio), tokens by phase (prefill computed, prefill cached, sample, train), a hybrid model's
  recurrent-state slots and prefix-cache snapshots (held, capacity, bytes each, hits, evictions:
  only for replicas of such a model), clock cycles'
  duration and training tokens (histograms), training events waiting, whether it is up, and the
  kernel path each op takes (`trine_engine_kernel_info`: `op`, `path`, as the start line names them);
- the data and checkpoint dirs' free bytes and whether the server drains for shutdown.

Invariants
- One `CollectorRegistry` per app (tests start many apps in one process; the library's global
  registry would mix them and refuse a second registration).
- Route labels are templates (`/api/v1/training_runs/{model_id}`), never raw paths, so the series
  stay few whatever ids clients send; a request no route matched is `route="unmatched"`.
- Engine figures are read once per scrape (`Queries.replica_stats` without a key: no run or key
  is named, only counted); a replica that is lost or does not answer reports `up 0` and no
  engine figures.
"""

from __future__ import annotations

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily
from prometheus_client.registry import Collector
from starlette.responses import Response

from ...service import ReplicaStats, Service
from ...service.cycle_tally import Tally

LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 300.0)
REPLICA = ("model", "replica")
# the sampler's lifetime token counters by phase, as metering names the phases
SAMPLER_PHASES = {"prefill": "prefill_tokens", "prefill_cached": "cached_tokens", "sample": "sample_tokens"}


class HttpMetrics:
    """Counts and times every HTTP request by method, route template and status (an `Observed`
    observer)."""

    def __init__(self, registry: CollectorRegistry):
        self.requests = Counter(
            "trine_http_requests",
            "HTTP requests answered, by method, route template and status.",
            ("method", "route", "status"),
            registry=registry,
        )
        self.latency = Histogram(
            "trine_http_request_duration_seconds",
            "Time from a request's arrival to its response's last byte, by method and route template.",
            ("method", "route"),
            buckets=LATENCY_BUCKETS,
            registry=registry,
        )

    def __call__(self, scope: dict, status: int, seconds: float) -> None:
        route = getattr(scope.get("route"), "path", None) or "unmatched"
        method = scope["method"]
        self.requests.labels(method, route, str(status)).inc()
        self.latency.labels(method, route).observe(seconds)


class ServiceCollector(Collector):
    """The service's figures at scrape time; `metrics()` fills `replicas` just before collecting."""

    def __init__(self, service: Service):
        self.service = service
        self.replicas: list[ReplicaStats] = []

    def collect(self):
        svc = self.service
        disk = GaugeMetricFamily(
            "trine_disk_free_bytes", "Bytes free where trine writes (-1: unknown).", labels=("dir",)
        )
        for where, free in svc.free_space().items():
            disk.add_metric([where], free)
        yield disk
        yield GaugeMetricFamily(
            "trine_shutting_down", "1 while the server drains for shutdown.", value=int(svc.gate.draining)
        )
        yield from self._replicas()

    def _replicas(self):
        g = _Families()
        up = g.gauge("trine_replica_up", "1 while the engine replica runs and answers.", REPLICA)
        waiting = g.gauge(
            "trine_sampling_queue_depth",
            "Sample requests waiting in the engine's queue (admitted by the service, not started).",
            REPLICA,
        )
        inflight = g.gauge(
            "trine_sampling_requests_in_flight",
            "Sample requests the service sent to the replica that have not finished.",
            REPLICA,
        )
        running = g.gauge("trine_sampling_running_sequences", "Sequences decoding now.", REPLICA)
        blocks = {
            k: g.gauge(f"trine_kv_blocks_{k}", f"KV cache blocks {what}.", REPLICA)
            for k, what in (
                ("used", "held by queued or running requests (not free to hand out)"),
                ("cached", "holding a prefix the cache can reuse (in use or evictable)"),
                ("total", "in the pool"),
            )
        }
        hits = g.counter(
            "trine_prefix_cache_hit_blocks",
            "Prompt blocks found in the prefix cache (hit rate: this over queried blocks).",
            REPLICA,
        )
        queried = g.counter(
            "trine_prefix_cache_queried_blocks", "Prompt blocks looked up in the prefix cache.", REPLICA
        )
        partial = g.counter(
            "trine_prefix_cache_hit_partial_tokens",
            "Prompt tokens served after the hit blocks from a partial block (copied).",
            REPLICA,
        )
        ratio = g.gauge(
            "trine_prefix_cache_hit_ratio",
            "Hit blocks over queried blocks since the replica started (0 before any lookup).",
            REPLICA,
        )
        state = {  # a hybrid model's (sampler/state_cache.py): absent for a dense model's replicas
            "state_slots_total": g.gauge(
                "trine_state_slots_total",
                "Recurrent-state slots of a hybrid model's sampler: one per live sequence (max_running).",
                REPLICA,
            ),
            "state_slots_free": g.gauge("trine_state_slots_free", "Recurrent-state slots free now.", REPLICA),
            "state_snapshots": g.gauge(
                "trine_state_snapshots_held",
                "State snapshots the prefix cache holds (a hybrid model's cached prefixes end at one).",
                REPLICA,
            ),
            "state_snapshots_total": g.gauge(
                "trine_state_snapshots_capacity",
                "Snapshots the budget holds (state_cache_bytes over one snapshot's bytes).",
                REPLICA,
            ),
            "state_bytes_per_sequence": g.gauge(
                "trine_state_snapshot_bytes",
                "Bytes of one snapshot: a sequence's conv and recurrent state, every linear layer.",
                REPLICA,
            ),
            "state_snapshot_hits": g.counter(
                "trine_state_snapshot_hits", "Requests served a prefix from a state snapshot.", REPLICA
            ),
            "state_snapshot_evictions": g.counter(
                "trine_state_snapshot_evictions",
                "Snapshots evicted for newer ones (least recently used first; their KV blocks stay).",
                REPLICA,
            ),
        }
        tokens = g.counter(
            "trine_tokens",
            "Tokens computed by phase: prefill (computed), prefill_cached, sample, train.",
            (*REPLICA, "phase"),
        )
        events = g.gauge(
            "trine_training_events_waiting",
            "Training events accepted and waiting for a clock cycle.",
            REPLICA,
        )
        kernels = g.gauge(
            "trine_engine_kernel_info",
            "1 for the kernel path each op of the replica takes (the engine's start line): fused_ops, "
            "paged_attention, gemm (auto(...) counts the shape and row-bucket pairs each GEMM kernel won).",
            (*REPLICA, "op", "path"),
        )
        seconds = HistogramMetricFamily(
            "trine_training_cycle_seconds", "Duration of each clock cycle (engine time).", labels=REPLICA
        )
        cycle_tokens = HistogramMetricFamily(
            "trine_training_cycle_tokens", "Training tokens computed in each clock cycle.", labels=REPLICA
        )
        for r in self.replicas:
            labels = [r.model, str(r.replica)]
            up.add_metric(labels, int(r.alive))
            events.add_metric(labels, r.train_events_waiting)
            inflight.add_metric(labels, r.inflight_samples)
            if r.cycle_tally is not None:
                _histogram(seconds, labels, r.cycle_tally.seconds)
                _histogram(cycle_tokens, labels, r.cycle_tally.tokens)
                tokens.add_metric([*labels, "train"], r.cycle_tally.tokens.sum)
            if r.error is not None:  # lost: no engine figures
                continue
            for op, kernel_path in r.kernels.items():
                kernels.add_metric([*labels, op, kernel_path], 1)
            s = r.sampler
            waiting.add_metric(labels, s.get("waiting", 0))
            running.add_metric(labels, s.get("running", 0))
            for k, fam in blocks.items():
                fam.add_metric(labels, s.get(f"blocks_{k}", 0))
            hit, asked = s.get("cache_hit_blocks", 0), s.get("cache_queried_blocks", 0)
            hits.add_metric(labels, hit)
            queried.add_metric(labels, asked)
            partial.add_metric(labels, s.get("cache_hit_partial_tokens", 0))
            ratio.add_metric(labels, hit / asked if asked else 0.0)
            for phase, counter in SAMPLER_PHASES.items():
                tokens.add_metric([*labels, phase], s.get(counter, 0))
            for k, fam in state.items():
                if k in s:
                    fam.add_metric(labels, s[k])
        yield from g.families
        yield seconds
        yield cycle_tokens


class _Families:
    """Metric families in the order they were made (the exposition keeps that order)."""

    def __init__(self):
        self.families: list = []

    def gauge(self, name: str, doc: str, labels: tuple[str, ...]) -> GaugeMetricFamily:
        self.families.append(GaugeMetricFamily(name, doc, labels=labels))
        return self.families[-1]

    def counter(self, name: str, doc: str, labels: tuple[str, ...]) -> CounterMetricFamily:
        self.families.append(CounterMetricFamily(name, doc, labels=labels))
        return self.families[-1]


def _histogram(fam: HistogramMetricFamily, labels: list[str], t: Tally) -> None:
    buckets = [(_bound(b), c) for b, c in zip(t.buckets, t.counts)] + [("+Inf", t.count)]
    fam.add_metric(labels, buckets, t.sum)


def _bound(b: float) -> str:
    return str(int(b)) if float(b).is_integer() else repr(float(b))


class PrometheusEndpoint:
    """The app's registry, its request middleware's instruments and the service collector."""

    def __init__(self, service: Service):
        self.registry = CollectorRegistry()
        self.collector = ServiceCollector(service)
        self.registry.register(self.collector)
        self.service = service

    async def response(self) -> Response:
        self.collector.replicas = await self.service.queries.replica_stats(None)
        return Response(generate_latest(self.registry), media_type=CONTENT_TYPE_LATEST)
