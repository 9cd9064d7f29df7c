"""The web console's server side, over HTTP against a real server: the JSON the pages draw, key
isolation, the page shell and its shipped assets. (The browser itself: test_console_browser.py.)"""

from __future__ import annotations

import httpx
import pytest
from consoleutil import console_server, sft

from trine.server.console.runs import FORWARD_BACKWARD, OPTIMIZE_STEP, RunEventOutcome, run_steps
from trine.store import EventRecord


@pytest.fixture(scope="module")
def env(tiny_model_dir, tmp_path_factory):
    with console_server(tiny_model_dir, tmp_path_factory.mktemp("console-api")) as (srv, bob):
        run = sft(srv.url, srv.api_key, steps=3)
        with httpx.Client(base_url=srv.url, timeout=30, trust_env=False) as http:
            yield srv, bob, run, http


def get(http, key, path, **kw):
    return http.get(path, headers={"X-API-Key": key}, **kw)


def test_run_page_data_is_the_sdk_results_step_by_step(env):
    srv, _, run, http = env
    d = get(http, srv.api_key, f"/console/api/runs/{run.run_id}").json()
    steps = d["steps"]
    assert [s["step"] for s in steps] == [1, 2, 3]
    # exact: a one-chunk step's loss is its event's loss_mean and its grad norm the optim_step's, the
    # floats the SDK got (JSON carries an fp64 exactly)
    assert [s["loss"] for s in steps] == run.losses
    assert [s["grad_norm"] for s in steps] == run.grad_norms
    assert [(s["cycle"], s["optim_cycle"]) for s in steps] == run.cycles
    assert [s["train_tokens"] for s in steps] == run.train_tokens
    assert [s["loss_tokens"] for s in steps] == run.loss_tokens
    assert d["run"]["steps"] == 3 and d["run"]["model"] == "tiny-llama" and d["run"]["rank"] == 4
    (ck,) = d["checkpoints"]
    assert ck["uri"] == run.checkpoint_uri and ck["size_bytes"] > 0 and ck["downloadable"]


def test_run_list_and_checkpoints(env):
    srv, _, run, http = env
    runs = get(http, srv.api_key, "/console/api/runs").json()["runs"]
    row = next(r for r in runs if r["id"] == run.run_id)
    assert row["steps"] == 3 and row["state"] == "ENDED" and row["pending"] == 0  # the client closed
    assert row["last_active"] >= row["created_at"]
    cks = get(http, srv.api_key, "/console/api/checkpoints").json()["checkpoints"]
    assert [c["uri"] for c in cks] == [run.checkpoint_uri]


def test_another_keys_run_is_not_found_and_not_listed(env):
    srv, bob, run, http = env
    r = get(http, bob, f"/console/api/runs/{run.run_id}")
    assert r.status_code == 404 and r.json()["code"] == "training_run_not_found"
    assert get(http, bob, "/console/api/runs").json()["runs"] == []
    assert get(http, bob, "/console/api/checkpoints").json()["checkpoints"] == []
    (engine,) = get(http, bob, "/console/api/server").json()["engines"]
    cycles = engine["cycles"]
    assert cycles and all(c["runs"] == [] and c["other_runs"] == 1 for c in cycles)
    (engine,) = get(http, srv.api_key, "/console/api/server").json()["engines"]
    ran = {c["cycle"] for c in engine["cycles"] if c["runs"] == [run.run_id] and c["other_runs"] == 0}
    assert ran >= {c for pair in run.cycles for c in pair}  # and init_run's, save_state's
    assert ran == {c["cycle"] for c in cycles}  # bob sees the same cycles, without the run's id


@pytest.mark.parametrize("path", ["/console/api/runs", "/console/api/server", "/console/api/checkpoints"])
def test_a_wrong_key_is_refused_with_a_clear_message(env, path):
    _, _, _, http = env
    r = get(http, "trine-not-a-key", path)
    assert r.status_code == 401 and "not valid" in r.json()["message"]
    r = http.get(path)
    assert r.status_code == 401 and "X-API-Key" in r.json()["message"]


def test_server_stats_show_models_prices_and_engines(env):
    srv, _, _, http = env
    d = get(http, srv.api_key, "/console/api/server").json()
    (m,) = d["models"]
    assert m["name"] == "tiny-llama" and m["pricing"]["prefill"] > 0 and m["context_length"] == 4096
    assert m["architecture"] == "llama" and m["replicas"] == 1
    (e,) = d["engines"]
    assert e["model"] == "tiny-llama" and e["alive"] and e["kv"]["blocks_total"] > 0 and e["cycle"] >= 3
    assert e["queues"]["train_events_waiting"] == 0 and e["queues"]["sample_waiting"] == 0
    assert e["cycles"][0]["cycle"] == e["cycle"] and e["cycles"][0]["seconds"] > 0


