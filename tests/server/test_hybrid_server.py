"""A hybrid model (a tiny random Qwen3.5: Gated DeltaNet + gated attention) served end to end: every
plane lists it, a repeated prompt is served from the prefix cache's state snapshot and metered as
cached, an OpenAI chat uses the checkpoint's own chat template, and `/metrics` shows the snapshots."""

from __future__ import annotations

import httpx
import openai
import pytest
from serverutil import RawClient, serve
from test_prometheus import scrape, value
from transformers import AutoTokenizer

MODEL = "tiny-qwen3_5"


@pytest.fixture(scope="module")
def server(tiny_qwen3_5_dir, tmp_path_factory):
    with serve(tiny_qwen3_5_dir, tmp_path_factory.mktemp("home")) as srv:
        yield srv


def test_every_plane_lists_the_hybrid_model(server):
    key = server.api_key
    catalog = httpx.get(f"{server.url}/api/models", headers={"X-API-Key": key}, trust_env=False)
    (m,) = catalog.json()["items"]
    assert m["name"] == MODEL and m["architecture"] == "qwen3_5_text" and m["sample_available"]
    assert m["sampler"]["max_seq_len"] == m["context_length"] == 4096
    caps = httpx.get(
        f"{server.url}/api/v1/get_server_capabilities", headers={"X-API-Key": "tml-" + key}, trust_env=False
    )
    assert [x["model_name"] for x in caps.json()["supported_models"]] == [MODEL]
    listed = httpx.get(f"{server.url}/v1/models", headers={"Authorization": f"Bearer {key}"}, trust_env=False)
    assert [x["id"] for x in listed.json()["data"]] == [MODEL]


def test_a_repeated_prompt_is_served_from_its_snapshot_and_metered_as_cached(server):
    c = RawClient(server.url, server.api_key)
    try:
        srun = c.sampling_run(c.session(), MODEL)
        body = {
            "prompt": {"chunks": [{"type": "encoded_text", "tokens": list(range(100, 150))}]},
            "num_samples": 3,
            "sampling_params": {"max_tokens": 4, "temperature": 1.0, "seed": 5},
        }
        first = c.sample(srun, {**body, "request_id": "hybrid-1"}).json()
        again = c.sample(srun, {**body, "request_id": "hybrid-2"}).json()
    finally:
        c.close()
    assert (first["usage"]["prefill_tokens"], first["usage"]["cached_tokens"]) == (50, 0)
    assert (again["usage"]["prefill_tokens"], again["usage"]["cached_tokens"]) == (1, 49)
    assert [s["tokens"] for s in again["sequences"]] == [s["tokens"] for s in first["sequences"]]
    store = server.service.store
    rows = store.usage_events(store.key_by_secret(server.api_key).id, run_id=srun["sampling_run_cuid"])
    assert sorted((r.prefill, r.prefill_cached) for r in rows) == [(1, 49), (50, 0)]
    m = scrape(server.url)
    rep = {"model": MODEL, "replica": "0"}
    assert value(m, "trine_state_snapshot_hits_total", **rep) >= 1
    assert value(m, "trine_state_snapshots_held", **rep) >= 1
    assert (
        value(m, "trine_state_snapshots_capacity", **rep) > 0
        and value(m, "trine_state_snapshot_bytes", **rep) > 0
    )
    assert value(m, "trine_state_slots_free", **rep) == value(m, "trine_state_slots_total", **rep) > 0
    assert value(m, "trine_tokens_total", **rep, phase="prefill_cached") >= 49


def test_an_openai_chat_uses_the_checkpoints_template_and_its_next_turn_hits(server, tiny_qwen3_5_dir):
    oai = openai.OpenAI(
        base_url=server.url + "/v1",
        api_key=server.api_key,
        max_retries=0,
        http_client=httpx.Client(trust_env=False, timeout=60),
    )
    tok = AutoTokenizer.from_pretrained(str(tiny_qwen3_5_dir), local_files_only=True)
    first = [{"role": "user", "content": "Plan a three-day walking trip through the hills."}]
    r1 = oai.chat.completions.create(
        model=MODEL, messages=first, max_tokens=8, temperature=0, extra_body={"return_token_ids": True}
    )
    assert r1.prompt_token_ids == list(
        tok.apply_chat_template(first, add_generation_prompt=True, tokenize=True, return_dict=False)
    )
    second = first + [
        {"role": "assistant", "content": r1.choices[0].message.content},
        {"role": "user", "content": "Make the second day shorter."},
    ]
    r2 = oai.chat.completions.create(model=MODEL, messages=second, max_tokens=4, temperature=0)
    # at least the first turn's prompt: its snapshot after all but its last token
    assert r2.usage.prompt_tokens_details.cached_tokens >= len(r1.prompt_token_ids) - 1


def test_a_grpo_step_through_the_sdk_trains_the_shared_prompt_once(server):
    """Training a hybrid model through the service: a group of completions of one prompt computes the
    prompt once (its recurrent state and KV feed every completion), metered so; the step moves the
    weights a sampler then serves."""
    import trine as trio

    prompt, completions = list(range(200, 240)), [list(range(300 + 7 * i, 306 + 7 * i)) for i in range(4)]
    data = [
        trio.Datum(
            model_input=trio.ModelInput.from_ints(prompt + c[:-1]),
            loss_fn_inputs={
                "target_tokens": prompt[1:] + c,
                "logprobs": [0.0] * (len(prompt) - 1) + [-2.0] * len(c),
                "advantages": [0.0] * (len(prompt) - 1) + [1.0 if i % 2 else -1.0] * len(c),
            },
        )
        for i, c in enumerate(completions)
    ]
    with trio.ServiceClient(base_url=server.url, api_key=server.api_key) as service:
        trainer = service.create_lora_training_client(base_model=MODEL, rank=4, seed=1)
        before = trainer.save_weights_and_get_sampling_client()
        fb = trainer.forward_backward(data, "importance_sampling")
        opt = trainer.optim_step(trio.AdamParams(learning_rate=5e-2))
        out, step = fb.result(), opt.result()
        after = trainer.save_weights_and_get_sampling_client()
        ask = trio.ModelInput.from_ints(prompt)
        greedy = trio.SamplingParams(max_tokens=4, temperature=0.0)
        old = before.compute_logprobs(ask).result()
        new = after.compute_logprobs(ask).result()
        assert after.sample(ask, sampling_params=greedy).result().sequences[0].tokens
    sent = sum(len(d.model_input.to_ints()) for d in data)
    shared = len(prompt) + sum(
        len(c) - 1 for c in completions
    )  # the prompt's 40 positions once, then each tail
    assert out.usage.train_tokens == shared < sent
    assert step.metrics["grad_norm"] > 0
    assert old != new and len(new) == len(prompt)  # the step moved the weights the sampler serves
