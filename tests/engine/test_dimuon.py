"""Dimuon (engine/trainer/dimuon.py): the step against a reference written from its definition, its
invariants (direction norm, rank correction, zero momentum), the family check, checkpoints, learning."""

from __future__ import annotations

import math

import pytest
import torch
from test_losses import random_data, randomize
from tolerance import EPS32, Rounding, gamma

from trine.engine.api import AdamConfig, DimuonConfig, Forward, LoRAConfig, Loss
from trine.engine.model.weights import load_model
from trine.engine.trainer import checkpoint
from trine.engine.trainer.dimuon import balanced, matrix_sign
from trine.engine.trainer.trainer import Trainer

CE = Loss.parse("cross_entropy")


@pytest.fixture(scope="module")
def model(tiny_model_dir):
    return load_model(tiny_model_dir, "cpu")


def dimuon_run(model, rank=4, seed=1) -> Trainer:
    trainer = Trainer(model, base_model="tiny")
    trainer.create_run("r", LoRAConfig(rank=rank, seed=seed), optimizer="dimuon")
    randomize(trainer.adapter("r"), 10)  # non-zero B: every matrix gets a gradient
    return trainer


def test_matrix_sign_is_the_polar_factor():
    x = torch.randn(6, 40, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    u, _, vh = torch.linalg.svd(x, full_matrices=False)
    for m in (x, x.T):  # wide and tall
        o = matrix_sign(m.float()).double()
        polar = u @ vh if m is x else (u @ vh).T
        s = torch.linalg.svdvals(o)  # Muon's quintic lands singular values near 1, not on it
        assert float(s.min()) > 0.6 and float(s.max()) < 1.25
        cos = float((o * polar).sum() / (o.norm() * polar.norm()))
        assert cos > 0.98


def test_one_step_matches_the_definition(model):
    cfg = DimuonConfig(learning_rate=0.01, beta1=0.8, damping=1e-3, rank_lr_correction_exponent=0.5)
    trainer = dimuon_run(model, rank=8)
    before = {n: p.detach().clone() for n, p in trainer.adapter("r").named_parameters()}
    data = random_data(3, lengths=(9, 6))
    trainer.forward_backward([("r", Forward(data, CE))])
    grads = {n: p.grad.clone() for n, p in trainer.adapter("r").named_parameters()}
    trainer.optim_step("r", cfg)
    lr = 0.01 * (8 / 32) ** 0.5

    def expected(n, dtype):  # the definition, written out, on the same gradients in `dtype`
        m = (1 - 0.8) * grads[n].to(dtype)  # the EMA from zero
        x = m / m.pow(2).mean().sqrt()
        x = (
            x
            / (x.pow(2).mean(1, keepdim=True) + 1e-3) ** 0.25
            / (x.pow(2).mean(0, keepdim=True) + 1e-3) ** 0.25
        )
        o = matrix_sign(x)
        return before[n].to(dtype) - lr * math.sqrt(8) * o / o.norm()

    # the optimizer's fp32 step is another order of the definition's math (tolerance.py, kind 3)
    names = [n for n, _ in trainer.adapter("r").named_parameters()]
    got = {n: p.detach() for n, p in trainer.adapter("r").named_parameters()}
    Rounding(
        {n: expected(n, torch.float32) for n in names}, {n: expected(n, torch.float64) for n in names}
    ).assert_within(got)
    for n in names:
        # The step's norm is lr * sqrt(rank) (the direction's norm): each weight rounded once when
        # the step was added (at most u |p_i|: u ||p|| in norm), the direction's normalisation a
        # length-n sum (gamma_n of its norm), kind 2.
        step = (got[n] - before[n]).double()
        bound = EPS32 / 2 * float(got[n].double().norm()) + gamma(got[n].numel()) * lr * math.sqrt(8)
        assert abs(float(step.norm()) - lr * math.sqrt(8)) <= bound, n


def test_balanced_is_scale_free():
    """Scaled to RMS 1 first, so scaling the input by 1e-6 changes it by the math's own epsilons
    only, not by 1e-6: NORM_EPS (1e-7) is a tenth of that input's RMS, which the damping (1e-4)
    then sees, about 5e-5 of the values in exact arithmetic (the fp64 twin shows the same), far
    above rounding (gamma_40 ~ 2e-6); the bound is that effect's size, not a CPU's."""
    m = torch.randn(4, 30, generator=torch.Generator().manual_seed(1))
    torch.testing.assert_close(balanced(m, 1e-4), balanced(m * 1e-6, 1e-4), atol=1e-4, rtol=1e-4)
    m64 = m.double()
    torch.testing.assert_close(balanced(m64, 1e-4), balanced(m64 * 1e-6, 1e-4), atol=1e-4, rtol=1e-4)


def test_zero_momentum_does_not_move_and_state_counts_steps(model):
    trainer = Trainer(model, base_model="tiny")
    trainer.create_run("r", LoRAConfig(rank=4, seed=1), optimizer="dimuon")  # B = 0: A has no gradient
    a_before = {
        n: p.detach().clone() for n, p in trainer.adapter("r").named_parameters() if n.startswith("A.")
    }
    trainer.forward_backward([("r", Forward(random_data(1, lengths=(8,)), CE))])
    trainer.optim_step("r", DimuonConfig(learning_rate=0.01))
    for n, p in trainer.adapter("r").named_parameters():
        if n in a_before:
            assert torch.equal(p.detach(), a_before[n])  # zero momentum: no step
        else:
            assert float(p.detach().abs().max()) > 0  # B moved off zero
    state = trainer._runs["r"].optimizer.state
    assert {int(s["step"]) for s in state.values()} == {1}


def test_the_run_family_is_checked(model):
    trainer = dimuon_run(model)
    with pytest.raises(ValueError, match="made with the dimuon optimizer: send DimuonParams"):
        trainer.optim_step("r", AdamConfig())
    trainer.create_run("adam", LoRAConfig(rank=4))
    with pytest.raises(ValueError, match="made with the adamw optimizer: send AdamParams"):
        trainer.optim_step("adam", DimuonConfig(learning_rate=1e-3))
    with pytest.raises(ValueError, match="DimuonParams.beta1 must be a finite number in \\[0, 1\\)"):
        trainer.optim_step("r", DimuonConfig(learning_rate=1e-3, beta1=1.0))
    with pytest.raises(ValueError, match="optimizer 'sgd' is not supported"):
        trainer.create_run("x", LoRAConfig(rank=4), optimizer="sgd")


def test_checkpoint_holds_dimuon_state_and_resumes_exactly(model, tmp_path):
    cfg = DimuonConfig(learning_rate=0.005, grad_clip_norm=1.0)
    batches = [random_data(s, lengths=(7, 5)) for s in range(4)]

    def step(trainer, run, data):
        trainer.forward_backward([(run, Forward(data, CE))])
        return trainer.optim_step(run, cfg)

    a = dimuon_run(model)
    for data in batches[:2]:
        step(a, "r", data)
    a.save_state("r", tmp_path / "state")
    assert checkpoint.optimizer_state_family(tmp_path / "state") == "dimuon"

    b = Trainer(model, base_model="tiny")
    b.load_state("resumed", tmp_path / "state", with_optimizer=True, optimizer="dimuon")
    assert b.optimizer_family("resumed") == "dimuon"
    for data in batches[2:]:
        assert step(a, "r", data) == step(b, "resumed", data)
    for (n, p), (m, q) in zip(a.adapter("r").named_parameters(), b.adapter("resumed").named_parameters()):
        assert n == m and torch.equal(p, q)

    with pytest.raises(ValueError, match="holds dimuon optimizer state and this run trains with adamw"):
        b.load_state("adam", tmp_path / "state", with_optimizer=True, optimizer="adamw")
    b.load_state("adam", tmp_path / "state", with_optimizer=False, optimizer="adamw")  # weights only
    assert b.optimizer_family("adam") == "adamw"


def test_dimuon_lowers_the_loss(model):
    trainer = dimuon_run(model, rank=8)
    data = random_data(5, lengths=(12, 9, 10))
    losses = []
    for _ in range(8):
        losses.append(trainer.forward_backward([("r", Forward(data, CE))])[0].loss_sum)
        trainer.optim_step("r", DimuonConfig(learning_rate=0.02))
    assert losses[-1] < losses[0]
