"""The usage router on a real FastAPI app and store, and the `trine usage / estimate / models` commands."""

from __future__ import annotations

import json

import pytest
from click.testing import CliRunner
from fastapi import FastAPI, Header, HTTPException
from fastapi.testclient import TestClient

from trine.cli.main import main
from trine.metering.events import CacheDiagnostic, UsageEvent
from trine.metering.http import make_usage_router
from trine.metering.rates import RateCard
from trine.store import Store

T0 = 1_767_600_000.0


@pytest.fixture
def home(tmp_path):
    store = Store(tmp_path)
    a, secret_a = store.create_key("alice")
    b, secret_b = store.create_key("bob")
    for i in range(3):
        store.add_usage(
            UsageEvent(
                T0 + 1800 * i,
                a.id,
                "sa",
                f"ra{i % 2}",
                "SmolLM2-135M-Instruct",
                "sample",
                prefill=40,
                prefill_cached=60,
                sample=32,
            )
        )
    store.add_usage(
        UsageEvent(
            T0, a.id, "sa", "ra0", "SmolLM2-135M-Instruct", "forward_backward", train=256, train_loss=96
        )
    )
    store.add_usage(UsageEvent(T0, b.id, "sb", "rb", "Qwen3-8B", "sample", prefill=1000, sample=5000))
    store.add_diagnostic(
        CacheDiagnostic(T0, a.id, "sa", "ra1", "SmolLM2-135M-Instruct", "varying_head", 5, 70)
    )
    store.close()
    return tmp_path, {"alice": (a.id, secret_a), "bob": (b.id, secret_b)}


@pytest.fixture
def client(home):
    path, _ = home
    store = Store(path)

    def authenticate(x_api_key: str = Header("")):
        rec = store.key_by_secret(x_api_key)
        if rec is None:
            raise HTTPException(401, "unknown API key")
        return rec

    app = FastAPI()
    app.include_router(make_usage_router(lambda: store, authenticate, RateCard.load(home=path)))
    yield TestClient(app)
    store.close()


def get(client, secret, path, **params):
    return client.get("/api/trine/v1" + path, params=params, headers={"X-API-Key": secret})


def test_a_key_sees_only_its_own_usage(client, home):
    _, keys = home
    alice, bob = keys["alice"][1], keys["bob"][1]
    r = get(client, alice, "/usage", by="run").json()
    assert r["total"]["requests"] == 4 and r["total"]["tokens"]["prefill"] == 120
    assert [row["key"] for row in r["rows"]] == ["ra0", "ra1"]
    assert r["diagnostics"][0]["pattern"] == "varying_head" and r["diagnostics"][0]["tokens_lost"] == 70
    assert get(client, alice, "/usage", run_id="rb").json()["total"]["requests"] == 0  # bob's run: nothing
    b = get(client, bob, "/usage/events").json()
    assert [e["run_id"] for e in b["events"]] == ["rb"] and b["diagnostics"] == []
    assert get(client, "trine-nope", "/usage").status_code == 401


def test_filters_and_errors(client, home):
    alice = home[1]["alice"][1]
    r = get(client, alice, "/usage", since=str(T0 + 1000), by="hour").json()
    assert r["total"]["requests"] == 2 and len(r["rows"]) == 2
    assert get(client, alice, "/usage", session_id="sb").json()["total"]["requests"] == 0
    for params in ({"by": "week"}, {"since": "yesterday-ish"}):
        bad = get(client, alice, "/usage", **params)
        assert bad.status_code == 400 and set(bad.json()) == {"code", "message"}
    rates = get(client, alice, "/rates").json()
    assert any(m["model_id"] == "SmolLM2-135M-Instruct" for m in rates["models"])


