"""Acceptance prepares a training op once: loss parsed by the front end, every datum checked and
counted once, the gradient denominator by the rules of engine/prepare.py; the trainer trusts it.
A sample request is checked against the model once, by the engine."""

from __future__ import annotations

import asyncio
import copy

import pytest
from serverutil import serve

from trine.engine import prepare
from trine.engine.api import Forward, LoRAConfig, Loss, SampleRequest, SamplingOptions, TrainDatum, event_type
from trine.engine.prepare import prepare_forward
from trine.engine.sampler import sampler
from trine.service import InitByUri, SamplingRunSpec, SaveByName, TrainingRunSpec
from trine.tokens import TokenCounts

VOCAB, CONTEXT = 100, 16
CE = Loss.parse("cross_entropy")


def datum(n: int = 6, advantages=None, weights=None) -> TrainDatum:
    tokens = list(range(1, n + 1))
    return TrainDatum(
        tokens,
        tokens[1:] + [-100],
        weights=weights,
        logprobs=[-1.0] * n if advantages else None,
        advantages=advantages,
    )


def test_preparing_a_forward_counts_each_datum_and_leaves_the_op_as_sent():
    op = Forward(
        [datum(advantages=[1.0, 0.0, 2.0, 0.0, 1.0, 0.0])],
        Loss.parse("PPO", {"clip_high_threshold": 1.5}),
        backward=False,
    )
    before = copy.deepcopy(op)
    ready = prepare_forward(op, VOCAB, CONTEXT, "tiny")
    assert ready.loss.clip_high == 1.5 and ready.backward is False
    assert ready.denominator is None  # not normalised: the plain sum
    assert ready.counts == (TokenCounts(1, 5, 3),)
    assert op == before and op.counts is None
    assert ready.data[0].tokens is op.data[0].tokens  # the data are not copied


@pytest.mark.parametrize(
    "loss,totals,expected",
    [
        ("cross_entropy", None, 4.0),  # the chunk is the whole batch: its weighted active tokens
        ("cross_entropy", TokenCounts(2, 9, 0), 9.0),  # the whole batch's, as the client declared it
        ("ppo", None, 5.0),  # policy losses count every active token
        ("dro", None, 3.0),  # dro counts the active tokens with a non-zero advantage
        ("dro", TokenCounts(1, 5, 3), 3.0),
    ],
)
def test_the_denominator_follows_the_loss(loss, totals, expected):
    policy = loss != "cross_entropy"
    d = datum(
        advantages=[1.0, 0.0, 2.0, 0.0, 1.0, 0.0] if policy else None,
        weights=None if policy else [1.0, 0.0, 1.0, 1.0, 1.0, 1.0],
    )
    op = prepare_forward(
        Forward([d], Loss.parse(loss), normalise=True, totals=totals), VOCAB, CONTEXT, "tiny"
    )
    assert op.denominator == expected


def test_nothing_in_the_loss_counts_as_one():
    d = TrainDatum([1, 2, 3], [-100, -100, -100])
    assert prepare_forward(Forward([d], CE, normalise=True), VOCAB, CONTEXT, "tiny").denominator == 1.0


def test_totals_smaller_than_the_chunk_name_the_field_they_came_from():
    op = Forward(
        [datum(), datum()],
        CE,
        normalise=True,
        totals=TokenCounts(1, 50, 0),
        totals_field="payload.gradient_accumulation",
    )
    with pytest.raises(
        ValueError,
        match=r"^payload\.gradient_accumulation\.total_samples is 1, but this "
        r"chunk alone has 2",
    ):
        prepare_forward(op, VOCAB, CONTEXT, "tiny")


