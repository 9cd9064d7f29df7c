"""`trine serve` and `trine keys` as a user runs them."""

from __future__ import annotations

from click.testing import CliRunner
from serverutil import free_port, run_serve_cli, wait_http

from trine.cli.keys import keys
from trine.store import Store


def test_keys_create_list_revoke(tmp_path):
    runner = CliRunner()
    out = runner.invoke(keys, ["create", "--name", "ci", "--home", str(tmp_path)])
    assert out.exit_code == 0
    secret = out.stdout.strip().splitlines()[0]
    rec = Store(tmp_path).key_by_secret(secret)
    assert rec is not None and rec.name == "ci"
    listed = runner.invoke(keys, ["list", "--home", str(tmp_path)]).stdout
    assert rec.id in listed and secret not in listed
    assert runner.invoke(keys, ["revoke", rec.id, "--home", str(tmp_path)]).exit_code == 0
    assert Store(tmp_path).key_by_secret(secret) is None
    assert runner.invoke(keys, ["create", "--name", " ", "--home", str(tmp_path)]).exit_code != 0


def test_an_unknown_gemm_kernel_is_refused_naming_the_flag():
    from trine.cli.main import main

    out = CliRunner().invoke(main, ["serve", "--gemm", "fast"])
    assert out.exit_code == 2 and "--gemm" in out.output and "'fast' is not one of" in out.output


def test_fresh_serve_creates_a_key_and_prints_how_to_connect(tiny_model_dir, tmp_path):
    port = free_port()
    args = ["--model", str(tiny_model_dir), "--port", str(port), "--home", str(tmp_path), "--threads", "1"]
    proc, text, key = run_serve_cli([*args, "--gemm", "linear"])
    try:
        assert f"PYTRIO_BASE_URL=http://127.0.0.1:{port}" in text and "tiny-llama" in text
        r = wait_http(f"http://127.0.0.1:{port}/api/openapi/v1/api-key/verify", key)
        assert r.status_code == 200 and r.json()["api_key_name"] == "default"
        # the forced GEMM kernel, named as the engine's start line names it
        metrics = wait_http(f"http://127.0.0.1:{port}/metrics", key).text
        assert 'op="gemm",path="linear"' in metrics
    finally:
        proc.terminate()
        proc.wait(30)
