"""Checkpoints as a user meets them on every surface: the step they record is the training step, the
CLI lists and exports them from a remote server (`--url`) by the id it shows, restoring optimizer
state from sampler-only weights says why it cannot, and the SDK takes Tinker's `tinker://` paths."""

from __future__ import annotations

import json

import httpx
import pytest
from click.testing import CliRunner
from serverutil import serve

import trine as trio
from trine.cli.main import main

MODEL = "tiny-llama"
OPTIM_STEPS = 4


@pytest.fixture(scope="module")
def trained(tiny_model_dir, tmp_path_factory):
    """A server, a client, and a run with 4 optim steps (pipelined, two chunks a step) then saves."""
    with (
        serve(tiny_model_dir, tmp_path_factory.mktemp("home")) as srv,
        trio.ServiceClient(api_key=srv.api_key, base_url=srv.url) as service,
    ):
        trainer = service.create_lora_training_client(MODEL, rank=4)
        ids = list(range(5, 30))
        datum = trio.Datum(
            model_input=trio.ModelInput.from_ints(ids[:-1]), loss_fn_inputs={"target_tokens": ids[1:]}
        )
        for _ in range(OPTIM_STEPS):
            trainer.forward_backward([datum, datum], "cross_entropy")
            trainer.optim_step(trio.AdamParams(learning_rate=1e-3))
        state = trainer.save_state("s4").result()
        weights = trainer.save_weights_for_sampler("w4").result()
        yield srv, service, trainer, state, weights, datum


def cli(*args, env=None):
    r = CliRunner().invoke(main, list(args), env=env)
    assert r.exit_code == 0, r.output
    return r.stdout


def test_a_checkpoint_records_the_training_step_not_an_event_index(trained):
    srv, service, trainer, state, weights, _ = trained
    listed = service.create_rest_client().list_checkpoints(trainer.training_run_id).result().checkpoints
    assert {c.path for c in listed} == {state.path, weights.path}
    raw = httpx.get(
        f"{srv.url}/api/openapi/v1/training-runs/{trainer.training_run_id}/checkpoints",
        headers={"X-API-Key": srv.api_key},
    ).json()["checkpoints"]
    assert [c["step"] for c in raw] == [OPTIM_STEPS, OPTIM_STEPS]
    console = httpx.get(
        f"{srv.url}/console/api/runs/{trainer.training_run_id}", headers={"X-API-Key": srv.api_key}
    ).json()["checkpoints"]
    assert [c["step"] for c in console] == [OPTIM_STEPS, OPTIM_STEPS]
    from trine.sizes import fmt_size  # the console shows the CLI's size text

    assert all(c["size"] == fmt_size(c["size_bytes"]) for c in console)
    # a run restored from the state goes on counting from the state's step
    resumed = service.create_training_client_from_state_with_optimizer(state.path)
    resumed.optim_step(trio.AdamParams(learning_rate=1e-3)).result()
    again = resumed.save_state("s5").result()
    (ck,) = [
        c
        for c in httpx.get(
            f"{srv.url}/api/openapi/v1/training-runs/{resumed.training_run_id}/checkpoints",
            headers={"X-API-Key": srv.api_key},
        ).json()["checkpoints"]
        if c["checkpoint_uri"] == again.path
    ]
    assert ck["step"] == OPTIM_STEPS + 1