@pytest.mark.parametrize(
    "op,words",
    [
        (
            Forward([TrainDatum([1, 500], [500, -100])], CE),
            r"data\[0\]\.tokens has ids outside the vocabulary",
        ),
        (Forward([TrainDatum([1, 2], [5, 500])], CE), r"data\[0\]\.target_tokens has ids outside"),
        (
            Forward([TrainDatum([1, 2], [5, 6], weights=[1.0, float("nan")])], CE),
            r"data\[0\]\.weights holds NaN",
        ),
        (Forward([datum()], Loss.parse("ppo")), r"data\[0\]\.logprobs is required by the ppo loss"),
        (Forward([datum(n=20)], CE), "data: a sequence has 20 tokens; tiny handles at most 16"),
        (Forward([], CE), "data: the batch is empty"),
    ],
)
def test_bad_forwards_name_the_field(op, words):
    with pytest.raises(ValueError, match=words):
        prepare_forward(op, VOCAB, CONTEXT, "tiny")


@pytest.mark.parametrize(
    "name,config,words",
    [
        ("hinge", {}, "loss_fn 'hinge' is not supported"),
        ("ppo", {"clip_epsilon": 0.2}, "clip_epsilon"),
        ("ppo", {"clip_high_threshold": 0.2}, "clip_high_threshold is an upper bound on the ratio"),
    ],
)
def test_bad_losses_name_the_field(name, config, words):
    with pytest.raises(ValueError, match=words):
        Loss.parse(name, config)


def test_event_types_follow_the_op_or_command():
    fwd = Forward([], CE)
    cases = (
        fwd,
        Forward([], CE, backward=False),
        SaveByName(kind="weights", name="snap"),
        SaveByName(kind="state", name="s"),
        InitByUri(lora=LoRAConfig(rank=4)),
    )
    assert [event_type(c) for c in cases] == [
        "trainer.forward_backward",
        "trainer.forward",
        "trainer.save_weights",
        "trainer.save_state",
        "trainer.init_run",
    ]


def test_a_datum_is_prepared_once_and_a_prompt_checked_once(tiny_model_dir, tmp_path, monkeypatch):
    """Through the service: the loss is parsed by the front end (here, the caller), each datum is
    checked once at acceptance (the trainer trusts the prepared op), and a sample request is
    checked against the model once (by the engine)."""
    checked, prompts = [], []
    real_check, real_validate = prepare.check_datum, sampler.Sampler._validate
    monkeypatch.setattr(
        prepare, "check_datum", lambda d, *a, **k: checked.append(d) or real_check(d, *a, **k)
    )
    monkeypatch.setattr(
        sampler.Sampler,
        "_validate",
        lambda self, req, *a: prompts.append(req.request_id) or real_validate(self, req, *a),
    )
    with serve(tiny_model_dir, tmp_path / "home") as srv:
        svc = srv.service

        async def work():
            key = svc.ownership.authenticate(srv.api_key)
            session = svc.runs.create_session(key, "test")
            run = svc.runs.create_training_run(
                key, session.id, TrainingRunSpec("tiny-llama", LoRAConfig(rank=4))
            )
            await svc.events.submit(
                key, run.id, event_id="e1", index=1, step=0, command=InitByUri(lora=LoRAConfig(rank=4))
            )
            tokens = list(range(100, 120))
            data = [TrainDatum(tokens, tokens[1:] + [-100]), TrainDatum(tokens[:9], tokens[1:10])]
            fb = Forward(data, Loss.parse("Cross_Entropy"), normalise=True)
            await svc.events.submit(key, run.id, event_id="e2", index=2, step=0, command=fb)
            rec = await svc.events.event(key, run.id, "e2", wait=30)
            sampling = svc.runs.create_sampling_run(key, session.id, SamplingRunSpec("tiny-llama"))
            req = SampleRequest("s1", [5, 6, 7], SamplingOptions(max_tokens=3), num_samples=2)
            out = await svc.sampling.sample(key, sampling.id, req)
            return rec, out

        rec, out = asyncio.run_coroutine_threadsafe(work(), svc.loop).result(60)
    assert rec.status == "succeeded" and len(out.sequences) == 2
    assert len(checked) == 2  # one check per datum, at acceptance; none in the trainer
    assert len(prompts) == 1  # one check per sample request, in the engine
