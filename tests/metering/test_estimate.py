"""The job estimate: its arithmetic, and its agreement with what the engine actually meters."""

from __future__ import annotations

import dataclasses
import random

import pytest

from trine.metering.estimate import JobShape, estimate
from trine.metering.rates import SHIPPED, RateCard
from trine.metering.report import PhaseTokens

CARD = RateCard.from_tomls([("shipped", SHIPPED.read_text())])


def test_shape_validation():
    for bad in (
        dict(steps=0),
        dict(group_size=-1),
        dict(prompt_tokens=0),
        dict(turns=1.5),
        dict(trained_fraction=1.5),
    ):
        with pytest.raises(ValueError, match=next(iter(bad))):
            JobShape(**bad)


def test_trained_fraction_scales_training_only():
    full = estimate(JobShape(steps=2, prompts_per_step=4, group_size=4), CARD).with_cache.tokens
    half = estimate(
        JobShape(steps=2, prompts_per_step=4, group_size=4, trained_fraction=0.5), CARD
    ).with_cache.tokens
    assert (half.train, half.train_loss) == (full.train // 2, full.train_loss // 2)
    assert (half.prefill, half.sample) == (full.prefill, full.sample)


def test_single_turn_group_prefills_once():
    s = JobShape(
        model="SmolLM2-135M-Instruct",
        steps=10,
        prompts_per_step=8,
        group_size=16,
        turns=1,
        prompt_tokens=200,
        completion_tokens=300,
        train_passes=1,
    )
    e = estimate(s, CARD)
    w, wo = e.with_cache.tokens, e.without_cache.tokens
    assert w.prompt == wo.prompt == 10 * 8 * 200  # one prefill per group, not per sample
    assert w.prefill_cached == 0  # nothing shared between different prompts
    assert w.sample == 10 * 8 * 16 * 300
    assert w.train_sequence == 10 * 8 * 16 * 499 and w.train_loss == 10 * 8 * 16 * 300
    # a group's 16 trajectories share their 200-token prompt: trained once per group
    assert w.train == 10 * 8 * 16 * 499 - 10 * 8 * 15 * 200
    no_sharing = estimate(dataclasses.replace(s, prefix_sharing=False), CARD).with_cache.tokens
    assert no_sharing.train == no_sharing.train_sequence == w.train_sequence
    assert e.dominant_phase in ("sample", "train")
    assert e.with_cache.requests == 80


def test_shared_system_prompt_is_cached_after_the_first_group():
    s = JobShape(
        steps=3,
        prompts_per_step=4,
        group_size=2,
        prompt_tokens=20,
        completion_tokens=5,
        system_tokens=100,
        train_passes=1,
    )
    w = estimate(s, CARD).with_cache.tokens
    assert w.prefill_cached == 3 * 3 * 100  # the system prompt, for groups 2..4 of each step
    warm = estimate(JobShape(**{**s.__dict__, "train_passes": 0}), CARD).with_cache.tokens
    assert warm.prefill_cached == (3 * 4 - 1) * 100  # no training: weights never change, the cache stays warm


def test_multi_turn_prefill_dominates_without_cache():
    s = JobShape(
        steps=1,
        prompts_per_step=4,
        group_size=4,
        turns=10,
        prompt_tokens=200,
        completion_tokens=100,
        system_tokens=500,
    )
    e = estimate(s, CARD)
    assert e.without_cache.dominant_phase == "prefill"
    assert e.with_cache.tokens.prompt == e.without_cache.tokens.prompt
    assert e.with_cache.tokens.cache_hit_rate > 0.8
    assert e.cache_savings > 0.3
    # turn 1: the first group computes its whole prompt, the others all but the system prompt;
    # a later turn computes its new tokens plus the previous turn's last sampled token (its partial
    # block is cached too)
    first_turn = 700 + 3 * (700 - 500)
    per_turn = (e.with_cache.tokens.prefill - first_turn) / (4 * 4 * 9)
    assert per_turn == 200 + 1
    d = e.to_dict()
    assert (
        d["dominant_phase"] == e.dominant_phase
        and d["with_cache"]["tokens"]["prompt"] == e.with_cache.tokens.prompt
    )


@pytest.fixture(scope="module")
def engine(tiny_model_dir):
    from trine.engine.model.tokenizer import Tokenizer
    from trine.engine.model.weights import load_model
    from trine.engine.sampler.sampler import Sampler
    from trine.engine.trainer.trainer import Trainer

    model = load_model(tiny_model_dir, device="cpu")
    return Sampler(model, Tokenizer(tiny_model_dir)), Trainer(model, base_model="tiny")


def test_estimate_matches_metered_multi_turn_rl(engine):
    """A multi-turn RL loop on the real engine (sampler + trainer), metered, vs the estimate of its shape."""
    from trine.engine.api import (
        AdamConfig,
        Forward,
        LoRAConfig,
        Loss,
        SampleRequest,
        SamplingOptions,
        TrainDatum,
    )

    sampler, trainer = engine
    shape = JobShape(
        model="SmolLM2-135M-Instruct",
        steps=2,
        prompts_per_step=3,
        group_size=4,
        turns=3,
        prompt_tokens=12,
        completion_tokens=10,
        system_tokens=40,
        train_passes=1,
    )
    rng = random.Random(0)
    words = lambda n: [rng.randrange(3, 40000) for _ in range(n)]  # noqa: E731
    system = words(shape.system_tokens)
    trainer.create_run("est", LoRAConfig(rank=4))
    opts = SamplingOptions(max_tokens=shape.completion_tokens, seed=1, stop_at_eos=False)
    measured = dict(prefill=0, prefill_cached=0, sample=0, train=0, train_loss=0)
    n_requests = 0

    def sample(prompts, num_samples):
        nonlocal n_requests
        w = trainer.weights_identity("est")
        reqs = [
            (SampleRequest(f"r{n_requests + i}", p, opts, w, num_samples=num_samples), trainer.adapter("est"))
            for i, p in enumerate(prompts)
        ]
        n_requests += len(reqs)
        out = sampler.run(reqs)
        for r in out:
            assert r.usage.prompt_tokens == r.usage.prefill_tokens + r.usage.cached_tokens
            measured["prefill"] += r.usage.prefill_tokens
            measured["prefill_cached"] += r.usage.cached_tokens
            measured["sample"] += r.usage.sample_tokens
        return out

    for _ in range(shape.steps):
        firsts = [system + words(shape.prompt_tokens) for _ in range(shape.prompts_per_step)]
        trajs, masks = [], []  # token lists and completion masks, one per sample
        for p, res in zip(firsts, sample(firsts, shape.group_size)):
            for seq in res.sequences:
                trajs.append(p + seq.tokens)
                masks.append([0] * len(p) + [1] * len(seq.tokens))
        for _turn in range(1, shape.turns):
            new = [words(shape.prompt_tokens) for _ in trajs]
            prompts = [t + n for t, n in zip(trajs, new)]
            for i, (p, res) in enumerate(zip(prompts, sample(prompts, 1))):
                masks[i] = masks[i] + [0] * len(new[i]) + [1] * len(res.sequences[0].tokens)
                trajs[i] = p + res.sequences[0].tokens
        data = [
            TrainDatum(tokens=t[:-1], target_tokens=t[1:], weights=[float(m) for m in mask[1:]])
            for t, mask in zip(trajs, masks)
        ]
        (res,) = trainer.forward_backward([("est", Forward(data, Loss.parse("cross_entropy")))])
        measured["train"] += res.usage.train_tokens
        measured["train_loss"] += res.usage.loss_tokens
        trainer.optim_step("est", AdamConfig(learning_rate=1e-3))

    est = estimate(shape, CARD)
    predicted = est.with_cache.tokens.to_dict()
    # a product contract, not rounding: the estimator models token counts (block-granular cache
    # hits, mean lengths) and promises them within 10 % of what the engine meters
    for phase, value in measured.items():
        assert predicted[phase] == pytest.approx(value, rel=0.10), phase
    assert est.with_cache.requests == n_requests
    cost = CARD.cost(PhaseTokens(**measured), shape.model)["total"]
    assert est.with_cache.cost["total"] == pytest.approx(cost, rel=0.10)


@pytest.mark.slow
def test_estimate_matches_the_demo_grpo_loop(tmp_path):
    """`trine demo`'s GRPO stage (real SmolLM2 weights, through a real server and the SDK) vs the estimate.

    The shape is the demo's (4 steps x 4 prompts x group 4, one turn); the measured inputs a user would
    read off a first run are the mean prompt and completion lengths and the share of trajectories trained
    on (the demo skips groups with equal rewards, and every trained completion token carries an advantage).
    """
    import io

    from rich.console import Console
    from serverutil import serve
    from transformers import AutoTokenizer

    import trine as trio
    from trine.cli.demo import RL_PROMPT, chat_prompt, run_job
    from trine.engine.model.default_model import ensure_default_model

    model_dir = ensure_default_model()
    steps, prompts, group = 4, 4, 4
    with (
        serve(model_dir, tmp_path / "home") as srv,
        trio.ServiceClient(api_key=srv.api_key, base_url=srv.url) as sc,
    ):
        stages = dict(
            run_job(
                sc,
                model_dir.name,
                sft_steps=0,
                rl_steps=steps,
                console=Console(file=io.StringIO()),
                group_size=group,
                prompts_per_step=prompts,
            )
        )
    u = stages["GRPO"]
    tok = AutoTokenizer.from_pretrained(model_dir)
    a, b = (chat_prompt(tok, RL_PROMPT.format(n=n)) for n in (11, 22))
    system = next(i for i, (x, y) in enumerate(zip(a, b)) if x != y)  # the head every RL prompt shares
    mean_prompt = (u.prefill_tokens + u.cached_tokens) / (steps * prompts)
    mean_completion = u.sample_tokens / (steps * prompts * group)
    shape = JobShape(
        model=model_dir.name,
        steps=steps,
        prompts_per_step=prompts,
        group_size=group,
        prompt_tokens=round(mean_prompt) - system,
        completion_tokens=round(mean_completion),
        system_tokens=system,
        trained_fraction=u.loss_tokens / u.sample_tokens,
    )
    predicted = estimate(shape, CARD).with_cache.tokens
    measured = dict(
        prefill=u.prefill_tokens, prefill_cached=u.cached_tokens, sample=u.sample_tokens, train=u.train_tokens
    )
    for phase, value in measured.items():  # the estimator's 10 % promise (above), and 8 tokens of rounding
        assert getattr(predicted, phase) == pytest.approx(value, rel=0.10, abs=8), (
            phase,
            measured,
            predicted,
        )


def test_an_unknown_model_is_an_error_not_the_default_row(tmp_path):
    import json

    from click.testing import CliRunner

    from trine.cli.main import main

    r = CliRunner().invoke(main, ["estimate", "--model", "Llama-9-900B", "--home", str(tmp_path)])
    assert r.exit_code == 1 and "not on the rate card" in r.output and "rates.toml" in r.output
    assert "SmolLM2-135M-Instruct" in r.output  # names the models it does know
    ok = CliRunner().invoke(main, ["estimate", "--model", "qwen3-8b", "--home", str(tmp_path), "--json"])
    assert ok.exit_code == 0 and json.loads(ok.stdout)["wall_clock"] is None  # matched case-insensitively
    assert (
        CliRunner().invoke(main, ["estimate", "--model", "default", "--home", str(tmp_path)]).exit_code == 0
    )


def test_wall_clock_adds_phases_from_measured_throughput():
    from trine.metering.wallclock import Throughput, predict

    shape = JobShape(
        model="SmolLM2-135M-Instruct",
        steps=3,
        prompts_per_step=2,
        group_size=4,
        turns=2,
        prompt_tokens=50,
        completion_tokens=10,
    )
    tokens = estimate(shape, CARD).with_cache.tokens
    tp = Throughput(
        "SmolLM2-135M-Instruct",
        batch=8,
        prefill_tokens_per_s=1000.0,
        decode_step_s=0.05,
        train_tokens_per_s=200.0,
        optim_step_s=0.5,
        threads=2,
        device="cpu",
        measured_at=0.0,
    )
    s = predict(shape, tokens, tp).seconds
    # the same few correctly rounded fp64 operations, perhaps in another order: rel 1e-12 is 1e3
    # times their rounding (~1e-16 each) and far below a wrong term
    assert s["prefill"] == pytest.approx(tokens.prefill / 1000, rel=1e-12, abs=0)
    assert s["sample"] == pytest.approx(
        3 * 2 * 10 * 0.05, rel=1e-12, abs=0
    )  # steps x turns x completion tokens, batched
    assert s["train"] == pytest.approx(tokens.train / 200 + 3 * 0.5, rel=1e-12, abs=0)
    assert s["total"] == pytest.approx(s["prefill"] + s["sample"] + s["train"], rel=1e-12, abs=0)


def test_estimate_measures_this_machine_once_and_reads_it_back(tiny_model_dir, tmp_path):
    import json

    from click.testing import CliRunner

    from trine.cli.main import main

    args = [
        "estimate",
        "--model",
        "default",
        "--home",
        str(tmp_path),
        "--steps",
        "2",
        "--prompts-per-step",
        "2",
        "--group-size",
        "2",
        "--prompt-tokens",
        "24",
        "--completion-tokens",
        "4",
        "--json",
    ]
    r = CliRunner().invoke(main, [*args, "--measure", "--model-dir", str(tiny_model_dir), "--threads", "1"])
    assert r.exit_code == 0, r.output
    measured = json.loads(r.stdout)["wall_clock"]
    tp = measured["throughput"]
    assert tp["batch"] == 4 and tp["threads"] == 1 and tp["device"] == "cpu"
    assert tp["prefill_tokens_per_s"] > 0 and tp["decode_step_s"] > 0 and tp["train_tokens_per_s"] > 0
    assert measured["seconds"]["total"] > 0 and (tmp_path / "throughput.json").is_file()
    again = CliRunner().invoke(main, args)  # no --measure: the stored measurement
    assert json.loads(again.stdout)["wall_clock"] == measured
    table = CliRunner().invoke(main, args[:-1]).stdout
    assert "wall clock on this machine: about" in table and "measured on this machine" in table
