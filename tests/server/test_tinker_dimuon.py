"""Dimuon through the official `tinker` 0.38 client against a real trine server: chosen at creation
(`DimuonOptimizerConfig`), stepped with `DimuonParams`, reported by get_info and weights_info, kept
by full-state checkpoints (a resumed client continues exactly), and refused where it does not fit."""

from __future__ import annotations

import pytest

tinker = pytest.importorskip("tinker")
from tinker import types  # noqa: E402
from tinker.types.optimizer import OptimizerConfigBase  # noqa: E402

MODEL = "tiny-llama"
TEXT = [1, 504, 3330, 314, 253, 1345, 28, 357, 314, 253, 1345, 30, 2]


def datum(tokens=TEXT):
    return types.Datum(
        model_input=types.ModelInput.from_ints(tokens[:-1]),
        loss_fn_inputs={"target_tokens": tokens[1:], "weights": [1.0] * (len(tokens) - 1)},
    )


DIMUON = {"type": "dimuon", "version": 1}


def config(obj) -> dict:
    """An OptimizerConfig as data (the client parses non-Adam families as OptimizerConfigBase)."""
    return obj.model_dump()


def train_step(tc, lr=0.05) -> float:
    fb = tc.forward_backward([datum()], "cross_entropy")
    step = tc.optim_step(types.DimuonParams(learning_rate=lr, grad_clip_norm=5.0))
    loss = fb.result().metrics["loss:sum"]
    assert step.result().metrics is not None
    return loss


def test_dimuon_trains_reports_itself_and_resumes_exactly(srv, sc):
    tc = sc.create_lora_training_client(
        base_model=MODEL, rank=8, seed=3, optimizer=types.DimuonOptimizerConfig()
    ).result()
    assert config(tc.get_info().optimizer_config) == DIMUON
    losses = [train_step(tc) for _ in range(6)]
    assert losses[-1] < 0.9 * losses[0], losses  # it learns the sequence

    state = tc.save_state("dimuon-state").result().path
    info = tinker.RestClient(base_url=srv.url, api_key="tml-" + srv.api_key).get_weights_info_by_tinker_path(
        state
    )
    assert config(info.result().optimizer_config) == DIMUON

    resumed = sc.create_training_client_from_state_with_optimizer(state).result()
    assert config(resumed.get_info().optimizer_config) == DIMUON  # the checkpoint's
    continued = [train_step(tc) for _ in range(2)]
    assert [train_step(resumed) for _ in range(2)] == continued  # momentum kept: the same steps

    # weights only, into a model of the other family: allowed, with a fresh AdamW
    adam = sc.create_training_client_from_state(state).result()
    assert config(adam.get_info().optimizer_config) == {"type": "adamw"}
    with pytest.raises(Exception, match="sent DimuonParams, but this model was made with the adamw"):
        adam.optim_step(types.DimuonParams(learning_rate=1e-3)).result()
    adam.optim_step(types.AdamParams(learning_rate=1e-3)).result()  # the client goes on
    with pytest.raises(Exception, match="holds dimuon optimizer state and this model trains with adamw"):
        adam.load_state_with_optimizer(state).result()
    # weights only, with the optimizer named: a fresh Dimuon
    fresh = sc.create_training_client_from_state(state, optimizer=types.DimuonOptimizerConfig()).result()
    assert config(fresh.get_info().optimizer_config) == DIMUON
    assert train_step(fresh) == continued[0]  # kind 1: the saved fp32 weights, one datum alone

    # run listings show the last step's settings
    from trine.metering.report import fmt_optimizer

    key = srv.service.store.key_by_secret(srv.api_key)
    runs, _ = srv.service.queries.training_runs(key)
    shown = {fmt_optimizer(r.optimizer_settings) for r in runs}
    assert "dimuon lr 0.05 b 0.9 clip 5" in shown and "lr 0.001 b 0.9/0.95 wd 0 clip 0" in shown


def test_dimuon_model_refuses_adam_params_and_bad_settings(sc):
    tc = sc.create_lora_training_client(
        base_model=MODEL, rank=4, optimizer=types.DimuonOptimizerConfig()
    ).result()
    with pytest.raises(Exception, match="sent AdamParams, but this model was made with the dimuon optimizer"):
        tc.optim_step(types.AdamParams(learning_rate=1e-3)).result()
    bad = types.DimuonParams.model_construct(learning_rate=11.0)  # past the client's own checks
    with pytest.raises(Exception, match="DimuonParams.learning_rate must be a finite number in \\[0, 10\\]"):
        tc.optim_step(bad).result()
    assert train_step(tc) > 0  # every refused call kept its seq_id


def test_unknown_optimizer_is_a_400_naming_both_families(sc):
    with pytest.raises(tinker.BadRequestError, match="'sgd': not supported; use AdamOptimizerConfig"):
        sc.create_lora_training_client(
            base_model=MODEL, rank=4, optimizer=OptimizerConfigBase(type="sgd")
        ).result()