def test_pages_share_one_shell_and_assets_ship_in_the_package(env):
    srv, _, run, http = env
    for path in (
        "/console",
        "/console/runs",
        f"/console/runs/{run.run_id}",
        "/console/usage",
        "/console/sessions",
        f"/console/sessions/{srv.service.store.training_run(run.run_id).session_id}",
        "/console/nope",
    ):
        r = http.get(path)
        assert r.status_code == 200 and "/console/static/console.js" in r.text, path
    for name in (
        "console.js",
        "pages-runs.js",
        "pages-usage.js",
        "pages-timeline.js",
        "console.css",
        "chart.umd.min.js",
        "chart.js.LICENSE.md",
        "favicon.svg",
    ):
        assert http.get(f"/console/static/{name}").status_code == 200, name
    for name in ("runs.py", "routes.py", "index.html%00"):  # only the listed assets
        assert http.get(f"/console/static/{name}").status_code == 404, name
    assert http.get("/console/api/nothing-here", headers={"X-API-Key": srv.api_key}).status_code == 404
    shell = http.get("/console").text
    assert "http://" not in shell and "https://" not in shell  # nothing loads from outside the server
    r = http.get("/", headers={"Accept": "text/html"}, follow_redirects=False)
    assert r.status_code == 307 and r.headers["location"] == "/console"
    assert http.get("/").json()["service"] == "trine"


def test_usage_over_time_adds_up_to_the_total(env):
    srv, _, _, http = env
    total = get(http, srv.api_key, "/api/trine/v1/usage").json()["total"]
    for by in ("minute", "hour", "day"):
        rows = get(http, srv.api_key, "/api/trine/v1/usage", params={"by": by}).json()["rows"]
        assert sum(r["tokens"]["train"] for r in rows) == total["tokens"]["train"] > 0
        assert sum(r["requests"] for r in rows) == total["requests"]


def test_chunks_of_one_step_fold_into_one_point_weighted_by_tokens():
    def ev(i, typ, step, cycle):
        return EventRecord(f"e{i}", "tr", "k", i, typ, step, "succeeded", 0.0, float(i), cycle)

    events = [
        ev(1, FORWARD_BACKWARD, 0, 1),
        ev(2, FORWARD_BACKWARD, 0, 1),
        ev(3, OPTIMIZE_STEP, 1, 1),
        ev(4, FORWARD_BACKWARD, 1, 2),
        ev(5, FORWARD_BACKWARD, 2, 3),
        ev(6, OPTIMIZE_STEP, 3, 4),
        ev(7, FORWARD_BACKWARD, 3, None),
    ]
    fb = lambda mean, n: RunEventOutcome("succeeded", {"loss_mean": mean, "token_count": n}, n, n // 2)
    results = {
        "e1": fb(1.0, 10),
        "e2": fb(3.0, 30),
        "e3": RunEventOutcome("succeeded", {"grad_norm": 0.5}),
        "e4": fb(2.0, 4),
        "e5": fb(4.0, 4),
        "e6": RunEventOutcome("succeeded", {"grad_norm": 0.25}),
    }
    steps = run_steps(events, results)  # e7 has not finished: no outcome yet
    assert [(s.step, s.chunks, s.loss, s.grad_norm, s.cycle, s.optim_cycle) for s in steps] == [
        (1, 2, 2.5, 0.5, 1, 1),  # two chunks, (1*10 + 3*30) / 40
        (2, 1, 2.0, None, 2, None),  # a forward_backward group with no optim_step after it
        (3, 1, 4.0, 0.25, 3, 4),
    ]  # optim_step in the next cycle: the step took two
    assert [(s.train_tokens, s.loss_tokens) for s in steps] == [(40, 20), (4, 2), (4, 2)]


def test_run_rows_carry_lora_optimizer_metrics_and_step_seconds(env):
    srv, _, run, http = env
    d = get(http, srv.api_key, f"/console/api/runs/{run.run_id}").json()
    r = d["run"]
    assert r["lora"] == {"rank": 4, "train_mlp": True, "train_attn": True, "train_unembed": True, "seed": 0}
    assert r["optimizer"]["learning_rate"] == 2e-2 and r["name"] is None and r["tags"] == []
    assert r["last_metrics"] == {} and d["metrics"] == {} and r["samplers"] == 0
    finished = [s["finished_at"] for s in d["steps"]]
    # exact: the server's one fp64 subtraction of the timestamps it reports
    assert [s["seconds"] for s in d["steps"][1:]] == [b - a for a, b in zip(finished, finished[1:])]
    assert d["steps"][0]["seconds"] == finished[0] - d["steps"][0]["started_at"]
