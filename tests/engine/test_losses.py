"""Losses: each equals a plain reference in value and gradient, and bad input fails before compute."""

from __future__ import annotations

import math

import pytest
import torch
from tolerance import EPS32, assert_same_computation

from trine.engine.api import Forward, LoRAConfig, Loss, TrainDatum
from trine.engine.config import TrainerConfig
from trine.engine.model.lora import AdapterBatch
from trine.engine.model.weights import load_model
from trine.engine.prepare import check_datum as prepare_datum
from trine.engine.trainer.trainer import Trainer

VOCAB = 49152


@pytest.fixture(scope="module")
def model(tiny_model_dir):
    return load_model(tiny_model_dir, "cpu")


def reference_token_losses(name: str, logp, q, adv, w, cfg, seq_mask=None):
    """Textbook formulas, written independently of trine.engine.trainer.losses (one datum at a time)."""
    if name == "cross_entropy":
        return -w * logp
    ratio = (logp - q).exp()
    lo, hi = cfg.get("clip_low_threshold", 0.8), cfg.get("clip_high_threshold", 1.2)
    if name == "gspo":  # GSPO-token: s_t = sg(s) * p_t / sg(p_t), s = exp(mean log-ratio over the mask)
        s = torch.exp(((logp - q) * seq_mask).sum() / seq_mask.sum()).detach()
        s_t = s * logp.exp() / logp.exp().detach()
        return torch.max(-adv * s_t, -adv * torch.clamp(s_t, lo, hi))
    if name == "stable_reinforce":  # truncated, detached IS weight; k3 KL(pi || sampler)
        w_is = torch.clamp(ratio, max=cfg.get("clip_high_threshold", 2.0)).detach()
        k3 = (q - logp).exp() - (q - logp) - 1
        return -w_is * adv * logp + cfg.get("kl_coeff", 0.0) * k3
    if name == "importance_sampling":
        return -ratio * adv
    if name == "ppo":
        return torch.max(-adv * ratio, -adv * torch.clamp(ratio, lo, hi))
    if name == "cispo":
        return -torch.clamp(ratio, lo, hi).detach() * adv * logp
    beta = cfg.get("beta", 0.05)
    return -(adv * logp) + 0.5 * beta * (logp - q) ** 2


def random_data(seed: int, lengths=(11, 7, 16)) -> list[TrainDatum]:
    g = torch.Generator().manual_seed(seed)
    data = []
    for n in lengths:
        tokens = torch.randint(0, VOCAB, (n,), generator=g).tolist()
        targets = torch.randint(0, VOCAB, (n,), generator=g)
        targets[: n // 3] = -100  # a prompt that does not count
        data.append(
            TrainDatum(
                tokens=tokens,
                target_tokens=targets.tolist(),
                weights=(torch.randn(n, generator=g)).tolist(),  # negative weights included
                logprobs=(-torch.rand(n, generator=g) * 12 - 9).tolist(),  # near the random model's logp
                advantages=torch.randn(n, generator=g).tolist(),
            )
        )
    return data


def randomize(adapter, seed: int, std: float = 0.05) -> None:
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in adapter.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * std)


CASES = [
    ("cross_entropy", {}),
    ("importance_sampling", {}),
    ("ppo", {}),
    ("ppo", {"clip_low_threshold": 0.95, "clip_high_threshold": 1.01}),
    ("cispo", {}),
    ("cispo", {"clip_low_threshold": 0.9, "clip_high_threshold": 1.05}),
    ("dro", {}),
    ("dro", {"beta": 0.5}),
    ("gspo", {}),
    ("gspo", {"clip_low_threshold": 0.97, "clip_high_threshold": 1.02}),
    ("stable_reinforce", {}),
    ("stable_reinforce", {"clip_high_threshold": 1.05, "kl_coeff": 0.3}),
]


