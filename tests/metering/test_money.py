"""Money is fixed-point on every surface: JSON APIs (usage, sample and training results, OpenAI
usage, Tinker billing, the console), the CLI's JSON and the SDK's `Usage` repr. No `6.7e-07`, no
`0.014000000000000002`."""

from __future__ import annotations

import json
import re

import httpx
import pytest
from click.testing import CliRunner
from serverutil import serve

import trine as trio
from trine.cli.main import main
from trine.metering.money import dumps, money, money_text

MODEL = "tiny-llama"
EXPONENT = re.compile(r"\d[eE][+-]?\d")  # a number written with an exponent
LONG_TAIL = re.compile(r"\.\d{13,}")  # float noise such as 0.014000000000000002 (money keeps 12 places)


def test_money_text_and_json_are_fixed_point():
    assert money_text(6.7e-07) == "0.00000067" and money_text(4.48e-05) == "0.0000448"
    assert (
        money_text(0.014000000000000002) == "0.014" and money_text(0) == "0.0" and money_text(12.5) == "12.5"
    )
    text = dumps({"cost": money(6.7e-07), "total": [money(0.1 + 0.2)], "logprob": -1.5e-07})
    assert json.loads(text) == {"cost": 6.7e-07, "total": [0.3], "logprob": -1.5e-07}
    assert '"cost": 0.00000067' in text and '"total": [0.3]' in text
    assert "-1.5e-07" in text  # only amounts are money; other floats keep their exact repr
    assert repr(money(5.7000000000000005e-06)) == "0.0000057" and money(None) is None


def test_sdk_usage_repr_is_fixed_point():
    u = trio.Usage.from_wire({"train_tokens": 19, "loss_tokens": 19}, cost=5.7000000000000005e-06)
    assert "cost=0.0000057" in repr(u) and "e-06" not in repr(u) and u.cost == 5.7e-06
    total = trio.Usage(cost=0.1) + trio.Usage(cost=0.2)
    assert total.cost == 0.3 and "cost=0.3)" in repr(total)


@pytest.fixture(scope="module")
def used(tiny_model_dir, tmp_path_factory):
    """A server after some training and sampling, with tiny prices (every amount below 1e-4)."""
    with (
        serve(tiny_model_dir, tmp_path_factory.mktemp("home")) as srv,
        trio.ServiceClient(api_key=srv.api_key, base_url=srv.url) as service,
    ):
        trainer = service.create_lora_training_client(MODEL, rank=4)
        ids = list(range(5, 28))
        datum = trio.Datum(
            model_input=trio.ModelInput.from_ints(ids[:-1]), loss_fn_inputs={"target_tokens": ids[1:]}
        )
        for _ in range(3):
            trainer.forward_backward([datum], "cross_entropy")
            trainer.optim_step(trio.AdamParams(learning_rate=1e-3)).result()
        sampler = trainer.save_weights_and_get_sampling_client()
        sampler.sample(trio.ModelInput.from_ints(ids[:6]), 2, trio.SamplingParams(max_tokens=3)).result()
        yield srv, service, trainer


def assert_fixed_point(text: str, where: str) -> None:
    amounts = re.findall(
        r'"(?:cost|total|prefill|prefill_cached|sample|train|cost_lost|estimated_cost_usd|'
        r'effective_rate_usd_per_million_tokens|storage_gb_month)":\s*(-?[0-9.eE+-]+)',
        text,
    )
    assert amounts, f"{where}: no amounts found in {text[:300]}"
    bad = [a for a in amounts if EXPONENT.search(a) or LONG_TAIL.search(a)]
    assert not bad, f"{where}: amounts not fixed-point: {bad}"


def test_every_json_surface_writes_amounts_fixed_point(used):
    srv, _, trainer = used
    h = {"X-API-Key": srv.api_key, "Authorization": f"Bearer {srv.api_key}"}
    get = lambda path: httpx.get(srv.url + path, headers=h, timeout=30)  # noqa: E731
    usage = get("/api/trine/v1/usage?by=run")
    assert usage.json()["total"]["cost"]["total"] > 0
    assert_fixed_point(usage.text, "usage report")
    assert_fixed_point(get("/api/trine/v1/rates").text, "rates")
    assert_fixed_point(get("/api/models").text, "model list pricing")
    run = get(f"/console/api/runs/{trainer.training_run_id}")
    assert all(s["cost"] > 0 for s in run.json()["steps"])
    assert_fixed_point(run.text, "console run")
    assert_fixed_point(get("/api/v1/billing/usage/events").text.replace("'", '"'), "tinker billing")
    chat = httpx.post(
        f"{srv.url}/v1/chat/completions",
        headers=h,
        timeout=60,
        json={"model": MODEL, "max_tokens": 2, "messages": [{"role": "user", "content": "Hi"}]},
    )
    assert chat.status_code == 200 and chat.json()["usage"]["cost"] > 0
    assert_fixed_point(chat.text, "openai usage")


def test_cli_json_writes_amounts_fixed_point(used):
    srv, _, _ = used
    r = CliRunner().invoke(main, ["usage", "--url", srv.url, "--api-key", srv.api_key, "--json"])
    assert r.exit_code == 0, r.output
    assert_fixed_point(r.stdout, "trine usage --json")
    r = CliRunner().invoke(
        main,
        [
            "estimate",
            "--model",
            "SmolLM2-135M-Instruct",
            "--prompt-tokens",
            "3",
            "--completion-tokens",
            "1",
            "--json",
        ],
    )
    assert r.exit_code == 0, r.output
    assert_fixed_point(r.stdout, "trine estimate --json")
