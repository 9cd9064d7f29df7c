"""Service commands -> engine ops: checked and translated once, the command left as sent; the loss
parsed once per event; the gradient denominator by the rules beside the losses."""
from __future__ import annotations

import asyncio
import copy

import pytest

from serverutil import serve
from trine.engine.losses import Loss
from trine.service import (Forward, GradientTotals, InitRun, InvalidRequest, LoraSpec, SamplingRunSpec, Save,
                           TrainingDatum, TrainingRunSpec, event_type)
from trine.service.translate import SaveTarget, forward_op, training_op

VOCAB, CONTEXT = 100, 16


def datum(n: int = 6, advantages=None, weights=None) -> TrainingDatum:
    tokens = list(range(1, n + 1))
    return TrainingDatum(tokens, tokens[1:] + [-100], weights=weights, logprobs=[-1.0] * n if advantages else None,
                         advantages=advantages)


def test_a_forward_becomes_an_op_with_the_parsed_loss_and_leaves_the_command_as_sent():
    command = Forward([datum(advantages=[1.0, 0.0, 2.0, 0.0, 1.0, 0.0])], "PPO", {"clip_high_threshold": 1.5},
                      backward=False)
    before = copy.deepcopy(command)
    op = forward_op(command, VOCAB, CONTEXT, "tiny")
    assert op.loss == Loss.parse("ppo", {"clip_high_threshold": 1.5}) and op.loss.clip_high == 1.5
    assert op.backward is False and op.denominator is None  # not normalised: the plain sum
    assert command == before and command.loss_fn == "PPO"
    assert op.data[0].tokens is command.data[0].tokens  # the data are not copied


@pytest.mark.parametrize("loss,totals,expected", [
    ("cross_entropy", None, 4.0),  # the chunk is the whole batch: its weighted active tokens
    ("cross_entropy", GradientTotals(2, 9, 0), 9.0),  # the whole batch's, as the client declared it
    ("ppo", None, 5.0),  # policy losses count every active token
    ("dro", None, 3.0),  # dro counts the active tokens with a non-zero advantage
    ("dro", GradientTotals(1, 5, 3), 3.0),
])
def test_the_denominator_follows_the_loss(loss, totals, expected):
    policy = loss != "cross_entropy"
    d = datum(advantages=[1.0, 0.0, 2.0, 0.0, 1.0, 0.0] if policy else None,
              weights=None if policy else [1.0, 0.0, 1.0, 1.0, 1.0, 1.0])
    op = forward_op(Forward([d], loss, normalise=True, totals=totals), VOCAB, CONTEXT, "tiny")
    assert op.denominator == expected


def test_nothing_in_the_loss_counts_as_one():
    d = TrainingDatum([1, 2, 3], [-100, -100, -100])
    assert forward_op(Forward([d], normalise=True), VOCAB, CONTEXT, "tiny").denominator == 1.0


def test_totals_smaller_than_the_chunk_name_the_field_they_came_from():
    command = Forward([datum(), datum()], normalise=True,
                      totals=GradientTotals(1, 50, 0, "payload.gradient_accumulation"))
    with pytest.raises(InvalidRequest, match=r"^payload\.gradient_accumulation\.total_samples is 1, but this "
                                             r"chunk alone has 2"):
        forward_op(command, VOCAB, CONTEXT, "tiny")


@pytest.mark.parametrize("command,words", [
    (Forward([datum()], "hinge"), "loss_fn 'hinge' is not supported"),
    (Forward([datum()], "ppo", {"clip_epsilon": 0.2}), "clip_epsilon"),
    (Forward([TrainingDatum([1, 500], [500, -100])]), r"data\[0\]\.tokens has ids outside the vocabulary"),
    (Forward([datum(n=20)]), "data: a sequence has 20 tokens; tiny handles at most 16"),
    (Forward([]), "data: the batch is empty"),
])
def test_bad_forwards_are_invalid_requests_naming_the_field(command, words):
    with pytest.raises(InvalidRequest, match=words):
        forward_op(command, VOCAB, CONTEXT, "tiny")


def test_other_commands_take_the_facts_the_service_resolved():
    init = training_op(InitRun(LoraSpec(rank=8, seed=None, train_unembed=False), "", "trio://r/state/s", True),
                       checkpoint_path="/ck/dir")
    assert (init.lora.rank, init.lora.seed, init.lora.train_unembed) == (8, 0, False)
    assert (init.checkpoint_path, init.checkpoint_uri, init.load_optimizer) == ("/ck/dir", "trio://r/state/s", True)
    save = Save("weights", "snap", "TEMPORARY")
    op = training_op(save, save=SaveTarget("trio://r/weights/snap", "ck_1", ""))
    assert (op.kind, op.checkpoint_id, op.path, op.uri) == ("weights", "ck_1", "", "trio://r/weights/snap")
    assert [event_type(c) for c in (Forward([]), Forward([], backward=False), save, Save("state", "s"))] == [
        "trainer.forward_backward", "trainer.forward", "trainer.save_weights", "trainer.save_state"]


def test_the_loss_is_parsed_once_per_event(tiny_model_dir, tmp_path, monkeypatch):
    parsed = []
    real = Loss.parse.__func__
    monkeypatch.setattr(Loss, "parse", classmethod(lambda cls, *a: parsed.append(a[0]) or real(cls, *a)))
    with serve(tiny_model_dir, tmp_path / "home") as srv:
        svc = srv.service

        async def train():
            key = svc.ownership.authenticate(srv.api_key)
            session = svc.runs.create_session(key, "test")
            run = svc.runs.create_training_run(key, session.id, TrainingRunSpec("tiny-llama", LoraSpec(rank=4)))
            await svc.events.submit(key, run.id, event_id="e1", index=1, step=0, command=InitRun(LoraSpec(rank=4)))
            tokens = list(range(100, 120))
            fb = Forward([TrainingDatum(tokens, tokens[1:] + [-100])], "Cross_Entropy", normalise=True)
            await svc.events.submit(key, run.id, event_id="e2", index=2, step=0, command=fb)
            rec = await svc.events.event(key, run.id, "e2", wait=30)
            svc.runs.create_sampling_run(key, session.id, SamplingRunSpec("tiny-llama"))  # no loss there
            return rec
        rec = asyncio.run_coroutine_threadsafe(train(), svc.loop).result(60)
    assert rec.status == "succeeded"
    assert parsed == ["Cross_Entropy"]  # at acceptance; the engine used the op's parsed loss