def test_usage_cli_reads_the_data_dir(home):
    path, keys = home
    runner = CliRunner()
    out = runner.invoke(main, ["usage", "--home", str(path), "--json", "--by", "model"])
    assert out.exit_code == 0, out.output
    d = json.loads(out.output)
    assert d["total"]["requests"] == 5  # the operator's view: every key
    assert {row["key"] for row in d["rows"]} == {"SmolLM2-135M-Instruct", "Qwen3-8B"}
    out = runner.invoke(main, ["usage", "--home", str(path), "--json", "--key", "bob"])
    assert json.loads(out.output)["total"]["tokens"]["sample"] == 5000
    out = runner.invoke(main, ["usage", "--home", str(path), "--by", "run", "--key", "alice"])
    assert out.exit_code == 0 and "varying_head" in out.output and "ra1" in out.output
    assert runner.invoke(main, ["usage", "--home", str(path / "empty")]).exit_code != 0


def test_estimate_and_models_cli(tmp_path):
    runner = CliRunner()
    out = runner.invoke(
        main,
        [
            "estimate",
            "--json",
            "--steps",
            "2",
            "--group-size",
            "4",
            "--turns",
            "3",
            "--prompt-tokens",
            "50",
            "--completion-tokens",
            "20",
            "--home",
            str(tmp_path),
        ],
    )
    assert out.exit_code == 0, out.output
    d = json.loads(out.output)
    assert d["with_cache"]["tokens"]["sample"] == 2 * 4 * 3 * 20 and d["dominant_phase"]
    assert runner.invoke(main, ["estimate", "--steps", "0"]).exit_code != 0
    (tmp_path / "models" / "my-model").mkdir(parents=True)
    (tmp_path / "models" / "my-model" / "config.json").write_text("{}")
    out = runner.invoke(main, ["models", "--json", "--home", str(tmp_path)])
    rows = json.loads(out.output)
    assert rows[0]["model_id"] == "my-model" and rows[0]["pricing"]["rate_row"] == "default"
    assert any(r["model_id"] == "Qwen3-8B" for r in rows)


def test_usage_and_models_through_a_real_server(tiny_model_dir, tmp_path):
    """The server mounts the usage router: metered sampling shows up for its key only, through HTTP and
    `trine usage --url`; the models list carries prices."""
    import httpx
    from serverutil import serve

    import trine as trio

    runner = CliRunner()
    with serve(tiny_model_dir, tmp_path / "home") as srv:
        _, other = srv.service.store.create_key("other")
        with trio.ServiceClient(api_key=srv.api_key, base_url=srv.url) as service:
            sampler = service.create_sampling_client(base_model="tiny-llama")
            prompt = trio.ModelInput.from_ints(list(range(100, 140)))
            params = trio.SamplingParams(max_tokens=4, seed=0)
            for _ in range(2):
                sampler.sample(prompt, num_samples=3, sampling_params=params).result()
        mine = get_remote(srv.url, srv.api_key, "/usage", by="model")
        assert mine["total"]["requests"] == 2
        assert mine["total"]["tokens"]["prompt"] == 80 and mine["total"]["tokens"]["sample"] == 2 * 3 * 4
        # the repeat hits the prompt's 2 full blocks and 7 tokens of the first's partial last block
        assert mine["total"]["tokens"]["prefill_cached"] == 39
        assert get_remote(srv.url, other, "/usage")["total"]["requests"] == 0
        assert (
            httpx.get(srv.url + "/api/trine/v1/usage", headers={"X-API-Key": "trine-wrong"}).status_code
            == 401
        )

        out = runner.invoke(main, ["usage", "--url", srv.url, "--api-key", srv.api_key, "--json"])
        assert out.exit_code == 0, out.output
        assert json.loads(out.output)["total"]["tokens"] == mine["total"]["tokens"]
        out = runner.invoke(main, ["models", "--url", srv.url, "--api-key", srv.api_key, "--json"])
        assert out.exit_code == 0, out.output
        (row,) = json.loads(out.output)
        assert row["model_id"].endswith("tiny-llama") and row["pricing"]["rate_row"] == "default"


def get_remote(url, secret, path, **params):
    import httpx

    r = httpx.get(url + "/api/trine/v1" + path, params=params, headers={"X-API-Key": secret}, trust_env=False)
    r.raise_for_status()
    return r.json()
