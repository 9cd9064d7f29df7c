"""The OpenAI-compatible API with the official `openai` client against a trine server on a tiny model.

One server per module; the prompts of each test differ, so no test's prefix cache helps another.
"""

from __future__ import annotations

import time

import httpx
import openai
import pytest
from serverutil import serve
from transformers import AutoTokenizer

import trine as trio

MODEL = "tiny-llama"
BLOCK = 16
SYSTEM = (
    "You are a careful assistant for a test suite. Answer briefly, state your assumptions, "
    "and never invent facts you were not given in the conversation so far."
)


@pytest.fixture(scope="module")
def server(tiny_model_dir, tmp_path_factory):
    with serve(tiny_model_dir, tmp_path_factory.mktemp("openai-home")) as srv:
        yield srv


def client(server, key: str | None = None, prefix: str = "/v1") -> openai.OpenAI:
    return openai.OpenAI(
        base_url=server.url + prefix,
        api_key=key or server.api_key,
        max_retries=0,
        http_client=httpx.Client(trust_env=False, timeout=60),
    )


@pytest.fixture(scope="module")
def oai(server):
    return client(server)


@pytest.fixture(scope="module")
def hf_tok(tiny_model_dir):
    return AutoTokenizer.from_pretrained(str(tiny_model_dir), local_files_only=True)


def chat_ids(tok, messages) -> list[int]:
    return list(
        tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=False)
    )


def usage_events(server, request_id: str) -> list[dict]:
    r = httpx.get(
        f"{server.url}/api/trine/v1/usage/events",
        trust_env=False,
        headers={"Authorization": f"Bearer {server.api_key}"},
    )
    r.raise_for_status()
    return [e for e in r.json()["events"] if e["request_id"] == request_id]


# ----------------------------------------------------------------------------- chat and completions
def test_chat_sync_and_streaming_agree_with_the_chat_template(oai, hf_tok):
    messages = [{"role": "user", "content": "Name three colours of the rainbow."}]
    full = oai.chat.completions.create(
        model=MODEL, messages=messages, max_tokens=12, temperature=0, extra_body={"return_token_ids": True}
    )
    choice = full.choices[0]
    assert full.object == "chat.completion" and full.model == MODEL
    assert choice.message.role == "assistant" and choice.finish_reason == "length"
    assert full.prompt_token_ids == chat_ids(hf_tok, messages)  # the template, as transformers applies it
    assert len(choice.token_ids) == 12 == full.usage.completion_tokens
    assert full.usage.prompt_tokens == len(full.prompt_token_ids)
    assert full.usage.total_tokens == full.usage.prompt_tokens + 12

    # streaming, with a stop string from the middle of the greedy answer
    stop = hf_tok.decode(choice.token_ids[5:7])
    cut = oai.chat.completions.create(
        model=MODEL, messages=messages, max_tokens=12, temperature=0, stop=[stop]
    )
    assert cut.choices[0].finish_reason == "stop"
    assert cut.choices[0].message.content == choice.message.content.split(stop)[0]
    for want, kw in ((full, {}), (cut, {"stop": [stop]})):
        chunks = list(
            oai.chat.completions.create(
                model=MODEL,
                messages=messages,
                max_tokens=12,
                temperature=0,
                stream=True,
                stream_options={"include_usage": True},
                **kw,
            )
        )
        assert chunks[0].choices[0].delta.role == "assistant"
        text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        assert text == want.choices[0].message.content
        finish = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
        assert finish == [want.choices[0].finish_reason]
        assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == want.usage.completion_tokens
        assert all(c.usage is None for c in chunks[:-1])


def test_completions_text_and_token_ids_sync_and_streaming(oai, hf_tok):
    text = "Once upon a time, in a quiet village by the sea,"
    ids = hf_tok.encode(text, add_special_tokens=True)
    a = oai.completions.create(model=MODEL, prompt=text, max_tokens=10, temperature=0, logprobs=2)
    b = oai.completions.create(model=MODEL, prompt=ids, max_tokens=10, temperature=0)
    assert a.object == "text_completion" and a.choices[0].text == b.choices[0].text
    assert a.usage.prompt_tokens == len(ids) and a.usage.completion_tokens == 10
    lp = a.choices[0].logprobs
    assert "".join(lp.tokens) == a.choices[0].text and len(lp.token_logprobs) == 10
    assert all(len(top) == 2 and max(top.values()) >= x for top, x in zip(lp.top_logprobs, lp.token_logprobs))
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(10)]
    chunks = list(
        oai.completions.create(
            model=MODEL, prompt=text, max_tokens=10, temperature=0, stream=True, logprobs=2
        )
    )
    assert "".join(c.choices[0].text for c in chunks) == a.choices[0].text
    # bit for bit (kind 1): the same request alone, streamed or not, is the same computation
    assert [x for c in chunks for x in c.choices[0].logprobs.token_logprobs] == lp.token_logprobs
    assert chunks[-1].choices[0].finish_reason == "length"


