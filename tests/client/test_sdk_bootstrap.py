"""The SDK's first minutes: fail fast when no server answers, log retries once, read the profile
`trio login` saved, and raise trio.ValidationError for every bad parameter."""

from __future__ import annotations

import logging
import socket
import time

import pytest

import trine as trio
from trine.client.http import Settings
from trine.client.profile import load_profile

ENV = ("TRINE_API_KEY", "TRINE_BASE_URL", "PYTRIO_API_KEY", "PYTRIO_BASE_URL", "PYTRIO_ENV")


@pytest.fixture(scope="module")
def server(tiny_model_dir, tmp_path_factory):
    from serverutil import serve

    with serve(tiny_model_dir, tmp_path_factory.mktemp("home")) as srv:
        yield srv


@pytest.fixture
def clean_env(monkeypatch, tmp_path):
    for name in ENV:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("HOME", str(tmp_path))
    return tmp_path


def closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_no_server_fails_in_seconds_with_what_to_do(caplog):
    assert Settings().connect_check_s <= 5
    url = f"http://127.0.0.1:{closed_port()}"
    caplog.set_level(logging.INFO, logger="trine.client")
    start = time.monotonic()
    with pytest.raises(trio.TrineError) as e:
        trio.ServiceClient(api_key="trine-x", base_url=url, settings=Settings(connect_check_s=1.0))
    assert time.monotonic() - start < 4
    assert f"cannot reach the trine server at {url}" in str(e.value) and "trine serve" in str(e.value)
    retries = [r for r in caplog.records if r.name == "trine.client"]
    assert len(retries) == 1 and "retrying for up to 1 s" in retries[0].getMessage()  # once, not per attempt


def test_validation_errors_are_trine_errors():
    for make, field in (
        (lambda: trio.SamplingParams(max_tokens=0), "max_tokens"),
        (lambda: trio.SamplingParams(max_tokens="many"), "max_tokens"),
        (lambda: trio.AdamParams(learning_rate=float("nan")), "learning_rate"),
        (lambda: trio.SamplingParams(max_token=3), "max_token"),
    ):
        with pytest.raises(trio.ValidationError) as e:
            make()
        assert isinstance(e.value, trio.TrineError) and isinstance(e.value, ValueError)
        assert field in str(e.value)


def test_sdk_reads_the_trio_login_profile(server, clean_env, monkeypatch):
    home = clean_env
    assert load_profile() is None
    (home / ".pytrio").mkdir()
    (home / ".pytrio" / "config.toml").write_text(
        f'api_key = "{server.api_key}"\nbase_url = "{server.url}"\n'
    )
    with trio.ServiceClient() as service:  # no argument, no environment: the profile
        assert service.base_url == server.url and service.get_supported_models()
    # a named profile (`trio env use staging`) wins when active
    (home / ".pytrio" / "envs" / "staging").mkdir(parents=True)
    staging = home / ".pytrio" / "envs" / "staging" / "config.toml"
    staging.write_text(f'api_key = "trine-wrong"\nbase_url = "{server.url}"\n')
    (home / ".pytrio" / "env.toml").write_text('active_env = "staging"\n')
    with pytest.raises(trio.AuthError) as e:
        trio.ServiceClient()
    assert str(staging) in str(e.value) and "trio login" in str(e.value)
    # the environment still comes first
    monkeypatch.setenv("TRINE_API_KEY", server.api_key)
    monkeypatch.setenv("TRINE_BASE_URL", server.url)
    trio.ServiceClient().close()


def test_missing_key_says_how_to_get_one(clean_env):
    with pytest.raises(trio.AuthError) as e:
        trio.ServiceClient()
    assert "trine keys create --name NAME" in str(e.value)
