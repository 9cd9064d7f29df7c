"""`/v1/completions` as evaluation harnesses use it: echo with logprobs (max_tokens 0 or 1), vLLM's
`prompt_logprobs`, and batches of prompts; with the official `openai` client and raw HTTP.

One server per module; each test's prompts differ, so no test's prefix cache helps another.

Float comparisons: an entry computed the same way twice (an uncached prompt score against
compute_logprobs) is bit for bit; a request's decode rows in a larger batch, or scores served from
or computed on cached blocks against a fresh prefill, are two engine paths: within SERVED_PATHS of
the logprobs' scale (tests/tolerance.py), the rounding tests/engine bounds.
"""

from __future__ import annotations

import httpx
import openai
import pytest
from serverutil import serve
from tolerance import assert_served_paths
from transformers import AutoTokenizer

import trine as trio

MODEL = "tiny-llama"


@pytest.fixture(scope="module")
def server(tiny_model_dir, tmp_path_factory):
    with serve(tiny_model_dir, tmp_path_factory.mktemp("openai-scoring-home")) as srv:
        yield srv


@pytest.fixture(scope="module")
def oai(server):
    return openai.OpenAI(
        base_url=server.url + "/v1",
        api_key=server.api_key,
        max_retries=0,
        http_client=httpx.Client(trust_env=False, timeout=60),
    )


@pytest.fixture(scope="module")
def hf_tok(tiny_model_dir):
    return AutoTokenizer.from_pretrained(str(tiny_model_dir), local_files_only=True)


def sdk_prompt_logprobs(server, ids: list[int]) -> list[float | None]:
    with trio.ServiceClient(api_key=server.api_key, base_url=server.url) as svc:
        sampler = svc.create_sampling_client(base_model=MODEL)
        return list(sampler.compute_logprobs(trio.ModelInput.from_ints(ids)).result())


def post(server, path: str, body: dict) -> httpx.Response:
    return httpx.post(
        server.url + path,
        json=body,
        headers={"Authorization": f"Bearer {server.api_key}"},
        trust_env=False,
        timeout=60,
    )


# ----------------------------------------------------------------------------- echo and prompt logprobs
@pytest.mark.parametrize("max_tokens", [0, 1])
def test_echo_logprobs_equal_compute_logprobs(server, oai, hf_tok, max_tokens):
    text = f"Question {max_tokens}: which planet is nearest the sun? Answer: Mercury"
    ids = hf_tok.encode(text, add_special_tokens=True)
    want = sdk_prompt_logprobs(server, ids)
    r = oai.completions.create(
        model=MODEL, prompt=text, echo=True, logprobs=1, max_tokens=max_tokens, temperature=0
    )
    (c,) = r.choices
    lp = c.logprobs
    assert c.text.startswith(text) and len(lp.tokens) == len(ids) + max_tokens
    assert lp.tokens[: len(ids)] == [hf_tok.decode([t]) for t in ids]
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None  # nothing precedes the first token
    assert lp.token_logprobs[: len(ids)] == want  # the engine's compute_logprobs, exactly
    assert all(len(top) == 1 for top in lp.top_logprobs[1:])
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(len(lp.tokens))]
    assert r.usage.prompt_tokens == len(ids) and r.usage.completion_tokens == max_tokens
    if max_tokens == 0:
        assert c.text == text and c.finish_reason == "length"
    # lm-evaluation-harness's greedy check compares each token's logprob with its top one
    for tok, x, top in zip(lp.tokens[1:], lp.token_logprobs[1:], lp.top_logprobs[1:]):
        assert x <= max(top.values()) and (x == max(top.values())) == (tok in top)


def test_echo_with_token_ids_and_no_logprobs_repeats_the_decoded_prompt(oai, hf_tok):
    ids = hf_tok.encode("A token-id prompt, echoed back as text.", add_special_tokens=True)
    r = oai.completions.create(model=MODEL, prompt=ids, echo=True, max_tokens=3, temperature=0)
    plain = oai.completions.create(model=MODEL, prompt=ids, max_tokens=3, temperature=0)
    assert r.choices[0].text == hf_tok.decode(ids) + plain.choices[0].text
    assert r.choices[0].logprobs is None


