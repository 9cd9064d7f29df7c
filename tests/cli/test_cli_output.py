"""The CLI as a new user meets it: version and -h, readable listings with --json, fixed-point money,
`trine serve` refusing bad setups in one line before loading anything, and the access log."""

from __future__ import annotations

import json
import logging
import socket
import time

import httpx
import pytest
from click.testing import CliRunner

from trine.cli.main import main
from trine.cli.serve import key_hint
from trine.metering.report import fmt_money
from trine.store import Store


def test_version_and_short_help():
    r = CliRunner().invoke(main, ["--version"])
    assert r.exit_code == 0 and r.output.startswith("trine ") and r.output.split()[1][0].isdigit()
    for args in (["-h"], ["keys", "-h"], ["export", "-h"], ["serve", "-h"]):
        r = CliRunner().invoke(main, args)
        assert r.exit_code == 0 and "Usage:" in r.output, args


def test_money_is_fixed_point():
    assert (
        fmt_money(5e-06) == "0.000005" and fmt_money(0) == "0.000000" and fmt_money(1234.5) == "1,234.500000"
    )
    assert "e-" not in fmt_money(1e-9)


def test_listings_are_tables_with_a_json_twin(tmp_path):
    runner = CliRunner()
    secret = runner.invoke(
        main, ["keys", "create", "--name", "alice", "--home", str(tmp_path)]
    ).stdout.strip()
    table = runner.invoke(main, ["keys", "list", "--home", str(tmp_path)]).stdout
    assert "alice" in table and "│" in table and secret not in table and "\t" not in table
    (row,) = json.loads(runner.invoke(main, ["keys", "list", "--home", str(tmp_path), "--json"]).stdout)
    assert row["name"] == "alice" and row["status"] == "active"
    assert json.loads(runner.invoke(main, ["checkpoints", "--home", str(tmp_path), "--json"]).stdout) == []
    # piped (CliRunner is not a terminal): price columns keep their width, fixed-point, named models
    out = runner.invoke(main, ["models", "--home", str(tmp_path)], env={"COLUMNS": "60"}).stdout
    smol = next(line for line in out.splitlines() if "SmolLM2-135M-Instruct" in line)
    assert "0.010" in smol and "0.002" in smol and "e-0" not in out
    rows = json.loads(runner.invoke(main, ["models", "--home", str(tmp_path), "--json"]).stdout)
    assert all(r["name"] and r["pricing"]["prefill"] >= 0 for r in rows)


def test_models_lists_the_real_models_with_their_licenses(tmp_path):
    """Offline: the real models trine builds from PyPI are listed with their licenses before they
    are built; only SmolLM2 is the default; a built one is listed as downloaded."""
    runner = CliRunner()
    rows = {
        r["name"]: r
        for r in json.loads(runner.invoke(main, ["models", "--home", str(tmp_path), "--json"]).stdout)
    }
    gemma, smol = rows["gemma-3-270m"], rows["SmolLM2-135M-Instruct"]
    assert (
        gemma["license"] == "Gemma Terms of Use"
        and gemma["license_url"] == "https://ai.google.dev/gemma/terms"
    )
    assert gemma["status"] == "built on first use" and smol["status"] == "built on first use (the default)"
    assert smol["license"] == "Apache-2.0" and gemma["pricing"]["rate_row"] == "gemma-3-270m"
    out = runner.invoke(main, ["models", "--home", str(tmp_path)], env={"COLUMNS": "200"}).stdout
    assert "Gemma Terms of Use" in next(line for line in out.splitlines() if "gemma-3-270m" in line)
    (tmp_path / "models" / "gemma-3-270m").mkdir(parents=True)
    (tmp_path / "models" / "gemma-3-270m" / "config.json").write_text("{}")
    rows = {
        r["name"]: r
        for r in json.loads(runner.invoke(main, ["models", "--home", str(tmp_path), "--json"]).stdout)
    }
    assert (
        rows["gemma-3-270m"]["status"] == "downloaded"
        and rows["gemma-3-270m"]["license"] == "Gemma Terms of Use"
    )


def test_serve_refuses_a_port_in_use_before_loading(tiny_model_dir, tmp_path):
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        r = CliRunner().invoke(
            main, ["serve", "--model", str(tiny_model_dir), "--port", str(port), "--home", str(tmp_path)]
        )
    assert r.exit_code == 1 and "already in use" in r.output and "Traceback" not in r.output
    assert len(r.output.strip().splitlines()) == 1
    assert not (tmp_path / "trine.db").exists()  # nothing was set up


