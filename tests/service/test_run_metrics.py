"""Runs a researcher can follow (issue 20, items 1-3): metrics logged through the SDK, names and tags
from the trine SDK and the official tinker and pytrio clients, and a GRPO-shaped run's samplers
counted in its usage row; over HTTP against a real server on a tiny model."""

from __future__ import annotations

import csv
import io
import json
import os

import httpx
import pytest
from click.testing import CliRunner
from consoleutil import MODEL, SEQS, console_server
from serverutil import pytrio_env

import trine as trio
from trine.cli.main import main as trine_cli

DATA = [
    trio.Datum(model_input=trio.ModelInput.from_ints(s[:-1]), loss_fn_inputs={"target_tokens": s[1:]})
    for s in SEQS
]


@pytest.fixture(scope="module")
def env(tiny_model_dir, tmp_path_factory):
    """A named, tagged run of 3 steps that logs reward and kl each step and samples from two
    save_weights_and_get_sampling_client samplers (an RL loop's shape)."""
    with console_server(tiny_model_dir, tmp_path_factory.mktemp("run-metrics")) as (srv, bob):
        with trio.ServiceClient(api_key=srv.api_key, base_url=srv.url) as service:
            trainer = service.create_lora_training_client(
                MODEL, rank=4, seed=0, name="grpo-arith", tags=["rl", "tiny"], user_metadata={"lr": "0.02"}
            )
            params = trio.SamplingParams(max_tokens=4, temperature=1.0, seed=1)
            logged = []
            for step in range(1, 4):
                if step < 3:
                    sampler = trainer.save_weights_and_get_sampling_client()
                    sampler.sample(
                        trio.ModelInput.from_ints(SEQS[0]), num_samples=2, sampling_params=params
                    ).result()
                trainer.forward_backward(DATA, "cross_entropy").result()
                trainer.optim_step(trio.AdamParams(learning_rate=2e-2, weight_decay=0.01)).result()
                values = {"reward": 0.25 * step, "kl": 0.01 / step}
                trainer.log_metrics(values).result()  # default step: optim steps so far
                logged.append(values)
            base = service.create_sampling_client(base_model=MODEL)  # not attributed to any run
            base.sample(trio.ModelInput.from_ints(SEQS[1]), num_samples=1, sampling_params=params).result()
            run_id = trainer.training_run_id
        with httpx.Client(base_url=srv.url, timeout=30, trust_env=False) as http:
            yield srv, bob, run_id, logged, http


def get(http, key, path, **kw):
    return http.get(path, headers={"X-API-Key": key}, **kw)


def post(http, key, path, body):
    return http.post(path, headers={"X-API-Key": key}, json=body)


def test_logged_metrics_are_stored_per_step_and_served_as_json_and_csv(env):
    srv, _, run_id, logged, http = env
    d = get(http, srv.api_key, f"/api/trine/v1/training-runs/{run_id}").json()
    assert d["metrics"] == {
        "kl": [[i + 1, v["kl"]] for i, v in enumerate(logged)],
        "reward": [[i + 1, v["reward"]] for i, v in enumerate(logged)],
    }
    assert d["run"]["last_metrics"] == {"kl": logged[-1]["kl"], "reward": logged[-1]["reward"]}
    assert all(s["seconds"] is not None and s["seconds"] >= 0 for s in d["steps"])
    table = get(http, srv.api_key, f"/api/trine/v1/training-runs/{run_id}/metrics").json()
    assert table["columns"] == [
        "step",
        "train:loss",
        "train:grad_norm",
        "train:learning_rate",
        "train:seconds",
        "kl",
        "reward",
    ]
    assert [r[0] for r in table["rows"]] == [1, 2, 3]
    assert [r[1] for r in table["rows"]] == [s["loss"] for s in d["steps"]]
    assert [r[6] for r in table["rows"]] == [v["reward"] for v in logged]
    r = get(http, srv.api_key, f"/api/trine/v1/training-runs/{run_id}/metrics", params={"format": "csv"})
    assert (
        r.headers["content-type"].startswith("text/csv")
        and f"{run_id}-metrics.csv" in r.headers["content-disposition"]
    )
    rows = list(csv.reader(io.StringIO(r.text)))
    assert rows[0] == table["columns"] and [float(x[6]) for x in rows[1:]] == [v["reward"] for v in logged]