def test_vllm_prompt_logprobs_on_completions_and_chat(server, oai, hf_tok):
    text = "The quick brown fox jumps over the lazy dog near the river bank."
    ids = hf_tok.encode(text, add_special_tokens=True)
    want = sdk_prompt_logprobs(server, ids)
    r = post(
        server,
        "/v1/completions",
        {"model": MODEL, "prompt": text, "max_tokens": 2, "temperature": 0, "prompt_logprobs": 3},
    ).json()
    plp = r["choices"][0]["prompt_logprobs"]
    assert plp[0] is None and len(plp) == len(ids)
    for i, entry in enumerate(plp[1:], 1):
        assert entry[str(ids[i])]["logprob"] == want[i]  # the prompt token first, its own logprob
        assert entry[str(ids[i])]["decoded_token"] == hf_tok.decode([ids[i]])
        ranked = sorted((e["rank"], e["logprob"]) for e in entry.values() if e["rank"] is not None)
        assert [k for k, _ in ranked] == [1, 2, 3] and ranked[0][1] >= ranked[-1][1]
    messages = [{"role": "user", "content": "Score this prompt, please."}]
    chat = post(
        server,
        "/v1/chat/completions",
        {
            "model": MODEL,
            "messages": messages,
            "max_tokens": 1,
            "prompt_logprobs": 0,
            "return_token_ids": True,
        },
    ).json()
    cids = chat["prompt_token_ids"]
    assert chat["prompt_logprobs"][0] is None and len(chat["prompt_logprobs"]) == len(cids)
    cwant = sdk_prompt_logprobs(server, cids)
    assert [e[str(t)]["logprob"] for e, t in zip(chat["prompt_logprobs"][1:], cids[1:])] == cwant[1:]


# ----------------------------------------------------------------------------- batches
def test_a_batch_of_8_prompts_equals_8_single_requests(server, oai, hf_tok):
    stems = [f"Item {i}: the colour of the sky on a clear day is" for i in range(4)]
    prompts = stems + [hf_tok.encode(s + " blue", add_special_tokens=True) for s in stems]
    kw = dict(model=MODEL, max_tokens=4, temperature=0.8, seed=5, n=2, logprobs=2, echo=True)
    batch = oai.completions.create(prompt=prompts, **kw)
    singles = [oai.completions.create(prompt=p, **kw) for p in prompts]
    assert [c.index for c in batch.choices] == list(range(16))
    for i, one in enumerate(singles):
        for j in range(2):
            got, want = batch.choices[i * 2 + j], one.choices[j]
            assert got.text == want.text and got.logprobs.tokens == want.logprobs.tokens
            glp, wlp = got.logprobs, want.logprobs
            # a prompt prefilled with 7 others and alone: its rows sit elsewhere in the GEMMs, which
            # a kernel need not compute alike (MKL_CBWR=COMPATIBLE does not: 1 ulp here), and its
            # decode rows share steps with other sequences: two paths throughout, within SERVED_PATHS
            # of the scale of all the choice's logprobs (the echoed prompt's and the decoded ones)
            tops = [v for t in wlp.top_logprobs if t for v in t.values()]
            scale = max(abs(x) for x in [*(x for x in wlp.token_logprobs if x is not None), *tops])
            assert_served_paths(glp.token_logprobs, wlp.token_logprobs, scale=scale)
            assert [t and t.keys() for t in glp.top_logprobs] == [t and t.keys() for t in wlp.top_logprobs]
            for g_top, w_top in zip(glp.top_logprobs, wlp.top_logprobs):
                if w_top:
                    assert_served_paths([g_top[k] for k in w_top], list(w_top.values()), scale=scale)
    for field in ("prompt_tokens", "completion_tokens"):
        assert getattr(batch.usage, field) == sum(getattr(s.usage, field) for s in singles)
    events = httpx.get(
        f"{server.url}/api/trine/v1/usage/events",
        trust_env=False,
        headers={"Authorization": f"Bearer {server.api_key}"},
    ).json()["events"]
    mine = sorted(e["request_id"] for e in events if e["request_id"].startswith(batch.id + "-"))
    assert mine == sorted(f"{batch.id}-{i}" for i in range(8))  # each prompt metered as its own request


