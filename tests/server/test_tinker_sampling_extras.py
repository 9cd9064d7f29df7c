"""Tinker's sampling extras with the official, unmodified `tinker` client: top-k per sampled token,
prompt alt-token draws, target prompt logprobs, and prompt_logprobs_last_n on the cached prefix.

Float comparisons: a value computed by two sampler requests (compute_logprobs, which never reads the
prefix cache, against a sample request's prompt scores, which may start from cached blocks; two
sample requests that find different blocks cached) are two engine paths of the same math: within
SERVED_PATHS (tests/tolerance.py), the rounding tests/engine bounds; a wrong row or id is 1e-2 off."""

from __future__ import annotations

import itertools

import httpx
import pytest
from tolerance import assert_served_paths

tinker = pytest.importorskip("tinker")
torch = pytest.importorskip("torch")
from tinker import types  # noqa: E402

MODEL = "tiny-llama"
_raw_seq_ids = itertools.count(5 * 10**8)  # raw requests' seq_ids: apart from the client's own
PROMPT = list(range(200, 240))  # 40 tokens: two full 16-token cache blocks


@pytest.fixture(scope="module")
def sampler(srv):
    sc = tinker.ServiceClient(base_url=srv.url, api_key="tml-" + srv.api_key)
    yield sc.create_sampling_client(base_model=MODEL).result()
    sc.close("success").result()


def sample(sampler, prompt=PROMPT, max_tokens=1, temperature=0.0, **kw) -> types.SampleResponse:
    params = types.SamplingParams(max_tokens=max_tokens, temperature=temperature, seed=3)
    return sampler.sample(types.ModelInput.from_ints(prompt), 1, params, **kw).result()


def test_top_k_rows_are_k_wide_and_start_with_the_greedy_token_and_its_logprob(sampler):
    out = sample(sampler, max_tokens=6, topk_sample_logprobs=4)
    seq = out.sequences[0]
    assert seq.topk_logprobs_np.token_ids.shape == seq.topk_logprobs_np.logprobs.shape == (6, 4)
    assert len(seq.topk_logprobs) == 6
    for tok, lp, row in zip(seq.tokens, seq.logprobs, seq.topk_logprobs):
        assert len(row) == 4 and row[0] == (tok, lp)  # the greedy token, with its own logprob
        assert row[0][1] >= row[1][1] >= row[2][1] >= row[3][1]
    assert sample(sampler, max_tokens=2).sequences[0].topk_logprobs is None  # not asked: none


def test_short_top_k_rows_are_padded_with_the_clients_sentinels():
    from tinker.proto.response_conv import deserialize_sample_response
    from tinker.types.topk_logprobs import MASK_LOGPROB

    from trine.server.tinker import shapes

    body = shapes.sample_response(
        [([5, 6], [-0.5, -1.0], "length")],
        None,
        None,
        0,
        0,
        sequence_topk=[[[(5, -0.5), (7, -2.0)], [(6, -1.0)]]],
        sequence_topk_k=3,
    )
    seq = deserialize_sample_response(body).sequences[0]
    assert seq.topk_logprobs_np.token_ids.tolist() == [[5, 7, 0], [6, 0, 0]]
    assert seq.topk_logprobs_np.logprobs[1].tolist() == [-1.0, MASK_LOGPROB, MASK_LOGPROB]
    assert seq.topk_logprobs == [[(5, -0.5), (7, -2.0)], [(6, -1.0)]]


def test_target_prompt_logprobs_equal_compute_logprobs_dense_and_sparse(sampler):
    whole = sampler.compute_logprobs(types.ModelInput.from_ints(PROMPT)).result()
    ids = torch.full((len(PROMPT) - 1, 2), -1, dtype=torch.int64)
    ids[:, 0] = torch.tensor(PROMPT[1:])  # row i scores prompt entry i + 1: the prompt's own tokens
    ids[5, 1] = 17
    for target in (types.TensorData.from_torch(ids), types.TensorData.from_torch_sparse(ids, pad_value=-1)):
        out = sample(sampler, target_prompt_logprobs=target)
        got = out.target_prompt_logprobs
        assert (got.sparse_crow_indices is None) == (
            target.sparse_crow_indices is None
        )  # the request's layout
        dense = got.to_torch()
        assert dense.shape == (len(PROMPT) - 1, 2) and dense.dtype == torch.float32
        assert_served_paths(dense[:, 0], whole[1:])
        assert dense[5, 1] < 0 and (dense[torch.arange(39) != 5, 1] == 0).all()  # 0.0 where it had -1