def test_all_three_paths_serve_the_same_api(server, hf_tok):
    answers = set()
    for prefix in ("/v1", "/api/openai/v1", "/oai/api/v1"):
        c = client(server, prefix=prefix)
        assert [m.id for m in c.models.list()][0] == MODEL
        r = c.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "Hello?"}], max_tokens=4, temperature=0
        )
        answers.add(r.choices[0].message.content)
    assert len(answers) == 1


# ----------------------------------------------------------------------------- prefill sharing and the cache
def test_n_choices_share_one_prefill_in_the_metered_usage(server, oai):
    messages = [{"role": "user", "content": "Write a short line about mountains and rivers, please."}]
    r = oai.chat.completions.create(model=MODEL, messages=messages, n=4, max_tokens=6, seed=11)
    assert len(r.choices) == 4 and [c.index for c in r.choices] == [0, 1, 2, 3]
    assert len({c.message.content for c in r.choices}) > 1  # four samples, not one copied
    p = r.usage.prompt_tokens
    assert r.usage.completion_tokens == 24 and r.usage.total_tokens == p + 24
    (event,) = usage_events(server, r.id)
    assert event["operation"] == "sample" and event["base_model"] == MODEL
    assert event["prefill"] + event["prefill_cached"] == p  # once, not 4 x p
    assert event["prefill"] == p - r.usage.prompt_tokens_details.cached_tokens
    assert event["sample"] == 24
    report = httpx.get(
        f"{server.url}/api/trine/v1/usage",
        params={"run_id": event["run_id"]},
        headers={"Authorization": f"Bearer {server.api_key}"},
        trust_env=False,
    ).json()
    total = report["total"]  # what `trine usage --url ...` shows: this run's requests, priced
    assert total["tokens"]["sample"] >= 24
    assert 0 < r.usage.model_extra["cost"] <= total["cost"]["total"]


def test_second_turn_hits_the_cache_for_the_conversations_full_blocks(oai, hf_tok):
    first = [
        {"role": "system", "content": SYSTEM},
        {"role": "user", "content": "Plan a three-day walking trip through the hills."},
    ]
    r1 = oai.chat.completions.create(
        model=MODEL, messages=first, max_tokens=20, temperature=0, extra_body={"return_token_ids": True}
    )
    assert r1.usage.prompt_tokens_details.cached_tokens == 0
    second = first + [
        {"role": "assistant", "content": r1.choices[0].message.content},
        {"role": "user", "content": "Make the second day shorter."},
    ]
    r2 = oai.chat.completions.create(
        model=MODEL, messages=second, max_tokens=4, temperature=0, extra_body={"return_token_ids": True}
    )
    seen = r1.prompt_token_ids + r1.choices[0].token_ids  # what the server computed KV for (but the last)
    prompt = r2.prompt_token_ids
    common = next((i for i, (a, b) in enumerate(zip(seen, prompt)) if a != b), min(len(seen), len(prompt)))
    full_blocks = min(common, len(seen) - 1, len(prompt) - 1) // BLOCK * BLOCK
    cached = r2.usage.prompt_tokens_details.cached_tokens
    assert cached > 0 and cached == full_blocks
    assert cached >= len(r1.prompt_token_ids) // BLOCK * BLOCK  # the whole first turn's full blocks


