"""Client-side checking and chunking of a logical forward_backward batch (no server needed)."""

from __future__ import annotations

import pytest

import trine as trio
from trine.client.batch import Limits, plan_batch

V = 100


def ce(tokens, targets, weights=None):
    inputs = {"target_tokens": targets}
    if weights is not None:
        inputs["weights"] = weights
    return trio.Datum(model_input=trio.ModelInput.from_ints(tokens), loss_fn_inputs=inputs)


def policy(tokens, targets, logprobs, advantages):
    return trio.Datum(
        model_input=trio.ModelInput.from_ints(tokens),
        loss_fn_inputs={"target_tokens": targets, "logprobs": logprobs, "advantages": advantages},
    )


def test_cross_entropy_totals_and_default_weights():
    data = [ce([1, 2, 3], [2, 3, -100]), ce([4, 5], [5, 6], [0.0, 2.0])]
    plan = plan_batch(data, loss_fn="Cross_Entropy", auto_shift=False, limits=Limits(), vocab_size=V)
    assert plan.loss_fn == "cross_entropy" and len(plan.chunks) == 1
    assert plan.totals == {"total_samples": 2, "total_active_tokens": 3, "total_advantage_tokens": 0}
    first = plan.chunks[0][0]
    assert first["weights"] == [1.0, 1.0, 1.0] and first["target_ids"] == [2, 3, -100]
    assert first["model_input"] == {"chunks": [{"type": "encoded_text", "tokens": [1, 2, 3]}]}
    (payload,) = plan.payloads({"x": 1}, False)
    assert payload["loss"] == {"type": "cross_entropy", "config": {"x": 1}}


def test_policy_loss_counts_advantage_tokens_and_auto_shift():
    d = policy([1, 2, 3], [0, 2, 3], [0.0, -1.0, -2.0], [0.0, 1.0, 0.0])
    plan = plan_batch([d], loss_fn="importance_sampling", auto_shift=True, limits=Limits(), vocab_size=V)
    assert plan.totals == {"total_samples": 1, "total_active_tokens": 2, "total_advantage_tokens": 1}
    assert set(plan.chunks[0][0]) == {"model_input", "target_ids", "logprobs", "advantages"}


def test_chunks_keep_order_and_share_the_batch_totals():
    data = [ce([i, i + 1], [i + 1, i + 2]) for i in range(5)]
    plan = plan_batch(
        data, loss_fn="cross_entropy", auto_shift=False, limits=Limits(max_batch_size=2), vocab_size=V
    )
    assert [len(c) for c in plan.chunks] == [2, 2, 1]
    assert [d["target_ids"][0] for c in plan.chunks for d in c] == [1, 2, 3, 4, 5]
    payloads = plan.payloads(None, False)
    assert all(
        p["gradient_accumulation"]
        == {"total_samples": 5, "total_active_tokens": 10, "total_advantage_tokens": 0}
        for p in payloads
    )
    by_tokens = plan_batch(
        data, loss_fn="cross_entropy", auto_shift=False, limits=Limits(max_tokens_per_request=5), vocab_size=V
    )
    assert [len(c) for c in by_tokens.chunks] == [2, 2, 1]


@pytest.mark.parametrize(
    "data, loss, match",
    [
        ([], "cross_entropy", "empty"),
        ([ce([1, 2], [2, 3])], "hinge", "Unsupported loss function"),
        ([ce([1, 2], [2, 3]), ce([1, 2], [2])], "cross_entropy", r"data\[1\].*target_tokens.*shape \[2\]"),
        (
            [ce([1, 200], [2, 3])],
            "cross_entropy",
            r"data\[0\].model_input token 1 = 200 is outside the vocabulary",
        ),
        ([ce([1, 2], [2, 300])], "cross_entropy", r"target_tokens'\]\[1\] = 300"),
        ([ce([1, 2], [2.0, 3.0])], "cross_entropy", "integers"),
        ([ce([1, 2], [2, 3], [1.0, float("nan")])], "cross_entropy", r"weights'\]\[1\] must be finite"),
        ([ce([1, 2], [2, 3], [1.0])], "cross_entropy", r"weights'\] must have shape \[2\]"),
        ([ce([1, 2], [2, 3])], "importance_sampling", r"loss_fn_inputs\['logprobs'\] is required"),
        ([ce([], [])], "cross_entropy", "empty"),
    ],
)
def test_bad_batches_are_refused_before_sending(data, loss, match):
    with pytest.raises(trio.ValidationError, match=match) as e:
        plan_batch(data, loss_fn=loss, auto_shift=False, limits=Limits(), vocab_size=V)
    assert isinstance(e.value, ValueError)


def test_limits_refuse_oversized_samples():
    with pytest.raises(ValueError, match="max_seq_len 3"):
        plan_batch(
            [ce([1, 2, 3, 4], [1, 2, 3, 4])],
            loss_fn="cross_entropy",
            auto_shift=False,
            limits=Limits(max_seq_len=3),
            vocab_size=V,
        )


def test_an_image_without_expected_tokens_is_sized_from_the_targets():
    mi = trio.ModelInput(
        chunks=[trio.EncodedTextChunk(tokens=[1, 2]), trio.ImageChunk(data=b"x", format="png")]
    )
    d = trio.Datum(model_input=mi, loss_fn_inputs={"target_tokens": [-100] * 5 + [1]})
    plan = plan_batch([d], loss_fn="cross_entropy", auto_shift=False, limits=Limits(), vocab_size=V)
    image = plan.chunks[0][0]["model_input"]["chunks"][1]
    assert image == {"type": "image", "format": "png", "data": b"x", "expected_tokens": 4}
