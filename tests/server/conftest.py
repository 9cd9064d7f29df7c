"""Fixtures of the Tinker tests: a real trine server (module scoped, in the environment the official
`tinker` client needs) and that client on it. A module that needs another server defines its own
`srv`, which takes precedence."""

from __future__ import annotations

import pytest
from serverutil import serve, tinker_env


@pytest.fixture(scope="module")
def srv(tiny_model_dir, tmp_path_factory):
    with tinker_env(), serve(tiny_model_dir, tmp_path_factory.mktemp("home")) as handle:
        yield handle


@pytest.fixture(scope="module")
def sc(srv):
    """The official tinker ServiceClient on `srv`, with the server's key."""
    tinker = pytest.importorskip("tinker")
    c = tinker.ServiceClient(base_url=srv.url, api_key="tml-" + srv.api_key)
    yield c
    c.close("success").result()