# ----------------------------------------------------------------------------- trained weights
def test_trained_adapter_answers_through_its_checkpoint(server, oai, hf_tok):
    question = [{"role": "user", "content": "What is the secret word?"}]
    answer = " The secret word is marmalade."
    prompt = chat_ids(hf_tok, question)
    target = hf_tok.encode(answer, add_special_tokens=False)
    tokens = prompt + target
    datum = trio.Datum(
        model_input=trio.ModelInput.from_ints(tokens[:-1]),
        loss_fn_inputs={
            "target_tokens": tokens[1:],
            "weights": [0.0] * (len(prompt) - 1) + [1.0] * len(target),
        },
    )
    with trio.ServiceClient(api_key=server.api_key, base_url=server.url) as svc:
        trainer = svc.create_lora_training_client(MODEL, rank=8, seed=0)
        for _ in range(16):
            trainer.forward_backward([datum], "cross_entropy")
            trainer.optim_step(trio.AdamParams(learning_rate=5e-3))
        uri = trainer.save_weights_for_sampler("openai-test").result().path
        sampler = svc.create_sampling_client(model_path=uri)
        sdk = sampler.sample(
            trio.ModelInput.from_ints(prompt),
            num_samples=1,
            sampling_params=trio.SamplingParams(max_tokens=len(target), temperature=0.0),
        ).result()
    assert uri.startswith("trio://")
    listed = {m.id: m for m in oai.models.list()}
    assert uri in listed and listed[uri].root == MODEL
    ck_id = listed[uri].model_extra["checkpoint_id"]
    assert oai.models.retrieve(uri).id == uri and oai.models.retrieve(MODEL).id == MODEL
    for model in (uri, ck_id):
        r = oai.chat.completions.create(
            model=model,
            messages=question,
            max_tokens=len(target),
            temperature=0,
            extra_body={"return_token_ids": True},
        )
        assert r.model == model
        assert r.choices[0].token_ids == sdk.sequences[0].tokens  # the same weights as the SDK's sampler
        assert r.choices[0].message.content == sdk.sequences[0].text == answer  # it learned the answer
    base = oai.chat.completions.create(model=MODEL, messages=question, max_tokens=len(target), temperature=0)
    assert base.choices[0].message.content != answer

    # another key's checkpoint: exactly like a missing one
    other_key = server.service.store.create_key("someone-else")[1]
    other = client(server, other_key)
    assert uri not in {m.id for m in other.models.list()}
    for model in (uri, ck_id, uri.replace("trio://", "tinker://").replace("/weights/", "/sampler_weights/")):
        with pytest.raises(openai.NotFoundError) as e:
            other.chat.completions.create(model=model, messages=question, max_tokens=2)
        assert e.value.body["code"] == "model_not_found" and e.value.body["param"] == "model"
    # the owner may name it by a tinker:// path too
    r = oai.chat.completions.create(
        model=uri.replace("trio://", "tinker://").replace("/weights/", "/sampler_weights/"),
        messages=question,
        max_tokens=len(target),
        temperature=0,
    )
    assert r.choices[0].message.content == answer


# ----------------------------------------------------------------------------- errors
BAD = [
    ({"tools": [{"type": "function", "function": {"name": "f"}}]}, "tools", "unsupported_parameter"),
    (
        {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"if": {}}}}},
        "response_format.json_schema.schema",
        "unsupported_value",
    ),
    ({"extra_body": {"best_of": 2}}, "best_of", "unsupported_parameter"),
    ({"presence_penalty": 2.5}, "presence_penalty", "invalid_value"),
    ({"extra_body": {"repetition_penalty": 0}}, "repetition_penalty", "invalid_value"),
    ({"extra_body": {"min_p": -0.1}}, "min_p", "invalid_value"),
    ({"logit_bias": {"12": 101}}, "logit_bias[12]", "invalid_value"),
    ({"logit_bias": {"999999": 1}}, "logit_bias", "validation_failed"),  # the engine checks the vocabulary
    ({"extra_body": {"frobnicate": 1}}, "frobnicate", "unknown_parameter"),
    ({"temperature": 3}, "temperature", "invalid_value"),
    ({"n": 0}, "n", "invalid_value"),
    ({"top_p": 0}, "top_p", "invalid_value"),
    ({"top_logprobs": 3}, "top_logprobs", "invalid_value"),
    ({"max_tokens": 100000}, "max_tokens", "context_length_exceeded"),
    ({"stop": [""]}, "stop", "invalid_value"),
    ({"messages": []}, "messages", "invalid_value"),
    (
        {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]},
        "messages[0].content[0].image_url.url",
        "unsupported_value",
    ),
    (
        {"messages": [{"role": "user", "content": [{"type": "input_audio", "input_audio": {}}]}]},
        "messages[0].content",
        "invalid_value",
    ),
    ({"messages": [{"role": "wizard", "content": "hi"}]}, "messages[0].role", "invalid_value"),
    ({"stream_options": {"include_usage": True}}, "stream_options", "invalid_value"),
]


@pytest.mark.parametrize("kw,param,code", BAD, ids=[b[1] for b in BAD])
def test_bad_parameters_get_400s_in_openai_error_shape(oai, kw, param, code):
    args = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, **kw}
    with pytest.raises(openai.BadRequestError) as e:
        oai.chat.completions.create(**args)
    err = e.value.body
    assert set(err) == {"message", "type", "param", "code"} and err["type"] == "invalid_request_error"
    assert err["param"] == param and err["code"] == code and param in err["message"]