@pytest.mark.parametrize("unembed", [True, False], ids=["head-adapter", "plain-head"])
@pytest.mark.parametrize("name,cfg", CASES)
def test_loss_matches_reference_in_value_and_gradient(model, tiny_model64, name, cfg, unembed):
    """The trainer's logprobs, per-token losses and gradients against a full forward and textbook
    formulas, one datum at a time: the same math in another order (tolerance.py, kind 3)."""
    data = random_data(1)

    def new_trainer(m):
        # Without an adapter on lm_head the trainer computes the head's logits and input gradient
        # into its kept workspace, outside autograd; with one, through autograd. Both must match.
        trainer = Trainer(
            m, base_model="tiny", config=TrainerConfig(logits_chunk_tokens=7)
        )  # several LM-head chunks
        trainer.create_run("r", LoRAConfig(rank=4, train_unembed=unembed))
        randomize(trainer.adapter("r"), 0)
        return trainer

    # Old logprobs close to the current ones, so that PPO/CISPO clipping is active on some tokens;
    # made once (fp32), so both dtypes clip the same tokens.
    fwd = new_trainer(model).forward_backward([("r", Forward(data, Loss.parse(name, cfg)))], backward=False)[
        0
    ]
    g = torch.Generator().manual_seed(2)
    for k, (d, lp) in enumerate(zip(data, fwd.logprobs)):
        d.logprobs = [x + 0.1 * float(torch.randn(1, generator=g)) for x in lp]
        if name == "gspo" and k == 1:  # an explicit mask on one datum; the others use the default
            d.sequence_ratio_mask = [float(i % 2) for i in range(len(d.tokens))]

    def compute(m):
        trainer = new_trainer(m)
        adapter = trainer.adapter("r")
        out = trainer.forward_backward([("r", Forward(data, Loss.parse(name, cfg)))])[0]
        got = {
            "grads": {n: p.grad.clone() for n, p in adapter.named_parameters()},
            "logprobs": [torch.tensor(x, dtype=torch.float32) for x in out.logprobs],  # reported in fp32
            "losses": [torch.tensor(x, dtype=torch.float32) for x in out.losses],
        }
        want = {
            "grads": {n: torch.zeros_like(p) for n, p in adapter.named_parameters()},
            "logprobs": [],
            "losses": [],
        }
        total = 0.0
        for d in data:
            adapter.zero_grad()
            tokens = torch.tensor([d.tokens])
            logits = m(tokens, adapters=AdapterBatch.single(adapter))[0]
            tgt = torch.tensor(d.target_tokens)
            mask = tgt != -100
            logp = torch.log_softmax(logits, -1).gather(1, tgt.clamp(min=0)[:, None]).squeeze(1)
            seq_mask = (
                torch.tensor(d.sequence_ratio_mask)
                if d.sequence_ratio_mask is not None
                else torch.ones(len(tgt))
            ) * mask
            per_tok = (
                reference_token_losses(
                    name,
                    logp,
                    torch.tensor(d.logprobs),
                    torch.tensor(d.advantages),
                    torch.tensor(d.weights),
                    cfg,
                    seq_mask,
                )
                * mask
            )
            per_tok.sum().backward()
            for n, p in adapter.named_parameters():
                want["grads"][n] += p.grad
            want["logprobs"].append((logp * mask).detach())
            want["losses"].append(per_tok.detach())
            total += float(per_tok.detach().double().sum())
        # loss_sum adds the per-token losses in fp64: the reference's sum is another order of it
        flat = [x for row in out.losses for x in row]
        assert abs(out.loss_sum - math.fsum(flat)) <= EPS32 * math.fsum(map(abs, flat))
        return want, got

    # a policy loss is exp(logp - q) times a factor (or linear in logp): it rounds as its logprobs do
    assert_same_computation(compute, model, tiny_model64, ratio_of={"losses": "logprobs"})