def test_alt_tokens_are_k_draws_per_position_with_their_logprobs(sampler):
    out = sample(sampler, temperature=1.0, prompt_alt_tokens_k=4)
    toks = out.prompt_alt_tokens.tokens.to_torch()
    lps = out.prompt_alt_tokens.logprobs.to_torch()
    assert toks.shape == lps.shape == (len(PROMPT) - 1, 4) and toks.dtype == torch.int64
    assert len(set(toks.flatten().tolist())) > len(PROMPT)  # drawn at temperature 1, not argmax
    # each draw's logprob is the model's: the same ids as targets score the same
    scored = sample(sampler, target_prompt_logprobs=types.TensorData.from_torch(toks))
    assert_served_paths(scored.target_prompt_logprobs.to_numpy().ravel(), lps.numpy().ravel())


def test_last_n_reuses_the_cached_prefix_with_the_full_computations_values(srv, sampler):
    prompt = list(range(300, 340))
    whole = sample(sampler, prompt, include_prompt_logprobs=True, topk_prompt_logprobs=2)  # caches it
    assert whole.prompt_cache_hit_tokens == 0
    last = sample(
        sampler, prompt, include_prompt_logprobs=True, topk_prompt_logprobs=2, prompt_logprobs_last_n=4
    )
    # every entry before the 4 it scores: 2 full blocks and 3 tokens of the first's partial last block
    assert last.prompt_cache_hit_tokens == 35
    assert last.prompt_logprobs[:36] == [None] * 36
    assert_served_paths(last.prompt_logprobs[36:], whole.prompt_logprobs[36:])
    assert [[t for t, _ in row] for row in last.topk_prompt_logprobs[36:]] == [
        [t for t, _ in row] for row in whole.topk_prompt_logprobs[36:]
    ]
    scored = sampler.compute_logprobs(types.ModelInput.from_ints(prompt), prompt_logprobs_last_n=4).result()
    assert_served_paths(scored[36:], whole.prompt_logprobs[36:])
    key = srv.service.store.key_by_secret(srv.api_key)
    events = [e for e in srv.service.usage_events(key) if e.operation == "sample"][-2:]
    assert [(e.prefill, e.prefill_cached) for e in events] == [(5, 35)] * 2  # prompt = computed + cached


@pytest.mark.parametrize(
    "extra, field",
    [
        ({"topk_sample_logprobs": -1}, "topk_sample_logprobs"),
        ({"topk_sample_logprobs": 65}, "topk_sample_logprobs"),
        ({"prompt_alt_tokens_k": -2}, "prompt_alt_tokens_k"),
        ({"prompt_alt_tokens_k": 10**6}, "prompt_alt_tokens_k"),
        ({"prompt_logprobs": True, "prompt_logprobs_last_n": 0}, "prompt_logprobs_last_n"),
        ({"prompt_logprobs": True, "prompt_logprobs_last_n": 40}, "prompt_logprobs_last_n"),
        ({"prompt_logprobs_last_n": 4}, "prompt_logprobs_last_n"),  # without prompt_logprobs
        ({"target_prompt_logprobs": {"data": [1] * 39, "dtype": "int64", "shape": [39, 1]}}, None),  # control
        (
            {"target_prompt_logprobs": {"data": [1] * 38, "dtype": "int64", "shape": [38, 1]}},
            "target_prompt_logprobs",
        ),
        (
            {"target_prompt_logprobs": {"data": [1] * 39 * 65, "dtype": "int64", "shape": [39, 65]}},
            "target_prompt_logprobs",
        ),
        (
            {"target_prompt_logprobs": {"data": [1.5] * 39, "dtype": "float32", "shape": [39, 1]}},
            "target_prompt_logprobs",
        ),
        (
            {"target_prompt_logprobs": {"data": [-1] * 39, "dtype": "int64", "shape": [39, 1]}},
            "target_prompt_logprobs",
        ),
        (
            {"target_prompt_logprobs": {"data": [-5] * 39, "dtype": "int64", "shape": [39, 1]}},
            "target_prompt_logprobs",
        ),
        (
            {
                "target_prompt_logprobs": {
                    "data": [3],
                    "dtype": "int64",
                    "shape": [39, 1],
                    "sparse_crow_indices": [0, 1],
                    "sparse_col_indices": [0],
                }
            },
            "target_prompt_logprobs",
        ),
        (
            {"target_prompt_logprobs": {"data": [3], "dtype": "int64", "shape": [2**62, 2**62]}},
            "target_prompt_logprobs",
        ),
    ],
)
def test_bad_extras_answer_400_naming_the_field(srv, sampler, extra, field):
    sample(sampler, max_tokens=1)  # the client has its sampling session
    body = {
        "sampling_session_id": sampler._sampling_session_id,
        "seq_id": next(_raw_seq_ids),
        "num_samples": 1,
        "prompt": {"chunks": [{"type": "encoded_text", "tokens": PROMPT}]},
        "sampling_params": {"max_tokens": 1, "temperature": 0.0},
        **extra,
    }
    r = httpx.post(f"{srv.url}/api/v1/asample", json=body, headers={"X-API-Key": "tml-" + srv.api_key})
    if field is None:
        assert r.status_code == 200, r.text
    else:
        assert r.status_code == 400 and field in r.json()["message"], r.text
