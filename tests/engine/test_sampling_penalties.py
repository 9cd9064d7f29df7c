"""Penalties, logit bias and min-p in the batched sampler, on hand-made logits (no model): each as
vLLM defines it, per row, with logprobs of the distribution sampled."""

from __future__ import annotations

import math

import pytest
import torch
from tolerance import gamma

from trine.engine.api import SamplingOptions
from trine.engine.sampler.sampling import adjusted, check_sampling_options, generators, sample


def opts(**kw) -> SamplingOptions:
    return SamplingOptions(max_tokens=kw.pop("max_tokens", 8), **kw)


LOGITS = torch.tensor([[2.0, -1.0, 0.5, 3.0, -2.0, 0.0]])
PROMPT, OUT = [0, 1], [3, 3, 2]  # token 3 generated twice, 2 once; 0 and 1 only in the prompt


def test_repetition_penalty_divides_positive_and_multiplies_negative_logits_of_seen_tokens():
    x = adjusted(LOGITS, [opts(repetition_penalty=2.0)], [(PROMPT, OUT)])[0]
    assert x.tolist() == [1.0, -2.0, 0.25, 1.5, -2.0, 0.0]  # 0, 1 (prompt) and 2, 3 (output); 4, 5 unseen
    below = adjusted(LOGITS, [opts(repetition_penalty=0.5)], [(PROMPT, OUT)])[0]
    assert below.tolist() == [4.0, -0.5, 1.0, 6.0, -2.0, 0.0]  # p < 1 favours repeats


def test_frequency_and_presence_penalties_count_the_samples_own_output_only():
    x = adjusted(LOGITS, [opts(frequency_penalty=0.5)], [(PROMPT, OUT)])[0]
    assert x.tolist() == [2.0, -1.0, 0.0, 2.0, -2.0, 0.0]  # minus 0.5 x count; the prompt is not counted
    y = adjusted(LOGITS, [opts(presence_penalty=1.5)], [(PROMPT, OUT)])[0]
    assert y.tolist() == [2.0, -1.0, -1.0, 1.5, -2.0, 0.0]  # minus 1.5 once per generated token
    both = adjusted(
        LOGITS, [opts(repetition_penalty=2.0, frequency_penalty=0.5, presence_penalty=1.0)], [(PROMPT, OUT)]
    )[0]
    assert both.tolist() == [1.0, -2.0, 0.25 - 0.5 - 1.0, 1.5 - 1.0 - 1.0, -2.0, 0.0]  # repetition first


def test_logit_bias_adds_to_the_named_tokens_before_the_penalties():
    x = adjusted(LOGITS, [opts(logit_bias=((4, 100.0), (0, -100.0)))], [(PROMPT, OUT)])[0]
    assert x.tolist() == [-98.0, -1.0, 0.5, 3.0, 98.0, 0.0]
    toks, _, _ = sample(LOGITS, [opts(temperature=0, logit_bias=((4, 100.0),))], generators(0, 1))
    assert toks == [4]


def test_penalised_logprobs_are_of_the_distribution_sampled_and_other_rows_are_untouched():
    torch.manual_seed(0)
    logits = torch.randn(3, 40)
    hist = [([1, 2, 3], [5, 5, 7]), ([4], [9, 9]), ([1], [2])]
    o = [opts(presence_penalty=1.0, top_logprobs=3), opts(temperature=0.7), opts(repetition_penalty=1.3)]
    toks, lps, tops = sample(logits, o, generators(11, 3), hist)
    pen = adjusted(logits, o, hist)
    assert torch.equal(pen[1], logits[1])  # a row without penalties: bit for bit
    logp = torch.log_softmax(pen, -1)
    # kind 1: the sampler's log-softmax of the same adjusted logits, the same op: bit for bit
    assert lps == [float(logp[b, t]) for b, t in enumerate(toks)]
    assert [t for t, _ in tops[0]] == logp[0].topk(3).indices.tolist()
    # seeded rows draw the same alone as in the batch
    for b in range(3):
        alone = sample(logits[b : b + 1], o[b : b + 1], [generators(11, 3)[b]], hist[b : b + 1])
        assert alone[0][0] == toks[b] and alone[1][0] == lps[b]


def test_penalties_change_what_is_drawn():
    logits = torch.tensor([[5.0, 4.9, 0.0, 0.0]])
    greedy = lambda **kw: sample(logits, [opts(temperature=0, **kw)], generators(0, 1), [([], [0])])[0][0]  # noqa: E731
    assert greedy() == 0 and greedy(presence_penalty=0.5) == 1 and greedy(frequency_penalty=0.2) == 1
    assert greedy(repetition_penalty=1.1) == 1


def test_min_p_drops_tokens_below_a_fraction_of_the_most_likely():
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]]))
    drawn = {sample(logits, [opts(min_p=0.35)], [g])[0][0] for g in generators(0, 300)}
    assert drawn == {0, 1}  # 0.15 / 0.5 = 0.3 < 0.35 <= 0.3 / 0.5
    drawn = {sample(logits, [opts(min_p=0.2)], [g])[0][0] for g in generators(0, 300)}
    assert drawn == {0, 1, 2}
    # after temperature, as vLLM: a hot temperature flattens the ratios and keeps more tokens
    hot = {sample(logits, [opts(min_p=0.35, temperature=2.0)], [g])[0][0] for g in generators(0, 300)}
    assert hot == {0, 1, 2}  # sqrt(0.3) = 0.55 >= 0.35; sqrt(0.1) = 0.32 < 0.35 drops token 3
    _, lps, _ = sample(logits, [opts(min_p=0.35)], generators(1, 1))
    # raw, not renormalised: log_softmax(log p) is log p, up to an a priori bound (kind 2): the fp32
    # logits (u |log p|), a 4-term log-sum-exp of them (gamma_8 with the exps) and the difference
    bound = gamma(8) + 2 * gamma(1) * abs(math.log(0.3))
    assert any(abs(lps[0] - math.log(p)) <= bound for p in (0.5, 0.3))


@pytest.mark.parametrize(
    "kw,field",
    [
        ({"presence_penalty": 2.5}, "presence_penalty"),
        ({"frequency_penalty": math.nan}, "frequency_penalty"),
        ({"repetition_penalty": 0.0}, "repetition_penalty"),
        ({"min_p": 1.5}, "min_p"),
        ({"logit_bias": ((99, 1.0),)}, "logit_bias"),
        ({"logit_bias": ((1, 1.0), (1, 2.0))}, "logit_bias"),
    ],
)
def test_out_of_range_options_name_their_field(kw, field):
    with pytest.raises(ValueError, match=f"^{field}:"):
        check_sampling_options(opts(**kw), vocab_size=10)
