"""Trainer: gradient accumulation, AdamW semantics, batching of many runs, versions, learning."""

from __future__ import annotations

import math

import pytest
import torch
from test_losses import random_data, randomize
from tolerance import EPS32, assert_bitwise, assert_same_computation, assert_within_bound, gamma

from trine.engine.api import AdamConfig, Forward, LoRAConfig, Loss, TrainDatum
from trine.engine.config import TrainerConfig
from trine.engine.model.lora import AdapterBatch
from trine.engine.model.tokenizer import Tokenizer
from trine.engine.model.weights import load_model
from trine.engine.trainer.trainer import Trainer


@pytest.fixture(scope="module")
def model(tiny_model_dir):
    return load_model(tiny_model_dir, "cpu")


def new_trainer(model, *runs, rank=4, **kw) -> Trainer:
    trainer = Trainer(model, base_model="tiny", config=TrainerConfig(**kw))
    for i, run in enumerate(runs):
        trainer.create_run(run, LoRAConfig(rank=rank, seed=i))
        randomize(trainer.adapter(run), 10 + i)  # non-zero B, so every parameter gets a gradient
    return trainer


def grads(trainer, run):
    return {n: p.grad.clone() for n, p in trainer.adapter(run).named_parameters()}


def weights(trainer, run):
    return {n: p.detach().clone() for n, p in trainer.adapter(run).named_parameters()}


def assert_loss_sum_adds_up(res) -> None:
    """loss_sum is the fp64 sum of the per-token losses before their fp32 report: within an fp32
    rounding of each (and fp64's order, far below) of the reported losses' exact sum."""
    flat = [x for row in res.losses for x in row]
    assert abs(res.loss_sum - math.fsum(flat)) <= EPS32 * math.fsum(map(abs, flat))


def outputs(res, trainer=None, run=None, prefix="") -> dict:
    """What a forward_backward result reports (logprobs, losses) and, given the trainer, the run's
    gradients: the groups `tolerance.assert_same_computation` compares. loss_sum is checked against
    the losses here, not as a group: one scalar is one sample of rounding, a poor error scale."""
    assert_loss_sum_adds_up(res)
    out = {f"{prefix}logprobs": res.logprobs, f"{prefix}losses": res.losses}
    if trainer is not None:
        out[f"{prefix}grads"] = grads(trainer, run)
    return out


def test_two_calls_then_step_equal_one_call_on_the_union(model, tiny_model64):
    """Two calls accumulate the gradient one call on the union computes: the same math, summed in
    another order (tolerance.py, kind 3). The step then moves each weight by what AdamW makes of its
    gradient; a first AdamW step is lr * g / (|g| + eps) per weight, nearly sign(g), so a weight
    whose gradient is within rounding of 0 may step either way: the weights are compared with that
    bound (kind 2), not as a group of kind 3."""
    data = random_data(3, lengths=(9, 14, 5, 12))
    adam = AdamConfig(learning_rate=1e-3, weight_decay=0.1)
    stepped = {}

    def compute(m):
        split, whole = new_trainer(m, "r"), new_trainer(m, "r")
        a = split.forward_backward([("r", Forward(data[:2], Loss.parse("cross_entropy")))])[0]
        b = split.forward_backward([("r", Forward(data[2:], Loss.parse("cross_entropy")))])[0]
        c = whole.forward_backward([("r", Forward(data, Loss.parse("cross_entropy")))])[0]
        for res in (a, b, c):
            assert_loss_sum_adds_up(res)
        got = {"logprobs": a.logprobs + b.logprobs, "losses": a.losses + b.losses, "grads": grads(split, "r")}
        want = {"logprobs": c.logprobs, "losses": c.losses, "grads": grads(whole, "r")}
        # the norm of the gradients is one more entry of their group (a scalar alone: one sample)
        got["grads"]["norm"] = torch.tensor(split.optim_step("r", adam)["grad_norm"])
        want["grads"]["norm"] = torch.tensor(whole.optim_step("r", adam)["grad_norm"])
        stepped[m.dtype] = got["grads"], want["grads"], weights(split, "r"), weights(whole, "r")
        return want, got

    assert_same_computation(compute, model, tiny_model64)
    g_split, g_whole, w_split, w_whole = stepped[torch.float32]
    lr, eps = adam.learning_rate, adam.eps
    for n in w_whole:
        step = lambda g: g.double() / (g.double().abs() + eps)  # the first step's direction
        # the gradients' difference moves the step by lr |s(a) - s(b)|; AdamW's dozen fp32 ops on
        # the step and the decay's rounding of each weight add gamma_16 lr and u |w| per side
        bound = lr * (step(g_split[n]) - step(g_whole[n])).abs() + 2 * (
            gamma(16) * lr + EPS32 / 2 * w_whole[n].abs()
        )
        assert_within_bound(w_split[n], w_whole[n], bound, n)


