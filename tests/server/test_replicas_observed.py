"""Per replica: a server with two in-process engine replicas of one model, sampling spread over both
by the router, seen by `GET /metrics` (a series per replica, tokens adding up to the metering) and
by the session trace (a Perfetto process per replica, each request's spans on the replica that
served it)."""

from __future__ import annotations

import httpx
from prometheus_client.parser import text_string_to_metric_families
from serverutil import TEST_ENGINE, RawClient, serve

from trine.engine.runtime.local import LocalEngine

MODEL = "tiny-llama"
PROMPTS = [[1 + i, *range(200 + 7 * i, 240 + 7 * i)] for i in range(8)]  # new prefixes: spread by hashing


def two_replicas(name, path):
    return [LocalEngine(name, path, TEST_ENGINE, replica=f"local-{i}") for i in range(2)]


def test_metrics_and_the_trace_per_replica(tiny_model_dir, tmp_path):
    with serve(tiny_model_dir, tmp_path / "home", engines=two_replicas) as srv:
        c = RawClient(srv.url, srv.api_key)
        try:
            session = c.session()
            srun = c.sampling_run(session, MODEL)
            for i, prompt in enumerate(PROMPTS):
                body = {
                    "request_id": f"p-{i}",
                    "prompt": {"chunks": [{"type": "encoded_text", "tokens": prompt}]},
                    "num_samples": 1,
                    "sampling_params": {"max_tokens": 3, "temperature": 0.0},
                }
                assert c.sample(srun, body).status_code == 200
        finally:
            c.close()
        key = srv.service.authenticate(srv.api_key)
        timings, _ = srv.service.store.timings(key.id, session)
        served = {t.request_id: t.replica for t in timings}
        assert sorted(served) == [f"p-{i}" for i in range(len(PROMPTS))]
        assert set(served.values()) == {0, 1}, served  # the router used both replicas

        text = httpx.get(f"{srv.url}/metrics", trust_env=False).text
        samples = [s for fam in text_string_to_metric_families(text) for s in fam.samples]
        sampled = {
            s.labels["replica"]: s.value
            for s in samples
            if s.name == "trine_tokens_total" and s.labels["phase"] == "sample"
        }
        per_replica = {str(r): 3 * list(served.values()).count(r) for r in (0, 1)}
        assert sampled == per_replica
        up = {s.labels["replica"] for s in samples if s.name == "trine_replica_up" and s.value == 1}
        assert up == {"0", "1"}

        r = httpx.get(
            f"{srv.url}/api/trine/v1/sessions/{session}/trace",
            headers={"X-API-Key": srv.api_key},
            trust_env=False,
        )
        events = r.json()["traceEvents"]
        process = {e["pid"]: e["args"]["name"] for e in events if e["name"] == "process_name"}
        assert sorted(process.values()) == [f"{MODEL} replica 0", f"{MODEL} replica 1"]
        for e in events:
            if e["ph"] == "X":
                assert process[e["pid"]] == f"{MODEL} replica {served[e['args']['request_id']]}"