def test_a_shared_few_shot_stem_is_scored_once_and_served_from_the_cache(server, oai, hf_tok):
    stem = "".join(f"Q: what is {i} plus {i}? A: {2 * i}.\n" for i in range(12))  # about 150 tokens
    questions = [stem + f"Q: what is {q} plus one? A:" for q in (40, 41)]
    prompts = [hf_tok.encode(t + c, add_special_tokens=True) for t in questions for c in (" 41", " 42")]
    kw = dict(model=MODEL, echo=True, logprobs=1, max_tokens=0)
    first = oai.completions.create(prompt=prompts[:2], **kw)
    later = oai.completions.create(prompt=prompts[2:], **kw)
    stem_blocks = len(hf_tok.encode(stem, add_special_tokens=True)) // 16 * 16
    assert first.usage.prompt_tokens_details.cached_tokens >= stem_blocks  # the 2nd prompt waited for the 1st
    assert later.usage.prompt_tokens_details.cached_tokens >= 2 * stem_blocks
    for ids, c in zip(prompts, first.choices + later.choices):
        want = sdk_prompt_logprobs(server, ids)  # compute_logprobs: computed afresh, never cached
        assert c.logprobs.token_logprobs[0] is None
        assert_served_paths(c.logprobs.token_logprobs, want)  # cached blocks vs a fresh prefill


def test_batch_and_echo_errors_name_the_parameter(server, oai):
    cases = [
        ({"prompt": ["a", ""]}, "prompt[1]", "invalid_value"),
        ({"prompt": ["a", "b"], "stream": True}, "prompt", "unsupported_value"),
        ({"prompt": "a", "echo": True, "stream": True}, "echo", "unsupported_parameter"),
        ({"prompt": "a", "max_tokens": 0}, "max_tokens", "invalid_value"),
        ({"prompt": "a", "prompt_logprobs": 99}, "prompt_logprobs", "invalid_value"),
    ]
    for body, param, code in cases:
        r = post(server, "/v1/completions", {"model": MODEL, **body})
        assert r.status_code == 400, body
        err = r.json()["error"]
        assert err["param"] == param and err["code"] == code and param in err["message"], err


# ----------------------------------------------------------------------------- tokenizer routes
def test_tokenize_and_detokenize_use_the_served_tokenizer_and_chat_template(server, oai, hf_tok):
    text = "Count these tokens, please."
    for path in ("/tokenize", "/v1/tokenize"):
        r = post(server, path, {"model": MODEL, "prompt": text, "return_token_strs": True}).json()
        assert r["tokens"] == hf_tok.encode(text, add_special_tokens=True) and r["count"] == len(r["tokens"])
        assert r["token_strs"] == [hf_tok.decode([t]) for t in r["tokens"]] and r["max_model_len"] > 0
    bare = post(server, "/tokenize", {"prompt": text, "add_special_tokens": False}).json()  # one model served
    assert bare["tokens"] == hf_tok.encode(text, add_special_tokens=False) and bare["token_strs"] is None
    messages = [{"role": "user", "content": "How many tokens is this chat?"}]
    chat = post(server, "/tokenize", {"model": MODEL, "messages": messages}).json()
    served = oai.chat.completions.create(
        model=MODEL, messages=messages, max_tokens=1, extra_body={"return_token_ids": True}
    )
    assert (
        chat["tokens"] == served.model_extra["prompt_token_ids"]
        and chat["count"] == served.usage.prompt_tokens
    )
    info = httpx.get(
        f"{server.url}/tokenizer_info", headers={"Authorization": f"Bearer {server.api_key}"}, trust_env=False
    ).json()
    assert info["eos_token"] == hf_tok.eos_token and info["chat_template"] == hf_tok.chat_template
    assert info["max_model_len"] == chat["max_model_len"]
    back = post(server, "/detokenize", {"model": MODEL, "tokens": bare["tokens"]}).json()
    assert back == {"prompt": hf_tok.decode(bare["tokens"])}
    for path, body, param in [
        ("/detokenize", {"model": MODEL, "tokens": [1, 10**9]}, "tokens"),
        ("/tokenize", {"model": MODEL, "prompt": 5}, "prompt"),
        (
            "/tokenize",
            {"model": MODEL, "messages": messages, "add_generation_prompt": False},
            "add_generation_prompt",
        ),
        ("/tokenize", {"model": "nope", "prompt": "x"}, "model"),
        ("/tokenize", {"model": MODEL, "prompt": "x", "frobnicate": 1}, "frobnicate"),
    ]:
        r = post(server, path, body)
        assert r.status_code in (400, 404) and r.json()["error"]["param"] == param, (body, r.text)