def test_serve_takes_a_qwen3_5_checkpoint_past_the_family_check(tiny_qwen3_5_dir, tmp_path):
    """A hybrid Qwen3.5 directory is a family `trine serve` runs: it gets as far as the port check
    (a busy port here, so nothing loads)."""
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        r = CliRunner().invoke(
            main, ["serve", "--model", str(tiny_qwen3_5_dir), "--port", str(port), "--home", str(tmp_path)]
        )
    assert r.exit_code == 1 and "already in use" in r.output and "qwen3_5" not in r.output


def test_serve_refuses_an_unsupported_model_family_in_one_line(tmp_path):
    model = tmp_path / "gpt2-small"
    model.mkdir()
    (model / "config.json").write_text(json.dumps({"model_type": "gpt2", "n_embd": 8}))
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    r = CliRunner().invoke(
        main, ["serve", "--model", str(model), "--port", str(port), "--home", str(tmp_path)]
    )
    assert r.exit_code == 1 and "'gpt2' is not supported" in r.output and "Traceback" not in r.output
    assert len(r.output.strip().splitlines()) == 1


def test_serve_says_how_to_get_a_key_when_keys_exist(tmp_path):
    store = Store(tmp_path)
    store.create_key("default")
    (tmp_path / "embedded.key").write_text("trine-x")
    hint = key_hint(store, tmp_path, None)
    assert "trine keys create --name NAME" in hint and str(tmp_path / "embedded.key") in hint
    assert "1 active" in hint
    assert "trine-abc" in key_hint(store, tmp_path, "trine-abc")


@pytest.fixture(scope="module")
def server(tiny_model_dir, tmp_path_factory):
    from serverutil import serve

    with serve(tiny_model_dir, tmp_path_factory.mktemp("home")) as srv:
        yield srv


def test_usage_by_run_names_each_run_with_its_model_and_creation_time(server):
    import trine as trio

    with trio.ServiceClient(api_key=server.api_key, base_url=server.url) as service:
        trainer = service.create_lora_training_client("tiny-llama", rank=4)
        datum = trio.Datum(
            model_input=trio.ModelInput.from_ints([5, 6, 7, 8]),
            loss_fn_inputs={"target_tokens": [6, 7, 8, 9]},
        )
        trainer.forward_backward([datum], "cross_entropy").result()
        sampler = service.create_sampling_client(base_model="tiny-llama")
        sampler.sample(trio.ModelInput.from_ints([5, 6, 7]), 1, trio.SamplingParams(max_tokens=2)).result()
    runner = CliRunner()
    for args in (["--url", server.url, "--api-key", server.api_key], ["--home", str(server.home)]):
        rows = json.loads(runner.invoke(main, ["usage", "--by", "run", "--json", *args]).stdout)["rows"]
        info = {r["key"]: r["info"] for r in rows}
        assert info[trainer.training_run_id]["name"] == "training #1"
        assert info[sampler.sampling_run_id]["name"] == "base model"
        assert {i["model"] for i in info.values()} == {"tiny-llama"}
        assert all(abs(i["created_at"] - time.time()) < 600 for i in info.values())
    table = runner.invoke(main, ["usage", "--by", "run", "--home", str(server.home)]).stdout
    assert "training #1" in table and "base model" in table and "e-0" not in table


def test_access_log_names_method_route_status_key_and_latency(server, caplog):
    from trine.server.http import access_log

    caplog.set_level(logging.INFO, logger="trine.access")
    if True:
        srv = server
        ok = httpx.get(
            srv.url + "/api/openapi/v1/api-key/verify?x=secret",
            headers={"X-API-Key": srv.api_key},
            trust_env=False,
        )
        bad = httpx.get(
            srv.url + "/api/openapi/v1/api-key/verify", headers={"X-API-Key": "trine-no"}, trust_env=False
        )
        deadline = time.monotonic() + 5  # a line is logged once its response is sent: allow it a moment
        while (
            len(lines := [r.getMessage() for r in caplog.records if r.name == "trine.access"]) < 2
            and time.monotonic() < deadline
        ):
            time.sleep(0.01)
        assert ok.status_code == 200 and bad.status_code == 401
        assert any(
            m.startswith("GET /api/openapi/v1/api-key/verify 200 key=embedded ") and m.endswith(" ms")
            for m in lines
        ), lines
        assert any(" 401 key=- " in m for m in lines) and not any("secret" in m for m in lines)
        access_log.configure(quiet=True)  # `trine serve --quiet`
        try:
            caplog.clear()
            httpx.get(srv.url + "/", trust_env=False)
            time.sleep(0.2)
            assert not [r for r in caplog.records if r.name == "trine.access"]
        finally:
            logging.getLogger("trine.access").setLevel(logging.NOTSET)