def test_the_same_step_and_name_again_replaces_the_value(env):
    srv, _, run_id, logged, http = env
    r = post(
        http,
        srv.api_key,
        f"/api/trine/v1/training-runs/{run_id}/metrics",
        {"step": 2, "values": {"reward": 9.5}},
    )
    assert r.status_code == 200 and r.json()["logged"] == ["reward"]
    series = get(http, srv.api_key, f"/api/trine/v1/training-runs/{run_id}").json()["metrics"]["reward"]
    assert series == [[1, logged[0]["reward"]], [2, 9.5], [3, logged[2]["reward"]]]
    post(http, srv.api_key, f"/api/trine/v1/training-runs/{run_id}/metrics", {"step": 2, "values": logged[1]})


@pytest.mark.parametrize(
    "body, field",
    [
        ({"step": 1, "values": {"reward": "high"}}, "values.reward"),
        ({"step": 1, "values": {"reward": True}}, "values.reward"),
        ({"step": 1, "values": {"bad name!": 1.0}}, "metric name"),
        ({"step": -1, "values": {"reward": 1.0}}, "step"),
        ({"step": "3", "values": {"reward": 1.0}}, "step"),
        ({"step": 1, "values": {}}, "values"),
        ({"step": 1, "values": {f"m{i}": 1.0 for i in range(300)}}, "values"),
        ({"step": 1, "value": {"reward": 1.0}}, "value"),
    ],
)
def test_bad_metrics_get_a_400_naming_the_field(env, body, field):
    srv, _, run_id, _, http = env
    r = post(http, srv.api_key, f"/api/trine/v1/training-runs/{run_id}/metrics", body)
    assert r.status_code == 400 and field in r.json()["message"], r.text


def test_non_finite_values_are_refused(env):
    srv, _, run_id, _, http = env
    r = http.post(
        f"/api/trine/v1/training-runs/{run_id}/metrics",
        headers={"X-API-Key": srv.api_key, "Content-Type": "application/json"},
        content='{"step": 1, "values": {"reward": NaN}}',
    )
    assert r.status_code == 400 and "values.reward" in r.json()["message"]


def test_the_sdk_refuses_a_non_number_before_sending(env):
    srv, _, run_id, _, _ = env
    with trio.ServiceClient(api_key=srv.api_key, base_url=srv.url) as service:
        trainer = service.create_lora_training_client(MODEL, rank=4)
        with pytest.raises(trio.ValidationError, match="reward"):
            trainer.log_metrics({"reward": "high"})
        with pytest.raises(trio.ValidationError, match="step"):
            trainer.log_metrics({"reward": 1.0}, step=-2)


def test_another_keys_run_takes_no_metrics_and_shows_none(env):
    srv, bob, run_id, _, http = env
    r = post(
        http, bob, f"/api/trine/v1/training-runs/{run_id}/metrics", {"step": 1, "values": {"reward": 1.0}}
    )
    assert r.status_code == 404 and r.json()["code"] == "training_run_not_found"
    assert get(http, bob, f"/api/trine/v1/training-runs/{run_id}/metrics").status_code == 404
    assert get(http, bob, "/api/trine/v1/training-runs").json()["runs"] == []


