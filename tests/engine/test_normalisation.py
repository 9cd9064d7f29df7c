"""PyTRIO's gradient normalisation: each chunk's summed loss is divided by the whole logical batch's
denominator (`gradient_accumulation`), so a batch sent whole or in chunks gives one gradient and a
repeated datum leaves the gradient unchanged. The engine's plain sum stays available (no
denominator), as the Tinker API needs."""

from __future__ import annotations

import pytest
import torch
from serverutil import RawClient, event, init_payload, pytrio_env, serve
from tolerance import SERVED_GRAD_PATHS, SERVED_PATHS, assert_same_computation

from trine.engine.api import AdamConfig, Forward, LoRAConfig, Loss, TrainDatum
from trine.engine.model.weights import load_model
from trine.engine.trainer.trainer import Trainer

MODEL = "tiny-llama"
TEXTS = [
    [1, 504, 3330, 314, 253, 1345, 28, 357, 314, 253, 1345, 30, 2],
    [1, 357, 314, 253, 30, 2],
    [1, 28, 357, 314, 253, 1345, 30, 2, 504],
]


@pytest.fixture(scope="module")
def trio(tiny_model_dir, tmp_path_factory):
    with (
        serve(tiny_model_dir, tmp_path_factory.mktemp("home")) as srv,
        pytrio_env(srv.url, srv.api_key) as pytrio,
    ):
        pytrio.server = srv
        client = pytrio.ServiceClient()
        pytrio.client = client
        yield pytrio
        client._runtime.shutdown()


def ce(trio, tokens):
    return trio.Datum(
        model_input=trio.ModelInput.from_ints(tokens[:-1]), loss_fn_inputs={"target_tokens": tokens[1:]}
    )