@pytest.mark.parametrize("key,shown", [("", '""'), (" top_p", '" top_p"'), ("frobnicate", "frobnicate")])
def test_an_unknown_key_is_named_as_written_even_when_empty(server, key, shown):
    auth = {"Authorization": f"Bearer {server.api_key}"}
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, key: 1}
    with httpx.Client(trust_env=False, timeout=30) as h:
        r = h.post(f"{server.url}/v1/chat/completions", json=body, headers=auth)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == key and err["code"] == "unknown_parameter"
    assert err["message"] == f"unrecognized request argument(s): {shown}; remove it"


def test_http_level_errors_keep_the_shape_and_the_server_serves_on(server, oai):
    url, auth = server.url, {"Authorization": f"Bearer {server.api_key}"}
    with httpx.Client(trust_env=False, timeout=30) as h:
        cases = [
            (h.post(f"{url}/v1/chat/completions", content=b"{not json", headers=auth), 400),
            (h.post(f"{url}/v1/completions", json={"model": MODEL, "prompt": ["a", 7]}, headers=auth), 400),
            (h.post(f"{url}/v1/completions", json={"model": MODEL, "prompt": [1, 10**9]}, headers=auth), 400),
            (h.post(f"{url}/v1/chat/completions", json={"model": MODEL}), 401),
            (h.get(f"{url}/v1/models", headers={"Authorization": "Bearer nope"}), 401),
            (h.get(f"{url}/v1/embeddings", headers=auth), 404),
        ]
    for resp, status in cases:
        assert resp.status_code == status, resp.text
        assert set(resp.json()["error"]) == {"message", "type", "param", "code"}
    with pytest.raises(openai.AuthenticationError):
        client(server, "trine-wrong").models.list()
    r = oai.completions.create(model=MODEL, prompt="still here", max_tokens=2)
    assert r.choices[0].text is not None


def wait_until_idle(sampler, seconds: float = 5.0) -> dict:
    deadline = time.monotonic() + seconds
    while (sampler.stats["running"] or sampler.stats["blocks_used"]) and time.monotonic() < deadline:
        time.sleep(0.01)
    return sampler.stats


def test_a_disconnect_mid_stream_frees_its_kv_blocks_at_once(server, oai):
    sampler = server.service.models[MODEL].replicas[0].engine.worker.sampler  # the in-process engine
    before = sampler.stats["sample_tokens"]
    stream = oai.chat.completions.create(
        model=MODEL,
        max_tokens=4000,
        n=2,
        stream=True,
        messages=[{"role": "user", "content": "Tell me a very long story."}],
    )
    got = 0
    for chunk in stream:
        got += bool(chunk.choices and chunk.choices[0].delta.content)
        if got == 3:
            break
    assert sampler.stats["running"] == 2 and sampler.stats["blocks_used"] > 0
    stream.close()  # the client goes away mid-stream
    stats = wait_until_idle(sampler)
    assert stats["running"] == 0 and stats["waiting"] == 0 and stats["blocks_used"] == 0
    generated = stats["sample_tokens"] - before
    assert generated < 4000  # stopped long before its 2 x 4000 tokens
    deadline = time.monotonic() + 10
    while not (events := usage_events(server, chunk.id)) and time.monotonic() < deadline:
        time.sleep(0.05)
    (event,) = events  # what it computed until then is metered
    assert event["prefill"] + event["prefill_cached"] > 0 and got <= event["sample"] <= generated

    # a client that stops waiting for a whole (non-streamed) answer frees the engine as well
    before = sampler.stats["sample_tokens"]
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(
            f"{server.url}/v1/completions",
            trust_env=False,
            timeout=1.0,
            headers={"Authorization": f"Bearer {server.api_key}"},
            json={"model": MODEL, "prompt": "A long tale:", "max_tokens": 4000, "n": 2},
        )
    stats = wait_until_idle(sampler)
    assert stats["running"] == 0 and stats["blocks_used"] == 0
    assert stats["sample_tokens"] - before < 4000


@pytest.mark.parametrize("chat", [True, False], ids=["chat", "completion"])
def test_an_over_long_text_prompt_is_refused_by_its_length_before_tokenizing(server, oai, chat):
    """Far more characters than the context could hold are refused by counting them (tokenizing
    megabytes first would hold a thread and memory for seconds); the server serves on."""
    text = "word " * 600_000  # 3 MB of text
    with pytest.raises(openai.BadRequestError) as e:
        if chat:
            oai.chat.completions.create(
                model=MODEL, messages=[{"role": "user", "content": text}], max_tokens=2
            )
        else:
            oai.completions.create(model=MODEL, prompt=text, max_tokens=2)
    err = e.value.body
    assert err["code"] == "context_length_exceeded" and err["param"] == ("messages" if chat else "prompt")
    assert "characters of text exceed" in err["message"]
    assert oai.completions.create(model=MODEL, prompt="hello", max_tokens=2).choices