def test_trine_checkpoints_lists_a_remote_servers_checkpoints_with_the_id_export_takes(trained):
    srv, _, trainer, state, weights, _ = trained
    records = json.loads(cli("checkpoints", "--url", srv.url, "--api-key", srv.api_key, "--json"))
    by_uri = {r["uri"]: r for r in records}
    assert set(by_uri) >= {state.path, weights.path}
    assert by_uri[weights.path]["id"].startswith("ck_") and by_uri[weights.path]["step"] == OPTIM_STEPS
    assert "path" not in by_uri[weights.path]  # a server never shows its paths
    # the key may come from the environment; the table shows the id beside the URI
    table = cli(
        "checkpoints", "--url", srv.url, "--run", trainer.training_run_id, env={"TRINE_API_KEY": srv.api_key}
    )
    row = next(line for line in table.splitlines() if by_uri[weights.path]["id"] in line)
    assert "sampler" in row
    from trine.sizes import fmt_size  # the console shows the same text (its checkpoint rows' "size")

    assert fmt_size(by_uri[weights.path]["size_bytes"]) in row
    # a wrong key is refused in one line, not a traceback
    bad = CliRunner().invoke(main, ["checkpoints", "--url", srv.url, "--api-key", "trine-wrong"])
    assert bad.exit_code == 1 and "401" in bad.output and "Traceback" not in bad.output


def test_trine_export_downloads_from_a_remote_server_by_id_uri_or_tinker_path(trained, tmp_path):
    srv, _, _, _, weights, _ = trained
    records = json.loads(cli("checkpoints", "--url", srv.url, "--api-key", srv.api_key, "--json"))
    ck_id = next(r["id"] for r in records if r["uri"] == weights.path)
    tinker_path = weights.path.replace("trio://", "tinker://").replace("/weights/", "/sampler_weights/")
    for name, ref in (("by-id", ck_id), ("by-uri", weights.path), ("by-tinker", tinker_path)):
        out = tmp_path / name
        text = cli("export", ref, str(out), "--url", srv.url, "--api-key", srv.api_key)
        assert "wrote the PEFT adapter" in text
        assert sorted(p.name for p in out.iterdir()) == [
            "adapter_config.json",
            "adapter_model.safetensors",
            "trine_checkpoint.json",
        ]
        assert json.loads((out / "trine_checkpoint.json").read_text())["base_model"] == MODEL
    missing = CliRunner().invoke(
        main, ["export", "ck_nope", str(tmp_path / "x"), "--url", srv.url, "--api-key", srv.api_key]
    )
    assert missing.exit_code == 2 and "trine checkpoints --url" in missing.output


def test_restoring_optimizer_state_from_sampler_weights_says_it_has_none_and_how_to_fix_it(trained):
    srv, service, trainer, _, weights, datum = trained
    with pytest.raises(trio.TrineError) as e:
        service.create_training_client_from_state_with_optimizer(weights.path)
    msg = str(e.value)
    assert "no optimizer state" in msg and "save_state" in msg and "create_training_client_from_state" in msg
    assert getattr(e.value, "status_code", 400) == 400
    fresh = service.create_lora_training_client(MODEL, rank=4)
    with pytest.raises(trio.TrineError, match="no optimizer state"):
        fresh.load_state_with_optimizer(weights.path)
    # its weights alone do restore, with a fresh optimizer
    weights_only = service.create_training_client_from_state(weights.path)
    assert weights_only.forward_backward([datum], "cross_entropy").result().metrics["loss_mean"] > 0


def test_the_sdk_takes_tinker_paths_as_the_openai_routes_do(trained):
    srv, service, trainer, state, weights, datum = trained
    tinker_weights = weights.path.replace("trio://", "tinker://").replace("/weights/", "/sampler_weights/")
    tinker_state = state.path.replace("trio://", "tinker://").replace("/state/", "/weights/")
    prompt = trio.ModelInput.from_ints([5, 6, 7, 8])
    params = trio.SamplingParams(max_tokens=4, temperature=0.0)
    by_trio = service.create_sampling_client(model_path=weights.path).sample(prompt, 1, params).result()
    by_tinker = service.create_sampling_client(model_path=tinker_weights).sample(prompt, 1, params).result()
    assert by_tinker.sequences[0].tokens == by_trio.sequences[0].tokens
    restored = service.create_training_client_from_state(tinker_state)
    assert restored.forward_backward([datum], "cross_entropy").result().metrics["loss_mean"] > 0
    with pytest.raises(trio.ValidationError, match="tinker://<run>/<weights|sampler_weights>/<name>"):
        service.create_sampling_client(model_path="tinker://run/nonsense/x")