def policy(trio, tokens, advantage):
    n = len(tokens) - 1
    return trio.Datum(
        model_input=trio.ModelInput.from_ints(tokens[:-1]),
        loss_fn_inputs={
            "target_tokens": tokens[1:],
            "logprobs": [-2.0] * n,
            "advantages": [0.0] * (n // 2) + [advantage] * (n - n // 2),
        },
    )


def grad_norm(trio, data, loss, *, seed, chunk_size=None):
    tc = trio.client.create_lora_training_client(base_model=MODEL, rank=4, seed=seed)
    if chunk_size is not None:  # as if the server limited each request to `chunk_size` samples
        from pytrio.model.limits import TrainingLimits

        tc._limits = TrainingLimits(
            max_batch_size=chunk_size, max_tokens_per_request=None, max_seq_len=tc._limits.max_seq_len
        )
    out = tc.forward_backward(data, loss).result()
    step = tc.optim_step(trio.AdamParams(learning_rate=1e-3)).result()
    return out.metrics, step.metrics["grad_norm"]


@pytest.mark.parametrize("loss", ["cross_entropy", "importance_sampling", "dro"])
def test_pytrio_batch_sent_whole_or_in_chunks_gives_the_same_gradient(trio, loss):
    data = (
        [ce(trio, t) for t in TEXTS]
        if loss == "cross_entropy"
        else [policy(trio, t, a) for t, a in zip(TEXTS, (1.0, -0.5, 2.0))]
    )
    whole_metrics, whole = grad_norm(trio, data, loss, seed=3)
    chunk_metrics, chunked = grad_norm(trio, data, loss, seed=3, chunk_size=1)
    # Through a server: two engine paths of one gradient (its rows batched otherwise), kind 3 one
    # level up (tolerance.SERVED_*); a wrong denominator would be a factor of 1.5 or more.
    assert chunked == pytest.approx(whole, rel=SERVED_GRAD_PATHS)
    assert chunk_metrics["token_count"] == whole_metrics["token_count"]
    # loss_sum is unnormalised: the logprobs' rounding, summed over terms of one sign per datum
    assert chunk_metrics["loss_sum"] == pytest.approx(whole_metrics["loss_sum"], rel=SERVED_PATHS)


@pytest.mark.parametrize("loss", ["cross_entropy", "dro"])
def test_pytrio_a_duplicated_batch_has_the_same_gradient_norm(trio, loss):
    data = (
        [ce(trio, t) for t in TEXTS[:2]]
        if loss == "cross_entropy"
        else [policy(trio, t, a) for t, a in zip(TEXTS[:2], (1.0, -0.5))]
    )
    once_metrics, once = grad_norm(trio, data, loss, seed=4)
    twice_metrics, twice = grad_norm(trio, data + data, loss, seed=4, chunk_size=2)
    assert twice == pytest.approx(once, rel=SERVED_GRAD_PATHS)  # two engine paths (kind 3, served)
    assert twice_metrics["loss_sum"] == pytest.approx(2 * once_metrics["loss_sum"], rel=SERVED_PATHS)
    assert twice_metrics["token_count"] == 2 * once_metrics["token_count"]


def test_the_gradient_is_the_mean_over_active_tokens(trio):
    """Magnitudes as on PyTRIO's service: the gradient of the token mean, not the sum."""
    import trine

    data = [ce(trio, TEXTS[0])]
    _, pytrio_norm = grad_norm(trio, data, "cross_entropy", seed=5)
    # the same step through the engine with no denominator (plain sum) is token_count x larger
    srv = trio.server
    with trine.ServiceClient(base_url=srv.url, api_key=srv.api_key) as sdk:
        tc = sdk.create_lora_training_client(MODEL, rank=4, seed=5)
        datum = trine.Datum(
            model_input=trine.ModelInput.from_ints(TEXTS[0][:-1]),
            loss_fn_inputs={"target_tokens": TEXTS[0][1:]},
        )
        tc.forward_backward([datum, datum])
        sdk_norm = tc.optim_step(trine.AdamParams(learning_rate=1e-3)).result().metrics["grad_norm"]
    # the trine SDK sends the totals too: the same batch, another client (kind 3, served)
    assert sdk_norm == pytest.approx(pytrio_norm, rel=SERVED_GRAD_PATHS)


def test_engine_keeps_the_plain_sum_without_a_denominator(tiny_model_dir, tiny_model64):
    """Without a denominator the gradient is the plain sum: 7x the gradient with a denominator of
    7. Scaling each token's gradient by 1/7 rounds it, and the backward then rounds other values:
    the same math, fp32 rounding apart (tolerance.py, kind 3, against the fp64 twin)."""
    data = [TrainDatum(t[:-1], t[1:]) for t in TEXTS]

    def compute(model):
        out = {}
        for denominator in (None, 7.0):
            trainer = Trainer(model, base_model="m")
            trainer.create_run("r", LoRAConfig(rank=4, seed=1))
            (res,) = trainer.forward_backward(
                [("r", Forward(data, Loss.parse("cross_entropy"), denominator=denominator))]
            )
            assert res.token_count == sum(len(t) - 1 for t in TEXTS)
            g = {n: p.grad.clone() for n, p in trainer.adapter("r").named_parameters()}
            g["norm"] = torch.tensor(trainer.optim_step("r", AdamConfig(learning_rate=1e-3))["grad_norm"])
            out[denominator] = g
        return {"grads": out[None]}, {"grads": {n: 7.0 * g for n, g in out[7.0].items()}}

    assert_same_computation(compute, load_model(tiny_model_dir, "cpu"), tiny_model64)
    with pytest.raises(ValueError, match="denominator"):
        Trainer(load_model(tiny_model_dir, "cpu"), base_model="m").forward_backward(
            [("r", Forward(data, Loss.parse("cross_entropy"), denominator=0.5))]
        )


def test_totals_smaller_than_the_chunk_are_refused_before_running(trio):
    srv = trio.server
    raw = RawClient(srv.url, srv.api_key)
    try:
        run = raw.training_run(raw.session(), MODEL)
        assert raw.submit(
            run, event("event_norminit0001", "init_run", 1, init_payload(run["model_id"]))
        ).status_code in (200, 202)
        payload = {
            "data": [
                {
                    "model_input": {"chunks": [{"type": "encoded_text", "tokens": TEXTS[0][:-1]}]},
                    "target_ids": TEXTS[0][1:],
                    "weights": [1.0] * 12,
                }
            ],
            "auto_shift": False,
            "loss": {"type": "cross_entropy", "config": {}},
            "gradient_accumulation": {
                "total_samples": 1,
                "total_active_tokens": 3,
                "total_advantage_tokens": 0,
            },
        }
        # refused before anything runs: the event takes its index and fails naming the field (the
        # official client treats an error answer to a submit as fatal to its training client)
        err = raw.refused(run, event("event_normbad00001", "forward_backward", 2, payload))
        assert "gradient_accumulation.total_active_tokens" in err["message"]
        payload["gradient_accumulation"]["total_active_tokens"] = 12
        r = raw.submit(run, event("event_normgood0001", "forward_backward", 3, payload))
        assert r.status_code in (200, 202)
        assert raw.wait(run, "event_normgood0001")["status"] == "succeeded"
    finally:
        raw.close()