@pytest.mark.parametrize("clip", [0.0, 0.5])
def test_optim_step_equals_torch_adamw(model, clip):
    """torch's AdamW and norm (foreach, as the trainer runs them) on the same gradients: the same
    operations in the same order, so bit for bit (tolerance.py, kind 1)."""
    trainer = new_trainer(model, "r")
    params = dict(trainer.adapter("r").named_parameters())
    ref = {n: p.detach().clone().requires_grad_(True) for n, p in params.items()}
    opt = torch.optim.AdamW(
        list(ref.values()), lr=2e-3, betas=(0.8, 0.9), eps=1e-8, weight_decay=0.3, foreach=True
    )
    adam = AdamConfig(
        learning_rate=2e-3, beta1=0.8, beta2=0.9, eps=1e-8, weight_decay=0.3, grad_clip_norm=clip
    )
    for step in range(3):
        trainer.forward_backward(
            [("r", Forward(random_data(step, lengths=(8, 6)), Loss.parse("cross_entropy")))]
        )
        for n, p in params.items():
            ref[n].grad = p.grad.clone()
        if clip:
            norm = float(torch.nn.utils.clip_grad_norm_(list(ref.values()), clip, foreach=True))
        else:
            norm = float(torch.nn.utils.get_total_norm([p.grad for p in ref.values()], foreach=True))
        opt.step()
        opt.zero_grad()
        metrics = trainer.optim_step("r", adam)
        assert metrics == {"grad_norm": norm, "learning_rate": 2e-3}
        assert_bitwise({n: p.detach() for n, p in params.items()}, {n: p.detach() for n, p in ref.items()})
        assert all(float(p.grad.abs().max()) == 0.0 for p in params.values())  # zeroed after the step
    if clip:
        assert norm > clip  # clipping was really exercised


def test_runs_batched_together_get_the_gradients_each_gets_alone(model, tiny_model64):
    """Two runs in one batch: each run's results are its results alone, the rows batched in another
    order (tolerance.py, kind 3); a run no datum touched keeps exactly zero gradients."""
    data_a, data_b = random_data(4, lengths=(10, 6)), random_data(5, lengths=(13, 3, 8))

    def compute(m):
        mixed = new_trainer(m, "a", "b")
        ra, rb = mixed.forward_backward(
            [
                ("a", Forward(data_a, Loss.parse("cross_entropy"))),
                ("b", Forward(data_b, Loss.parse("importance_sampling"))),
            ]
        )
        alone = new_trainer(m, "a", "b")
        sa = alone.forward_backward([("a", Forward(data_a, Loss.parse("cross_entropy")))])[0]
        assert all(float(g.abs().max()) == 0.0 for g in grads(alone, "b").values())
        sb = alone.forward_backward([("b", Forward(data_b, Loss.parse("importance_sampling")))])[0]
        for x, y in ((ra, sa), (rb, sb)):
            assert x.token_count == y.token_count and x.usage == y.usage
        got = outputs(ra, mixed, "a", "a.") | outputs(rb, mixed, "b", "b.")
        return outputs(sa, alone, "a", "a.") | outputs(sb, alone, "b", "b."), got

    assert_same_computation(compute, model, tiny_model64)


