"""Prefix sharing in training (prefix_groups.py, shared_prefix.py): datums of one run that share a
prefix compute it once, and every loss gives the logprobs, losses and gradients of the plain path."""

from __future__ import annotations

import pytest
import torch
from conftest import build_tiny_model_dir
from test_losses import randomize
from test_trainer import grads, outputs
from tolerance import assert_bitwise, assert_same_computation, fp64_model

from trine.engine.api import LOSS_NAMES, Forward, LoRAConfig, Loss, TrainDatum
from trine.engine.config import TrainerConfig
from trine.engine.model import invariant
from trine.engine.model.weights import load_model
from trine.engine.trainer import shared_prefix
from trine.engine.trainer.prefix_groups import padded_tokens, plan
from trine.engine.trainer.trainer import Trainer

VOCAB = 4096  # a small head: the fp64 twins' cost is mostly its GEMMs, and no check here needs 49K


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return build_tiny_model_dir("llama", tmp_path_factory.mktemp("models") / "tiny-4k", vocab_size=VOCAB)


@pytest.fixture(scope="module")
def model(model_dir):
    return load_model(model_dir, "cpu")


@pytest.fixture(scope="module")
def model64(model_dir):
    """The same weights in fp64: the reference that measures each comparison's fp32 rounding."""
    return fp64_model(model_dir)


def datum(tokens: list[int], g: torch.Generator, prompt: int = 0) -> TrainDatum:
    """Targets are the next tokens (the last: random), the first `prompt` ignored; every datum has
    its own weights, logprobs and advantages, also on the positions it shares with others."""
    n = len(tokens)
    targets = tokens[1:] + [int(torch.randint(0, VOCAB, (1,), generator=g))]
    targets[:prompt] = [-100] * min(prompt, n)
    return TrainDatum(
        tokens=list(tokens),
        target_tokens=targets,
        weights=torch.randn(n, generator=g).tolist(),
        logprobs=(-torch.rand(n, generator=g) * 12 - 9).tolist(),
        advantages=torch.randn(n, generator=g).tolist(),
    )


def shared_data(seed: int) -> list[TrainDatum]:
    """A GRPO group (prompt 21, completions of 5..9 tokens, two of them starting alike), a 3-turn chain
    (one datum per turn, each extending the last) and an unrelated datum."""
    g = torch.Generator().manual_seed(seed)
    rand = lambda n: torch.randint(0, VOCAB, (n,), generator=g).tolist()
    prompt = rand(21)
    common = rand(3)
    group = [datum(prompt + rand(5 + k), g, prompt=4) for k in range(3)]
    group += [datum(prompt + common + rand(4), g), datum(prompt + common + rand(6), g)]
    turns = [rand(17), rand(18), rand(16)]
    chain = [datum([t for turn in turns[: k + 1] for t in turn], g, prompt=3) for k in range(3)]
    return group[:2] + chain[:1] + group[2:] + chain[1:] + [datum(rand(12), g)]


def trainers(model, *runs, unembed=True, **kw):
    out = []
    for sharing in (True, False):
        cfg = TrainerConfig(prefix_sharing=sharing, min_shared_tokens=4, logits_chunk_tokens=7, **kw)
        t = Trainer(model, base_model="tiny", config=cfg)
        for i, run in enumerate(runs):
            t.create_run(run, LoRAConfig(rank=4, seed=i, train_unembed=unembed))
            randomize(t.adapter(run), 10 + i)
        out.append(t)
    return out


def assert_same_counts(a, b):
    assert a.token_count == b.token_count
    assert a.usage.loss_tokens == b.usage.loss_tokens
    assert a.usage.sequence_tokens == b.usage.sequence_tokens


def shared_vs_plain(model, model64, entry, *runs, grads_of=("r",), check=None, **kw):
    """Sharing a prefix computes the plain path's math in another order: in fp64 the two agree, in
    fp32 the shared path is within the plain path's own rounding (tolerance.py, kind 3). `check(a,
    b)` asserts what must hold exactly for each pair of results (shared, plain)."""

    def compute(m):
        shared, plain = trainers(m, *runs, **kw)
        got, want = {}, {}
        for i, (a, b) in enumerate(zip(shared.forward_backward(entry), plain.forward_backward(entry))):
            assert_same_counts(a, b)
            if check:
                check(a, b)
            got |= outputs(a, prefix=f"{i}.")
            want |= outputs(b, prefix=f"{i}.")
        for run in grads_of:
            got[f"grads.{run}"], want[f"grads.{run}"] = grads(shared, run), grads(plain, run)
        return want, got

    assert_same_computation(compute, model, model64)


@pytest.mark.parametrize("unembed", [True, False], ids=["lora_unembed", "no_unembed"])
@pytest.mark.parametrize("denominator", [None, 37.0], ids=["sum", "denominator"])
@pytest.mark.parametrize("name", LOSS_NAMES)
def test_every_loss_shared_equals_plain(model, model64, name, denominator, unembed):
    entry = [("r", Forward(shared_data(1), Loss.parse(name), denominator=denominator))]

    def shared_less(a, b):
        assert a.usage.train_tokens < b.usage.train_tokens == a.usage.sequence_tokens  # it did share

    shared_vs_plain(model, model64, entry, "r", unembed=unembed, check=shared_less)