def test_listings_show_name_tags_lora_optimizer_and_last_metrics(env):
    srv, _, run_id, logged, http = env
    row = next(
        r for r in get(http, srv.api_key, "/api/trine/v1/training-runs").json()["runs"] if r["id"] == run_id
    )
    assert (
        row["name"] == "grpo-arith"
        and row["tags"] == ["rl", "tiny"]
        and row["user_metadata"] == {"lr": "0.02"}
    )
    assert row["lora"] == {"rank": 4, "train_mlp": True, "train_attn": True, "train_unembed": True, "seed": 0}
    assert row["optimizer"]["learning_rate"] == 2e-2 and row["optimizer"]["weight_decay"] == 0.01
    assert row["last_metrics"] == {"kl": logged[-1]["kl"], "reward": logged[-1]["reward"]}
    assert row["samplers"] == 2
    ctl = get(http, srv.api_key, f"/api/openapi/v1/training-runs/{run_id}").json()  # the PyTRIO control plane
    assert ctl["name"] == "grpo-arith" and ctl["user_metadata"] == {
        "lr": "0.02",
        "name": "grpo-arith",
        "tags": "rl,tiny",
    }


def test_usage_by_run_counts_the_samplers_in_their_training_run_with_a_breakdown(env):
    srv, _, run_id, logged, http = env
    rep = get(http, srv.api_key, "/api/trine/v1/usage", params={"by": "run"}).json()
    row = next(r for r in rep["rows"] if r["key"] == run_id)
    assert row["info"]["name"] == "grpo-arith" and row["info"]["metrics"]["reward"] == logged[-1]["reward"]
    assert row["info"]["lora"]["rank"] == 4 and row["info"]["optimizer"]["learning_rate"] == 2e-2
    training, sampling = row["parts"]["training"], row["parts"]["sampling"]
    assert sampling["info"] == {"runs": 2} and sampling["tokens"]["sample"] == 2 * 2 * 4
    assert training["tokens"]["train"] == row["tokens"]["train"] > 0 and training["tokens"]["sample"] == 0
    for k in ("prefill", "prefill_cached", "sample", "train"):
        assert training["tokens"][k] + sampling["tokens"][k] == row["tokens"][k]
    assert row["requests"] == training["requests"] + sampling["requests"]
    assert sum(r["tokens"]["sample"] for r in rep["rows"]) == rep["total"]["tokens"]["sample"]
    others = [r for r in rep["rows"] if r["key"] != run_id]  # only the base-model sampler stays apart
    assert (
        len(others) == 1
        and others[0]["info"]["kind"] == "sampling"
        and others[0]["info"]["name"] == "base model"
    )


def test_trine_usage_and_trine_runs_show_the_run(env):
    srv, _, run_id, logged, _ = env
    cli = ["--url", srv.url, "--api-key", srv.api_key]
    out = CliRunner().invoke(trine_cli, ["usage", "--by", "run", *cli], terminal_width=200)
    assert out.exit_code == 0, out.output
    assert "grpo-arith" in out.output and "2 sampler(s)" in out.output
    out = CliRunner().invoke(trine_cli, ["runs", "list", *cli], terminal_width=200)
    assert out.exit_code == 0, out.output
    assert run_id in out.output and "grpo-arith" in out.output and "reward=0.75" in out.output
    out = CliRunner().invoke(trine_cli, ["runs", "show", run_id, *cli], terminal_width=200)
    assert out.exit_code == 0, out.output
    assert "rl, tiny" in out.output and "lr 0.02" in out.output and "reward" in out.output
    out = CliRunner().invoke(trine_cli, ["runs", "show", run_id, "--json", *cli])
    assert json.loads(out.output)["metrics"]["reward"][-1] == [3, logged[-1]["reward"]]
    out = CliRunner().invoke(trine_cli, ["runs", "show", run_id, "--csv", *cli])
    assert out.output.splitlines()[0].endswith(",kl,reward")
    out = CliRunner().invoke(trine_cli, ["runs", "show", "tr_nope", *cli])
    assert out.exit_code != 0 and "not found" in out.output


def test_bad_labels_are_refused_naming_the_field(env):
    srv, _, _, _, http = env
    with trio.ServiceClient(api_key=srv.api_key, base_url=srv.url) as service:
        with pytest.raises(trio.TrineError, match="tags"):
            service.create_lora_training_client(MODEL, rank=4, tags=["x" * 100])
        with pytest.raises(trio.TrineError, match="name"):
            service.create_lora_training_client(MODEL, rank=4, name="n" * 300)


