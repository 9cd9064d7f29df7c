"""Token sampling, seeds and stops on hand-made logits and a character tokenizer: no model."""

from __future__ import annotations

import math

import pytest
import torch
from tolerance import gamma

from trine.engine.api import SamplingOptions
from trine.engine.sampler.sampling import CDF_BLOCK, draw, generators, sample, sample_seed
from trine.engine.sampler.stops import Stops, final_text


def opts(**kw) -> SamplingOptions:
    return SamplingOptions(max_tokens=kw.pop("max_tokens", 8), **kw)


def test_sample_seeds_are_stable_and_distinct_per_sample():
    # pinned: the same (seed, sample index) must draw the same tokens on every machine and version
    assert (sample_seed(0, 0), sample_seed(5, 2)) == (0x53836E97A68CBF37, 0x121F6EFAD2BA4D03)
    assert len({sample_seed(s, j) for s in range(20) for j in range(20)}) == 400
    assert all(0 <= sample_seed(s, 0) < 2**63 for s in (-1, 2**64 + 3, 7))


@pytest.mark.parametrize("vocab", [4 * CDF_BLOCK, 3 * CDF_BLOCK + 17, 5])
def test_the_two_level_inverse_cdf_draws_what_the_whole_cdf_does(vocab):
    g = torch.Generator().manual_seed(vocab)
    x = torch.randn(6, vocab, generator=g) * 3
    x[1, vocab // 2 :] = -math.inf  # masked tokens, a block end among them
    x[2, :] = -math.inf
    x[2, vocab - 1] = 0.0  # one allowed token, the last
    u = torch.rand(6, 64, dtype=torch.float64, generator=g)
    u[:, 0], u[:, 1] = 0.0, 1 - 1e-16  # the CDF's two ends
    cdf = x.softmax(-1).double().cumsum(-1)
    whole = torch.searchsorted(cdf, u * cdf[:, -1:], right=True).clamp(max=vocab - 1)
    got = draw(x, u)
    # kind 2, a priori: both sum the same fp32 probabilities in fp64, in orders of their own, so
    # each CDF entry is within gamma_V (fp64) x the total of the exact one. A draw may differ only
    # where the target u x total lies that close to the CDF step between the two tokens (the
    # reference's CDF at the lower one's end; tokens of probability 0 between them add nothing)
    total = cdf[:, -1:]
    step = cdf.gather(1, torch.minimum(got, whole))
    near = (step - u * total).abs() <= 4 * gamma(vocab, torch.float64) * total
    assert bool(near[got != whole].all()), "a draw differs from the whole CDF's away from a step"
    assert bool((x.softmax(-1).gather(1, got) > 0).all())  # never a token of probability 0
    assert bool((got[2] == vocab - 1).all())


def test_a_rows_draws_do_not_depend_on_the_batch_around_it():
    torch.manual_seed(0)
    logits = torch.randn(3, 50)
    o = [opts(temperature=0.0), opts(temperature=0.9), opts(temperature=1.3, top_k=10)]
    alone = sample(logits[1:2], o[1:2], generators(7, 1))[0]
    batched = sample(logits, o, [generators(1, 1)[0], generators(7, 1)[0], generators(2, 1)[0]])[0]
    assert batched[1] == alone[0]  # its own stream: the rows around it change nothing
    assert batched[0] == int(logits[0].argmax())


def test_logprobs_are_the_raw_distributions_whatever_the_temperature_and_filters():
    torch.manual_seed(1)
    logits = torch.randn(2, 30)
    toks, lps, tops = sample(
        logits, [opts(temperature=0.3, top_p=0.5, top_logprobs=3), opts(top_k=2)], generators(3, 2)
    )
    raw = torch.log_softmax(logits, -1)
    # kind 1: the sampler's log-softmax of the same (unadjusted) logits, the same op: bit for bit
    assert lps == [float(raw[b, t]) for b, t in enumerate(toks)]
    assert [t for t, _ in tops[0]] == raw[0].topk(3).indices.tolist() and tops[1] is None
    assert toks[1] in logits[1].topk(2).indices.tolist()  # top_k filters what is drawn


def test_top_p_keeps_the_smallest_prefix_reaching_it():
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]]))
    drawn = {sample(logits, [opts(top_p=0.8)], [g])[0][0] for g in generators(0, 200)}
    assert drawn == {0, 1}  # 0.5 < 0.8 <= 0.5 + 0.3
    assert {sample(logits, [opts(top_p=0.81)], [g])[0][0] for g in generators(0, 200)} == {0, 1, 2}
    assert not math.isnan(sample(logits, [opts(top_p=1e-9)], generators(0, 1))[1][0])


class Chars:
    """A tokenizer whose token i is chr(i)."""

    def decode(self, tokens):
        return "".join(map(chr, tokens))


def test_stops_token_string_and_length():
    stops = Stops.of(opts(max_tokens=6, stop_token_ids=(ord("!"),), stop_strings=("cd",)), frozenset({0}))
    tok = Chars()
    assert stops.check([ord("a")], tok) == (None, None)
    assert stops.check(list(map(ord, "abc")), tok) == (None, None)
    assert stops.check(list(map(ord, "abcd")), tok) == ("stop", "ab")  # cut before the stop string
    assert stops.check(list(map(ord, "ab!")), tok) == ("stop", None)
    assert stops.check([ord("a"), 0], tok) == ("stop", None)  # EOS
    assert stops.check(list(map(ord, "abxyzw")), tok) == ("length", None)
    assert final_text(list(map(ord, "ab!")), "stop", tok) == "ab"  # a stop token is not text
    assert final_text(list(map(ord, "ab!")), "length", tok) == "ab!"
    no_eos = Stops.of(opts(stop_at_eos=False), frozenset({0}))
    assert no_eos.check([ord("a"), 0], tok) == (None, None)


def test_a_stop_string_is_found_far_from_the_start_and_the_text_cut_at_its_first_occurrence():
    stops = Stops.of(opts(max_tokens=10_000, stop_strings=("xyz", "yz!")), frozenset())
    out = list(map(ord, "a" * 500 + "xy"))
    assert stops.check(out, Chars()) == (None, None)
    assert stops.check(out + [ord("z")], Chars()) == ("stop", "a" * 500)
