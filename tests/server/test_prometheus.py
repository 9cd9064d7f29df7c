"""`GET /metrics` (issue 30 item 5): a real server's scrape, parsed with prometheus_client's own
parser after real training and sampling traffic. Two apps in one process keep separate registries."""

from __future__ import annotations

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families
from serverutil import ADAM, RawClient, ce_payload, event, serve

MODEL = "tiny-llama"


@pytest.fixture(scope="module")
def server(tiny_model_dir, tmp_path_factory):
    with serve(tiny_model_dir, tmp_path_factory.mktemp("home")) as srv:
        yield srv


def scrape(url: str) -> dict[str, list]:
    """name -> [(labels, value)] of every sample, as Prometheus reads the page."""
    r = httpx.get(f"{url}/metrics", trust_env=False)
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain")
    out: dict[str, list] = {}
    for fam in text_string_to_metric_families(r.text):
        for s in fam.samples:
            out.setdefault(s.name, []).append((s.labels, s.value))
    return out


def value(samples: dict, name: str, **labels) -> float:
    found = [v for lab, v in samples.get(name, []) if all(lab.get(k) == w for k, w in labels.items())]
    assert len(found) == 1, (name, labels, samples.get(name))
    return found[0]


def test_metrics_after_training_and_sampling(server):
    c = RawClient(server.url, server.api_key)
    try:
        run, rid = c.started_run(MODEL)
        assert c.submit(run, event("event_fb00000002", "forward_backward", 2, ce_payload([5, 6, 7]), rid))
        assert c.submit(run, event("event_op00000003", "optimize_step", 3, ADAM, rid)).status_code < 300
        assert c.wait(run, "event_op00000003")["status"] == "succeeded"
        srun = c.sampling_run(c.session(), MODEL)
        body = {
            "prompt": {"chunks": [{"type": "encoded_text", "tokens": list(range(1, 40))}]},
            "num_samples": 2,
            "sampling_params": {"max_tokens": 4, "temperature": 0.0},
        }
        for i in range(2):  # the second finds the first's prompt blocks in the prefix cache
            assert c.sample(srun, {**body, "request_id": f"m-{i}"}).status_code == 200
    finally:
        c.close()
    m = scrape(server.url)
    rep = {"model": MODEL, "replica": "0"}
    # requests by route template, not raw path: the run id is not a label value
    routes = {lab["route"] for lab, _ in m["trine_http_requests_total"]}
    sample_route = "/actor/v1/sampling-runs/{sampling_run_id}/sample"
    assert sample_route in routes and not any(rid in r for r in routes), routes
    assert value(m, "trine_http_requests_total", route=sample_route, status="200", method="POST") == 2
    assert value(m, "trine_http_request_duration_seconds_count", route=sample_route, method="POST") == 2
    # the engine: tokens by phase, the prefix cache, the KV pool, queues
    assert value(m, "trine_tokens_total", **rep, phase="prefill") > 0
    # the second request: its prompt but the last token, 2 blocks of 16 and 6 tokens copied from the
    # first's samples' partial last block (their KV of prompt tokens 32..38 and 3 sampled tokens)
    assert value(m, "trine_tokens_total", **rep, phase="prefill_cached") == 38
    assert value(m, "trine_prefix_cache_hit_partial_tokens_total", **rep) == 6
    assert value(m, "trine_tokens_total", **rep, phase="sample") == 16  # 2 requests x 2 samples x 4
    assert value(m, "trine_tokens_total", **rep, phase="train") == 3
    hits = value(m, "trine_prefix_cache_hit_blocks_total", **rep)
    asked = value(m, "trine_prefix_cache_queried_blocks_total", **rep)
    # exact: the gauge is the server's one fp64 division of these counters, written as repr
    assert 0 < hits <= asked and value(m, "trine_prefix_cache_hit_ratio", **rep) == hits / asked
    assert value(m, "trine_kv_blocks_total", **rep) > 0
    assert value(m, "trine_kv_blocks_cached", **rep) >= 2  # the prompt's two full blocks, kept
    assert value(m, "trine_kv_blocks_used", **rep) == 0  # nothing runs: every block is free or evictable
    assert value(m, "trine_sampling_queue_depth", **rep) == 0
    assert value(m, "trine_sampling_running_sequences", **rep) == 0
    assert value(m, "trine_replica_up", **rep) == 1
    # the kernels the engine's start line named, one series per op
    kernels = {lab["op"]: lab["path"] for lab, v in m["trine_engine_kernel_info"] if v == 1}
    assert set(kernels) == {"fused_ops", "paged_attention", "gemm", "delta_rule", "fused_train"}, kernels
    assert kernels["gemm"].startswith(("auto(", "packed", "onednn", "linear", "F.linear", "invariant"))
    # clock cycles: init, then forward_backward + optim_step (one cycle or two)
    cycles = value(m, "trine_training_cycle_seconds_count", **rep)
    assert cycles >= 2 and value(m, "trine_training_cycle_seconds_sum", **rep) > 0
    assert value(m, "trine_training_cycle_tokens_sum", **rep) == 3
    assert value(m, "trine_training_cycle_tokens_bucket", **rep, le="+Inf") == cycles
    # the gauges that were there before
    assert value(m, "trine_disk_free_bytes", dir="data_dir") > 0
    assert value(m, "trine_shutting_down") == 0


def test_each_app_has_its_own_registry(server, tiny_model_dir, tmp_path):
    def health_count(samples) -> float:
        return sum(v for lab, v in samples.get("trine_http_requests_total", []) if lab["route"] == "/health")

    before = health_count(scrape(server.url))
    with serve(tiny_model_dir, tmp_path / "other") as other:
        assert httpx.get(f"{other.url}/health", trust_env=False).status_code == 200
        assert health_count(scrape(other.url)) == 1
    assert health_count(scrape(server.url)) == before  # the other app's request is not counted here