def test_micro_batching_does_not_change_results(model, tiny_model64):
    """Micro-batches and LM-head chunks change only the order of the sums (tolerance.py, kind 3)."""
    data = random_data(6, lengths=(17, 3, 9, 9, 1, 12))

    def compute(m):
        big = new_trainer(m, "r")
        small = new_trainer(m, "r", micro_batch_tokens=20, logits_chunk_tokens=5)
        calls = []
        rb = big.forward_backward([("r", Forward(data, Loss.parse("ppo")))])[0]
        rs = small.forward_backward(
            [("r", Forward(data, Loss.parse("ppo")))], between_microbatches=lambda: calls.append(1)
        )[0]
        assert len(calls) == 4  # by length, padding counted: [17] [12] [9, 9] [3, 1 (padded to 3)]
        return outputs(rb, big, "r"), outputs(rs, small, "r")

    assert_same_computation(compute, model, tiny_model64)


def test_forward_changes_no_gradient_and_reports_what_forward_backward_does(model):
    data = random_data(7)
    trainer = new_trainer(model, "r")
    fwd = trainer.forward_backward([("r", Forward(data, Loss.parse("cross_entropy")))], backward=False)[0]
    assert all(float(g.abs().max()) == 0.0 for g in grads(trainer, "r").values())
    fb = trainer.forward_backward([("r", Forward(data, Loss.parse("cross_entropy")))])[0]
    assert fwd.loss_sum == fb.loss_sum  # the same forward, in the same order: bit for bit
    assert fwd.logprobs == fb.logprobs and fwd.usage == fb.usage


def test_outputs_metrics_and_usage(model):
    trainer = new_trainer(model, "r")
    d = TrainDatum(
        tokens=[5, 6, 7, 8, 9], target_tokens=[-100, -100, 7, 8, 9], weights=[1.0, 1.0, 0.0, 2.0, 1.0]
    )
    res = trainer.forward_backward([("r", Forward([d, d], Loss.parse("cross_entropy")))])[0]
    assert res.usage.sequence_tokens == 10 and res.usage.loss_tokens == 4 and res.token_count == 4
    assert res.usage.train_tokens == 5  # two identical datums: computed once (prefix sharing)
    for lp, loss in zip(res.logprobs, res.losses):
        assert len(lp) == len(loss) == 5
        assert lp[:2] == [0.0, 0.0] and loss[:3] == [0.0, 0.0, 0.0] and all(x < 0 for x in lp[2:])
        assert loss[3] == -2 * lp[3] and loss[4] == -lp[4]  # -weight * logp: exact for weights 2 and 1
    # loss_sum adds the fp32 per-token losses in fp64; Python adds the same four floats in fp64 too
    assert res.loss_sum == pytest.approx(sum(map(sum, res.losses)), rel=1e-12)
    assert res.loss_mean == pytest.approx(res.loss_sum / 4)


def test_data_without_targets_cost_compute_but_no_loss(model):
    trainer = new_trainer(model, "r")
    d = TrainDatum(tokens=[5, 6, 7], target_tokens=[-100, -100, -100])
    res = trainer.forward_backward([("r", Forward([d], Loss.parse("cross_entropy")))])[0]
    assert (res.loss_sum, res.token_count, res.usage.train_tokens, res.usage.loss_tokens) == (0.0, 0, 3, 0)
    assert res.logprobs == [[0.0, 0.0, 0.0]]
    assert all(float(g.abs().max()) == 0.0 for g in grads(trainer, "r").values())


@pytest.mark.parametrize(
    "entry,field",
    [
        (("nope", None, Loss.parse("cross_entropy")), "run_id"),
        (("r", None, "hinge"), "loss_fn"),
        (("r", [], Loss.parse("cross_entropy")), "data"),
        (
            ("r", [TrainDatum([1, 2], [2, 3], weights=[1.0, float("nan")])], Loss.parse("cross_entropy")),
            "weights",
        ),
        (("r", [TrainDatum([1, 2], [2, 10**6])], Loss.parse("cross_entropy")), "target_tokens"),
    ],
)
def test_bad_input_fails_before_any_gradient_changes(model, entry, field):
    trainer = new_trainer(model, "r")
    good = ("r", Forward(random_data(8, lengths=(6,)), Loss.parse("cross_entropy")))
    run, data, loss = entry
    with pytest.raises(ValueError, match=field):
        trainer.forward_backward([good, (run, Forward(good[1].data if data is None else data, loss))])
    assert all(float(g.abs().max()) == 0.0 for g in grads(trainer, "r").values())