# ----------------------------------------------------------------------------- sampler options
def test_penalties_bias_and_min_p_through_the_openai_client(oai, hf_tok):
    prompt = "Penalties: a list of words that never repeat,"
    pids = hf_tok.encode(prompt, add_special_tokens=True)
    kw = dict(model=MODEL, prompt=prompt, max_tokens=10, temperature=0, extra_body={"return_token_ids": True})
    forced = hf_tok.encode(" banana", add_special_tokens=False)[0]
    r = oai.completions.create(**{**kw, "logit_bias": {str(forced): 100}}, logprobs=1)
    assert r.choices[0].token_ids == [forced] * 10
    assert r.choices[0].logprobs.token_logprobs[0] > -1e-3  # of the biased distribution, the one sampled
    fresh = oai.completions.create(**{**kw, "presence_penalty": 2})
    assert len(set(fresh.choices[0].token_ids)) == 10  # a generated token is never drawn again
    rep = oai.completions.create(**{**kw, "extra_body": {"return_token_ids": True, "repetition_penalty": 10}})
    out = rep.choices[0].token_ids
    assert len(set(out)) == 10 and not set(out) & set(pids)  # nor any prompt token
    # min_p 1 keeps only the most likely token: sampling at temperature 1 is then greedy
    mp = oai.completions.create(
        **{**kw, "temperature": 1, "seed": 3, "extra_body": {"min_p": 1.0, "return_token_ids": True}}
    )
    plain = oai.completions.create(**kw)
    assert mp.choices[0].token_ids == plain.choices[0].token_ids


def test_best_of_answers_the_most_likely_of_its_samples(oai):
    kw = dict(
        model=MODEL, prompt="Best of four: the answer is", max_tokens=5, temperature=1, seed=21, logprobs=0
    )
    four = oai.completions.create(n=4, **kw)
    best = oai.completions.create(n=1, best_of=4, **kw)
    want = max(four.choices, key=lambda c: sum(c.logprobs.token_logprobs))
    assert [c.text for c in best.choices] == [want.text] and best.choices[0].index == 0
    assert best.usage.completion_tokens == 20  # every sample is generated (and metered)
    two = oai.completions.create(n=2, best_of=4, **kw)
    ranked = sorted(four.choices, key=lambda c: -sum(c.logprobs.token_logprobs))
    assert [c.text for c in two.choices] == [c.text for c in ranked[:2]]


def test_seeded_penalised_samples_are_the_same_alone_and_batched(oai):
    prompts = [f"Seeded {i}: a penalised continuation of this line" for i in range(4)]
    kw = dict(
        model=MODEL,
        max_tokens=8,
        temperature=0.9,
        seed=13,
        n=2,
        frequency_penalty=0.7,
        presence_penalty=0.3,
        logit_bias={"5": 1.5},
        extra_body={"repetition_penalty": 1.2, "min_p": 0.01},
    )
    batch = oai.completions.create(prompt=prompts, **kw)
    singles = [oai.completions.create(prompt=p, **kw) for p in prompts]
    assert [c.text for c in batch.choices] == [c.text for s in singles for c in s.choices]
    assert oai.completions.create(prompt=prompts[0], **kw).choices[0].text == singles[0].choices[0].text


def test_the_pytrio_plane_takes_the_same_options_as_sdk_extensions(server, hf_tok):
    forced = hf_tok.encode(" apple", add_special_tokens=False)[0]
    prompt = trio.ModelInput.from_ints(hf_tok.encode("The SDK's sampler, biased:", add_special_tokens=True))
    with trio.ServiceClient(api_key=server.api_key, base_url=server.url) as svc:
        sampler = svc.create_sampling_client(base_model=MODEL)
        params = trio.SamplingParams(max_tokens=4, temperature=0, logit_bias={forced: 100.0})
        assert params.to_wire()["logit_bias"] == {str(forced): 100.0}
        out = sampler.sample(prompt, num_samples=1, sampling_params=params).result()
        assert out.sequences[0].tokens == [forced] * 4
        fresh = trio.SamplingParams(max_tokens=8, temperature=0, presence_penalty=2.0, repetition_penalty=1.5)
        toks = sampler.sample(prompt, num_samples=1, sampling_params=fresh).result().sequences[0].tokens
        assert len(set(toks)) == 8
    assert "presence_penalty" not in trio.SamplingParams(max_tokens=1).to_wire()  # off: not sent
    with pytest.raises(ValueError, match="SamplingParams.min_p"):
        trio.SamplingParams(max_tokens=1, min_p=2)