def test_several_runs_in_one_call_share_only_within_a_run(model, model64):
    """Two runs send the same datums (and one event of run a is split in two): no datum shares with
    another run's, each run's gradient is its plain one."""
    data = shared_data(2)
    batch = [
        ("a", Forward(data[:4], Loss.parse("ppo"), denominator=50.0)),
        ("b", Forward(data, Loss.parse("cross_entropy"))),
        ("a", Forward(data[4:], Loss.parse("importance_sampling"))),
    ]
    shared_vs_plain(model, model64, batch, "a", "b", grads_of=("a", "b"))
    shared = trainers(model, "a", "b")[0]
    computed = sum(r.usage.train_tokens for r in shared.forward_backward(batch))
    one_run = shared.forward_backward([("b", Forward(data, Loss.parse("cross_entropy")))])[
        0
    ].usage.train_tokens
    assert computed == 2 * one_run  # run a's two events shared as much as run b's one
    assert one_run < sum(len(d.tokens) for d in data)


def test_logprobs_bit_for_bit_under_batch_invariant_kernels(model):
    invariant.enable(True)
    try:
        shared, plain = trainers(model, "a", "b")
        data = shared_data(3)
        chains = [d for d in data if len(d.tokens) in (17, 35, 51)]  # alone: one pass, no K/V pool
        assert len(chains) == 3
        for name, batch in (
            ("cross_entropy", None),
            ("gspo", None),
            ("ppo", [("a", Forward(chains, Loss.parse("ppo")))]),
        ):
            batch = batch or [
                ("a", Forward(data, Loss.parse(name))),
                ("b", Forward(data[3:], Loss.parse(name))),
            ]
            for a, b in zip(shared.forward_backward(batch), plain.forward_backward(batch)):
                assert_bitwise(a.logprobs, b.logprobs)  # the batch-invariant contract: exact
                assert a.usage.train_tokens < b.usage.train_tokens
    finally:
        invariant.enable(False)


def shared_less(a, b):
    assert a.usage.train_tokens < b.usage.train_tokens


@pytest.mark.parametrize("batch_invariant", [False, True], ids=["fused", "batch_invariant"])
def test_passes_split_by_segment_length_stay_exact(model, model64, monkeypatch, batch_invariant):
    """Every segment length in a pass of its own (out of slot order): the same logprobs, losses and
    gradients as the plain path, bit for bit under the batch-invariant kernels."""
    monkeypatch.setattr(shared_prefix, "PAD_BOUND", 1.0)
    monkeypatch.setattr(shared_prefix, "MIN_PASS_POSITIONS", 1)
    data = shared_data(5)
    level = sorted({len(d.tokens) for d in data})
    assert len(level) > 4  # several lengths: several passes per depth
    entry = [("r", Forward(data, Loss.parse("importance_sampling")))]

    def check(a, b):
        shared_less(a, b)
        if batch_invariant:
            assert_bitwise(a.logprobs, b.logprobs)

    invariant.enable(batch_invariant)
    try:
        shared_vs_plain(model, model64, entry, "r", check=check)
    finally:
        invariant.enable(False)


def test_small_micro_batches_split_trees_and_stay_exact(model, model64):
    entry = [("r", Forward(shared_data(4), Loss.parse("dro")))]
    shared_vs_plain(model, model64, entry, "r", check=shared_less, micro_batch_tokens=40)


def test_forward_shares_and_changes_no_gradient(model):
    shared, plain = trainers(model, "r")
    before = grads(shared, "r")
    entry = [("r", Forward(shared_data(5), Loss.parse("cispo")))]
    a, b = shared.forward_backward(entry, backward=False)[0], plain.forward_backward(entry, backward=False)[0]
    assert_same_counts(a, b)
    assert a.usage.train_tokens < b.usage.train_tokens
    assert_bitwise(grads(shared, "r"), before)  # a forward adds nothing, not even a rounding


# ----------------------------------------------------------------------------- grouping (torch-free)
def test_grpo_group_is_one_prompt_segment_with_a_child_per_completion():
    prompt = list(range(100, 356))
    seqs = [prompt + [k] * 64 for k in range(8)]
    p = plan(seqs, [0] * 8)
    ((tree,),) = p.batches
    assert [(s.start, s.end, s.depth) for s in tree.segments] == [(0, 256, 0)] + [(256, 320, 1)] * 8
    assert sum(p.charged) == tree.computed == 256 + 8 * 64 and p.plain == []
    assert p.charged[0] == 320  # a computed token is charged to the first datum that reads it


def test_multi_turn_chain_is_one_segment_read_by_every_turn():
    seqs = [list(range(128 * (k + 1))) for k in range(4)]
    p = plan(seqs, [0] * 4)
    ((tree,),) = p.batches
    assert [(s.start, s.end) for s in tree.segments] == [(0, 512)]
    assert sorted(i for i, _ in tree.members) == [0, 1, 2, 3] and p.charged == [128] * 4


def test_short_shared_prefixes_are_copied_and_runs_never_share():
    a, b = [7] * 5 + [1] * 30, [7] * 5 + [2] * 30
    p = plan([a, b], [0, 0], min_shared=6)  # 5 shared tokens: not worth a pass
    assert p.batches == [] and p.plain == [0, 1] and p.charged == [35, 35]
    p = plan([a, b], [0, 0], min_shared=5)
    assert [s.end - s.start for s in p.batches[0][0].segments] == [5, 30, 30]
    p = plan([a, a, b], [0, 1, 2], min_shared=1)  # same tokens, three runs
    assert p.batches == [] and p.plain == [0, 1, 2]


def test_trees_fit_the_micro_batch_budget():
    prompt = list(range(1000, 1100))
    seqs = [prompt + [k] * 50 for k in range(10)] + [list(range(500))]
    p = plan(seqs, [0] * 11, budget=300)
    assert all(padded_tokens(mb) <= 300 for mb in p.batches)
    members = sorted(i for mb in p.batches for t in mb for i, _ in t.members)
    assert members == list(range(10)) and p.plain == [10]
    assert sum(p.charged[:10]) == sum(t.computed for mb in p.batches for t in mb) == 3 * 100 + 10 * 50