def test_versions_snapshots_and_run_lifecycle(model):
    trainer = new_trainer(model, "r")
    v0 = trainer.weights_identity("r")
    assert (v0.base_model, v0.adapter) == ("tiny", "r")
    snap = trainer.snapshot("r")
    assert trainer.snapshot("r") is snap and not any(p.requires_grad for p in snap.parameters())
    before = {n: p.clone() for n, p in snap.named_parameters()}
    trainer.forward_backward([("r", Forward(random_data(9), Loss.parse("cross_entropy")))])
    assert trainer.weights_identity("r") == v0  # gradients alone change no weights
    trainer.optim_step("r", AdamConfig(learning_rate=1e-2))
    v1 = trainer.weights_identity("r")
    assert v1.version > v0.version
    assert_bitwise(dict(snap.named_parameters()), before)  # the snapshot never moves
    assert trainer.snapshot("r") is not snap
    # A deleted and re-created run never reuses an old version.
    trainer.delete_run("r")
    assert not trainer.has_run("r")
    with pytest.raises(ValueError, match="run_id"):
        trainer.weights_identity("r")
    trainer.create_run("r", LoRAConfig(rank=4))
    assert trainer.weights_identity("r").version > v1.version
    with pytest.raises(ValueError, match="already exists"):
        trainer.create_run("r", LoRAConfig(rank=4))


@pytest.mark.parametrize(
    "lora,field",
    [
        (LoRAConfig(rank=-1), "rank"),  # 0 is full fine-tuning (test_full_ft.py)
        (LoRAConfig(alpha=-1.0), "alpha"),
        (LoRAConfig(train_attn=False, train_mlp=False, train_unembed=False), "train_attn"),
    ],
)
def test_bad_lora_config(model, lora, field):
    with pytest.raises(ValueError, match=field):
        Trainer(model, base_model="tiny").create_run("r", lora)


@pytest.mark.parametrize(
    "adam,field",
    [
        (AdamConfig(learning_rate=-1.0), "learning_rate"),
        (AdamConfig(beta2=1.0), "beta2"),
        (AdamConfig(grad_clip_norm=float("nan")), "grad_clip_norm"),
    ],
)
def test_bad_adam_config(model, adam, field):
    trainer = new_trainer(model, "r")
    with pytest.raises(ValueError, match=field):
        trainer.optim_step("r", adam)


def test_lora_sft_learns_a_string(model, tiny_model_dir):
    # lr 1e-2 overshoots once the LM head is trained too (transformers + peft do the same here).
    tok = Tokenizer(tiny_model_dir)
    ids = tok.encode("The secret password is marmalade-42.")
    prompt_len = 3
    datum = TrainDatum(tokens=ids[:-1], target_tokens=[-100] * (prompt_len - 1) + ids[prompt_len:])
    trainer = Trainer(model, base_model="tiny")
    trainer.create_run("sft", LoRAConfig(rank=16))
    first = None
    for _ in range(30):
        res = trainer.forward_backward([("sft", Forward([datum] * 4, Loss.parse("cross_entropy")))])[0]
        first = first if first is not None else res.loss_mean
        trainer.optim_step("sft", AdamConfig(learning_rate=2e-3))
    assert res.loss_mean < first / 5
    seq = ids[:prompt_len]
    with torch.no_grad():
        adapters = AdapterBatch.single(trainer.snapshot("sft"))
        while len(seq) < len(ids):
            seq.append(int(model(torch.tensor([seq]), adapters=adapters)[0, -1].argmax()))
    assert tok.decode(seq) == tok.decode(ids)