def test_the_official_tinker_client_names_and_tags_runs_through_user_metadata(env):
    tinker = pytest.importorskip("tinker")
    srv, _, _, _, http = env
    old = {k: os.environ.get(k) for k in ("TINKER_TELEMETRY", "TINKER_TAGS", "HF_HUB_OFFLINE")}
    os.environ.update(TINKER_TELEMETRY="0", TINKER_TAGS="sweep-7", HF_HUB_OFFLINE="1")
    try:
        sc = tinker.ServiceClient(
            base_url=srv.url,
            api_key="tml-" + srv.api_key,
            display_name="tinker-sweep",
            user_metadata={"team": "rl"},
        )
        tc = sc.create_lora_training_client(
            base_model=MODEL, rank=4, user_metadata={"name": "tinker-grpo", "tags": "rl,big"}
        )
        run_id = (
            tinker.RestClient(base_url=srv.url, api_key="tml-" + srv.api_key)
            .list_training_runs()
            .result()
            .training_runs[-1]
            .training_run_id
        )
        rest = tinker.RestClient(base_url=srv.url, api_key="tml-" + srv.api_key)
        meta = rest.get_training_run(run_id).result().user_metadata
        assert meta == {"team": "rl", "name": "tinker-grpo", "tags": "sweep-7,rl,big"}
        sc2 = tinker.ServiceClient(
            base_url=srv.url, api_key="tml-" + srv.api_key, display_name="tinker-sweep"
        )
        sc2.create_lora_training_client(base_model=MODEL, rank=4)  # no name of its own: the session's
        del tc
        sc.close("success").result()
        sc2.close("success").result()
    finally:
        for k, v in old.items():
            os.environ.pop(k, None) if v is None else os.environ.__setitem__(k, v)
    names = {r["name"] for r in get(http, srv.api_key, "/api/trine/v1/training-runs").json()["runs"]}
    assert {"tinker-grpo", "tinker-sweep"} <= names


def test_the_official_pytrio_client_reads_the_labels(env):
    srv, _, run_id, _, _ = env
    with pytrio_env(srv.url, srv.api_key) as pytrio:
        service = pytrio.ServiceClient()
        run = service.create_rest_client().get_training_run(run_id).result()
        assert run.user_metadata == {"lr": "0.02", "name": "grpo-arith", "tags": "rl,tiny"}


def test_trine_usage_on_the_data_dir_groups_the_same_way_as_the_server(env):
    srv, _, run_id, _, http = env
    out = CliRunner().invoke(trine_cli, ["usage", "--by", "run", "--home", str(srv.home), "--json"])
    assert out.exit_code == 0, out.output
    local = {r["key"]: r for r in json.loads(out.output)["rows"]}
    served = {
        r["key"]: r
        for r in get(http, srv.api_key, "/api/trine/v1/usage", params={"by": "run"}).json()["rows"]
    }
    assert (
        local[run_id]["parts"] == served[run_id]["parts"] and local[run_id]["info"] == served[run_id]["info"]
    )


def test_a_sampler_can_name_the_run_it_belongs_to_and_not_another_keys(env):
    srv, bob, run_id, _, http = env
    from trine.service import SamplingRunSpec

    svc = srv.service
    alice, bobs = svc.store.key_by_secret(srv.api_key), svc.store.key_by_secret(bob)
    s = svc.runs.create_session(alice)
    ref = svc.runs.create_sampling_run(alice, s.id, SamplingRunSpec(MODEL, training_run_id=run_id))
    assert ref.training_run_id == run_id  # a base-model reference sampler, counted in the run's row
    from trine.service import NotFound

    with pytest.raises(NotFound):
        svc.runs.create_sampling_run(
            bobs, svc.runs.create_session(bobs).id, SamplingRunSpec(MODEL, training_run_id=run_id)
        )
