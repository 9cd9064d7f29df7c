"""Constrained decoding in the sampler (engine/grammar.py): a grammar is compiled once per request
from the sampler's own tokenizer, every sample stays inside it, and logprobs are those of the
masked distribution the token was drawn from."""

from __future__ import annotations

import json
import math

import llguidance
import pytest
import torch
from tolerance import gamma

from trine.engine.api import SampleRequest, SamplingOptions, WeightsIdentity
from trine.engine.config import SamplerConfig
from trine.engine.model.tokenizer import Tokenizer
from trine.engine.model.weights import load_model
from trine.engine.sampler.sampler import Sampler

W = WeightsIdentity("tiny")
COMPACT = {"whitespace_flexible": False, "key_separator": ": ", "item_separator": ", "}
SCHEMA = {
    "type": "object",
    "additionalProperties": False,
    "required": ["city", "n", "ok"],
    "properties": {
        "city": {"enum": ["Paris", "Oslo", "Lima"]},
        "n": {"type": "integer", "minimum": 0, "maximum": 999},
        "ok": {"type": "boolean"},
    },
    "x-guidance": COMPACT,
}


@pytest.fixture(scope="module")
def sampler(tiny_model_dirs):
    d = tiny_model_dirs["qwen3"]
    return Sampler(load_model(d, "cpu"), Tokenizer(d), SamplerConfig(kv_cache_bytes=16 * 2**20))


def run(sampler, grammar: str, *, n=1, max_tokens=60, temperature=1.0, seed=0, top_logprobs=0, rid="g"):
    opts = SamplingOptions(max_tokens, temperature, seed=seed, top_logprobs=top_logprobs, grammar=grammar)
    return sampler.run([SampleRequest(rid, [1, 2000, 3000, 4000], opts, W, num_samples=n)])[0]


def test_every_sample_of_a_json_schema_request_parses_and_matches(sampler):
    res = run(sampler, llguidance.LLMatcher.grammar_from_json_schema(json.dumps(SCHEMA)), n=4)
    texts = [s.text for s in res.sequences]
    for s in res.sequences:
        assert s.stop_reason == "stop" and s.tokens[-1] in sampler.eos_ids
        obj = json.loads(s.text)
        assert (
            obj["city"] in ("Paris", "Oslo", "Lima") and 0 <= obj["n"] <= 999 and isinstance(obj["ok"], bool)
        )
    assert len(set(texts)) > 1  # four independent samples, not one copied


def test_unconstrained_neighbours_in_the_batch_are_untouched(sampler):
    free = SampleRequest("free", [1, 2000, 3000, 4000], SamplingOptions(8, 0.0, stop_at_eos=False), W)
    alone = sampler.run([free])[0].sequences[0].tokens
    grammar = llguidance.LLMatcher.grammar_from_lark('start: "yes" | "no"')
    both = sampler.run(
        [
            SampleRequest("free2", free.prompt, free.options, W),
            SampleRequest("g2", free.prompt, SamplingOptions(8, 0.0, grammar=grammar), W),
        ]
    )
    assert both[0].sequences[0].tokens == alone
    assert both[1].sequences[0].text in ("yes", "no")


def test_logprobs_are_of_the_masked_distribution(sampler):
    grammar = llguidance.LLMatcher.grammar_from_lark('start: "yes" | "no"')
    res = run(sampler, grammar, top_logprobs=20)
    s = res.sequences[0]
    assert s.text in ("yes", "no")
    first = s.top_logprobs[0]
    allowed = [(t, lp) for t, lp in first if lp > -1e30]
    assert all(
        "yes".startswith(sampler.tokenizer.decode([t])) or "no".startswith(sampler.tokenizer.decode([t]))
        for t, _ in allowed
    )
    # the allowed tokens carry all the probability mass: it was renormalised over them. Kind 2, a
    # priori: each logprob is x - max - log(sum of n exps), within gamma_{n+3} (the exps, their
    # sum, the log) + gamma_3 |lp| (the subtractions) of exact, and so is the sum of their exps
    n, worst = len(allowed), max(-lp for _, lp in allowed)
    assert abs(sum(math.exp(lp) for _, lp in allowed) - 1.0) <= gamma(n + 3) + gamma(3) * worst
    assert s.logprobs[0] == dict(first)[s.tokens[0]]  # kind 1: both read from the same tensor


def test_a_grammar_that_does_not_compile_is_refused_naming_grammar(sampler):
    with pytest.raises(ValueError, match="^grammar: "):
        run(sampler, llguidance.LLMatcher.grammar_from_lark('start: %json {"type": "nonsense"}'), rid="bad")
    assert not sampler.has_work()


def test_greedy_constrained_decoding_is_deterministic(sampler):
    g = llguidance.LLMatcher.grammar_from_json_schema(json.dumps(SCHEMA))
    a = run(sampler, g, temperature=0.0, rid="d1").sequences[0]
    b = run(sampler, g, temperature=0.0, rid="d2").sequences[0]
    assert a.tokens == b.tokens and json.loads(a.text)["city"] in ("Paris", "Oslo", "Lima")
    assert torch.isfinite(torch.tensor(a.logprobs)).all()


def test_a_matcher_in_error_allows_only_eos(sampler):
    from types import SimpleNamespace

    m = sampler.grammars.compile(llguidance.LLMatcher.grammar_from_lark('start: "yes"'))
    m.consume_token(sampler.tokenizer.encode(" no")[0])  # a forbidden token: the matcher breaks
    assert m.is_error()
    logits = sampler.grammars.mask([SimpleNamespace(matcher=m)], torch.zeros(1, sampler.cfg.vocab_size))
    assert set(torch.isfinite(logits[0]).nonzero()[:, 0].tolist()) == set(sampler.eos_ids)


def test_a_grammar_needs_stop_at_eos(sampler):
    opts = SamplingOptions(
        8, grammar=llguidance.LLMatcher.grammar_from_lark('start: "yes"'), stop_at_eos=False
    )
    with pytest.raises(ValueError, match="^grammar: .*stop_at_eos"):
        sampler.run([SampleRequest("noeos", [1, 2, 3], opts, W)])


def test_forced_tool_calls_parse_back_on_a_tokenizer_without_tool_call_tokens(sampler):
    from trine.server.openai import tool_calls

    assert sampler.tokenizer.added_token_id(tool_calls.OPEN) is None  # spelt from plain-text pieces
    params = {
        "type": "object",
        "additionalProperties": False,
        "required": ["city"],
        "properties": {"city": {"enum": ["Paris", "Oslo"]}},
    }
    grammar = tool_calls.forcing_grammar({"get_weather": params, "get_time": None}, several=True)
    for s in run(sampler, grammar, n=3, max_tokens=150, seed=11).sequences:
        assert s.stop_reason == "stop"
        content, calls = tool_calls.parse(s.text)
        assert content == "" and calls
        for c in calls:
            assert (c.name, c.arguments) == ("get_time", {}) or (
                c.name == "get_weather" and c.arguments["city"] in ("Paris", "Oslo")
            )