def test_ppo_reads_thresholds_as_ratio_bounds():
    loss = Loss.parse("ppo", {"clip_low_threshold": 0.9, "clip_high_threshold": 1.1})
    logp = torch.log(torch.tensor([1.5, 0.5, 1.05]))  # ratios 1.5, 0.5, 1.05 against q = 0
    from trine.engine.trainer.losses import LossInputs

    inputs = LossInputs(torch.ones(3), torch.zeros(3), torch.tensor([1.0, -1.0, 1.0]))
    # A>0, r=1.5: min(1.5, 1.1) = 1.1; A<0, r=0.5: min(-0.5, -0.9) = -0.9; inside the bounds: r*A.
    from trine.engine.trainer.losses import loss_values

    # exp(log r) and a product: a few fp32 roundings of each value, within assert_close's fp32 rtol
    torch.testing.assert_close(loss_values(loss, logp, inputs), torch.tensor([-1.1, 0.9, -1.05]))
    assert Loss.parse("ppo") == Loss("ppo", clip_low=0.8, clip_high=1.2)


@pytest.mark.parametrize(
    "name,cfg,field",
    [
        ("mse", {}, "loss_fn"),
        ("ppo", {"clip_high_threshold": 0.2}, "clip_high_threshold"),
        ("ppo", {"clip_low_threshold": 1.5}, "clip_low_threshold"),
        ("ppo", {"epsilon": 0.2}, "epsilon"),
        ("cross_entropy", {"beta": 0.1}, "beta"),
        ("dro", {"beta": float("nan")}, "beta"),
    ],
)
def test_bad_loss_config_names_the_field(name, cfg, field):
    with pytest.raises(ValueError, match=field):
        Loss.parse(name, cfg)


def test_loss_names_are_case_insensitive():
    assert Loss.parse("PPO").name == "ppo"


@pytest.mark.parametrize(
    "datum,loss,field",
    [
        (TrainDatum([1, 2], [2, 3, 4]), "cross_entropy", "target_tokens"),
        (TrainDatum([1, VOCAB], [2, 3]), "cross_entropy", "tokens"),
        (TrainDatum([1, -1], [2, 3]), "cross_entropy", "tokens"),
        (TrainDatum([1, 2], [2, VOCAB]), "cross_entropy", "target_tokens"),
        (TrainDatum([1, 2], [2, -5]), "cross_entropy", "target_tokens"),
        (TrainDatum([], []), "cross_entropy", "tokens"),
        (TrainDatum([1.5, 2], [2, 3]), "cross_entropy", "tokens"),
        (TrainDatum([1, 2], [2, 3], weights=[1.0]), "cross_entropy", "weights"),
        (TrainDatum([1, 2], [2, 3], weights=[1.0, math.nan]), "cross_entropy", "weights"),
        (TrainDatum([1, 2], [2, 3], advantages=[1.0, 1.0]), "ppo", "logprobs"),
        (TrainDatum([1, 2], [2, 3], logprobs=[-1.0, -1.0]), "importance_sampling", "advantages"),
        (TrainDatum([1, 2], [2, 3], logprobs=[-1.0, math.inf], advantages=[1.0, 1.0]), "dro", "logprobs"),
        (TrainDatum([1, 2], [2, 3], logprobs=[-1.0, -1.0], advantages=[1.0]), "cispo", "advantages"),
    ],
)
def test_bad_datum_names_the_field(datum, loss, field):
    with pytest.raises(ValueError, match=field):
        prepare_datum(datum, Loss.parse(loss), VOCAB)


def test_token_counts():
    d = TrainDatum(
        [1, 2, 3, 4],
        [-100, 5, 6, 7],
        weights=[1.0, 0.0, 2.0, -1.0],
        logprobs=[0.0] * 4,
        advantages=[1.0, 0.0, 0.0, 3.0],
    )
    ce = prepare_datum(d, Loss.parse("cross_entropy"), VOCAB)
    assert (ce.active_tokens, ce.loss_tokens(policy=False)) == (2, 2)  # target set and weight != 0
    pg = prepare_datum(d, Loss.parse("importance_sampling"), VOCAB)
    assert (pg.active_tokens, pg.loss_tokens(policy=True)) == (
        3,
        1,
    )  # target set; loss tokens also need A != 0
