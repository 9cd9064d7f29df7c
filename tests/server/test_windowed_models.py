"""Every plane offers the sliding-window families: a server serving a tiny Gemma 3 (with Gemma's chat
template) and a tiny OLMo 3 (with SmolLM2's) lists them in the PyTRIO catalog with their
capabilities, in Tinker's `get_server_capabilities` and in OpenAI's `/v1/models`, and each chat
request is rendered with its own checkpoint's template."""

from __future__ import annotations

import shutil

import httpx
import pytest
from serverutil import serve
from transformers import AutoTokenizer

from trine.engine.model.default_model import GEMMA3_CHAT_TEMPLATE

MODELS = ("tiny-gemma3", "tiny-olmo3")


@pytest.fixture(scope="module")
def dirs(tiny_windowed_dirs, tmp_path_factory):
    gemma = shutil.copytree(tiny_windowed_dirs["gemma3"], tmp_path_factory.mktemp("gemma") / "tiny-gemma3")
    (gemma / "chat_template.jinja").write_text(GEMMA3_CHAT_TEMPLATE)
    return {"tiny-gemma3": gemma, "tiny-olmo3": tiny_windowed_dirs["olmo3"]}


@pytest.fixture(scope="module")
def server(dirs, tmp_path_factory):
    with serve(dirs, tmp_path_factory.mktemp("home")) as srv:
        yield srv


def get(server, path: str, key: str | None = None) -> dict:
    headers = {"X-API-Key": key or server.api_key, "Authorization": f"Bearer {server.api_key}"}
    r = httpx.get(server.url + path, headers=headers, trust_env=False, timeout=60)
    assert r.status_code == 200, (path, r.text)
    return r.json()


def test_the_catalogs_of_every_plane_list_both_families(server):
    items = {m["name"]: m for m in get(server, "/api/models")["items"]}
    assert {n: items[n]["architecture"] for n in MODELS} == {
        "tiny-gemma3": "gemma3_text",
        "tiny-olmo3": "olmo3",
    }
    for name in MODELS:
        assert items[name]["train_available"] and items[name]["sample_available"]
        assert items[name]["trainer"] == items[name]["sampler"] and items[name]["context_length"] == 4096
    tinker = get(server, "/api/v1/get_server_capabilities", "tml-" + server.api_key)["supported_models"]
    assert {m["model_name"]: m["max_context_length"] for m in tinker} == dict.fromkeys(MODELS, 4096)
    assert {m["id"] for m in get(server, "/v1/models")["data"]} >= set(MODELS)


@pytest.mark.parametrize("name", MODELS)
def test_a_chat_is_rendered_with_the_checkpoints_own_template(server, dirs, name):
    """Gemma's `<start_of_turn>` turns for the Gemma model, SmolLM2's ChatML for the OLMo one: the
    prompt the server samples from is the template as transformers applies it."""
    tok = AutoTokenizer.from_pretrained(str(dirs[name]), local_files_only=True)
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Name a colour."}]
    want = list(
        tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=False)
    )
    assert ("<start_of_turn>" in tok.decode(want)) == (name == "tiny-gemma3")
    body = {"model": name, "messages": messages, "max_tokens": 6, "temperature": 0, "return_token_ids": True}
    r = httpx.post(
        server.url + "/v1/chat/completions",
        json=body,
        headers={"Authorization": f"Bearer {server.api_key}"},
        trust_env=False,
        timeout=120,
    )
    assert r.status_code == 200, r.text
    out = r.json()
    assert out["prompt_token_ids"] == want and out["usage"]["prompt_tokens"] == len(want)
    assert out["usage"]["completion_tokens"] == len(out["choices"][0]["token_ids"]) > 0
