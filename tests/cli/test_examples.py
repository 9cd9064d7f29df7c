"""The examples/ recipes. Default suite: each runs end to end through a real server on the tiny
model (a smoke test of the SDK calls it makes). Slow tier: each runs as a user runs it, on
SmolLM2-135M-Instruct, and shows the effect it is about."""

from __future__ import annotations

import importlib
import re
import sys
from pathlib import Path

import pytest

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


def example(name: str):
    if str(EXAMPLES) not in sys.path:
        sys.path.insert(0, str(EXAMPLES))
    return importlib.import_module(name)


@pytest.fixture(scope="module")
def tiny_server(tiny_model_dir, tmp_path_factory):
    from serverutil import serve

    with serve(tiny_model_dir, tmp_path_factory.mktemp("home")) as srv:
        yield srv


def test_every_example_runs_through_the_sdk(tiny_server, capsys):
    common = ["--url", tiny_server.url, "--api-key", tiny_server.api_key, "--model", "tiny-llama"]
    out = example("sft_chat").main(common + ["--steps", "1", "--batch", "2"])
    assert out["held_out_before"] > 0 and out["held_out_after"] > 0
    out = example("grpo_arithmetic").main(common + ["--steps", "1", "--prompts", "1", "--group", "2"])
    assert len(out["reward_curve"]) == 1 and 0 <= out["reward_curve"][0] <= 1
    out = example("dpo").main(common + ["--steps", "1", "--batch", "1", "--pairs", "2"])
    assert 0 <= out["accuracy_after"] <= 1
    out = example("multi_turn_agent").main(common + ["--conversations", "1", "--turns", "2"])
    assert out["append"]["prompt_tokens"] > 0 and out["retokenize"]["prompt_tokens"] > 0
    out = example("distill").main(
        common + ["--steps", "1", "--teacher-steps", "1", "--prompts", "1", "--group", "2"]
    )
    assert len(out["reverse_kl_curve"]) == 1
    printed = capsys.readouterr().out
    assert printed.count("Usage by phase") == 5  # each prints its usage by phase
    # each step's line says how long it took, the throughput and the time left
    timed = re.findall(
        r"\[(\d+\.\d) s/(step|conversation), ([\d,]+) tok/s, ETA (\d+ s|\d+ min \d\d s)\]", printed
    )
    assert len([t for t in timed if t[1] == "step"]) >= 5, (
        printed
    )  # sft, grpo, dpo, distill (teacher + student)
    assert len([t for t in timed if t[1] == "conversation"]) == 2  # the agent: one line per conversation
    assert any(int(t[2].replace(",", "")) > 0 for t in timed)


def test_vision_grpo_runs_on_the_tiny_vision_model(tiny_vl_dir, tmp_path, capsys):
    """The image example on an embedded server of the tiny random qwen3_5 checkpoint (its --model):
    pictures drawn and sampled in groups. Its datums (a picture, a reply, advantages; the image's
    token count left to the SDK) train through the SDK: a random model rarely earns a reward, so the
    run above may have had nothing to train on."""
    vg = example("vision_grpo")
    out = vg.main(
        ["--model", str(tiny_vl_dir), "--home", str(tmp_path), "--steps", "2", "--prompts", "2"]
        + ["--group", "3", "--size", "96", "--dtype", "float32"]
    )
    assert len(out["reward_curve"]) == 2 and all(0 <= r <= 1 for r in out["reward_curve"])
    printed = capsys.readouterr().out
    assert "Usage by phase" in printed and printed.count("step ") >= 2

    import random

    import trine as trio

    args = vg.parser(vg.__doc__, steps=1).parse_args(["--model", str(tiny_vl_dir), "--home", str(tmp_path)])
    with example("common").connect(args) as conn:
        trainer = conn.service.create_lora_training_client(base_model=conn.model, rank=4)
        png, _ = vg.draw(random.Random(0), 96)
        prompt = vg.image_prompt(trainer.get_tokenizer(), png)
        sampler = trainer.save_weights_and_get_sampling_client()
        res = sampler.sample(prompt, 2, trio.SamplingParams(max_tokens=3)).result()
        assert res.input_tokens == len(prompt.chunks[0]) + 9 + len(prompt.chunks[2])  # 96 px: 3 x 3 tokens
        logprobs = sampler.compute_logprobs(prompt).result()
        image_at = range(len(prompt.chunks[0]), len(prompt.chunks[0]) + 9)
        assert [i for i, x in enumerate(logprobs) if x is None] == [0, *image_at]
        data = [
            vg.policy_datum(prompt, res.input_tokens, s.tokens, s.logprobs, a)
            for s, a in zip(res.sequences, (1.0, 0.5))
        ]
        fb = trainer.forward_backward(data, "importance_sampling").result()
        assert fb.metrics["token_count"] == sum(len(s.tokens) for s in res.sequences)  # the replies'
        assert fb.metrics["loss_sum"] != 0


def test_vision_grpo_needs_a_vision_model(capsys):
    with pytest.raises(SystemExit):
        example("vision_grpo").main([])
    assert "--model: name a vision-language model" in capsys.readouterr().err


EXAMPLE_NAMES = ("sft_chat", "grpo_arithmetic", "dpo", "multi_turn_agent", "distill", "vision_grpo")


@pytest.mark.parametrize("name", EXAMPLE_NAMES)
def test_example_help_is_sentences_with_defaults(name, capsys):
    with pytest.raises(SystemExit) as e:
        example(name).main(["--help"])
    assert e.value.code == 0
    text = capsys.readouterr().out
    description = text.split("\n\n")[1]
    assert description.rstrip().endswith("."), description
    options = re.split(r"\n  (?=-)", text.split("options:\n", 1)[1])
    for opt in options:
        flag, _, help_text = opt.strip().partition("  ")
        if flag.startswith("-h"):
            continue
        sentence = " ".join(help_text.split())
        assert sentence[:1].isupper(), (flag, sentence)
        assert re.fullmatch(r".+\.( \(default: [^)]+\))?", sentence), (flag, sentence)
        if flag.startswith(("--steps", "--seed", "--lr")):
            assert "(default: " in sentence, (flag, sentence)


@pytest.fixture(scope="module")
def smollm2(tmp_path_factory):
    from trine.engine.model.default_model import ensure_default_model

    return ["--model", str(ensure_default_model()), "--home", str(tmp_path_factory.mktemp("home"))]


@pytest.mark.slow
def test_sft_chat_lowers_the_held_out_loss(smollm2):
    out = example("sft_chat").main(smollm2)
    assert out["held_out_after"] < 0.8 * out["held_out_before"]


@pytest.mark.slow
def test_grpo_arithmetic_reports_a_reward_curve(smollm2):
    out = example("grpo_arithmetic").main(smollm2)
    curve = out["reward_curve"]
    assert len(curve) == 10 and max(curve) > 0  # the task is within the model's reach: there is signal


@pytest.mark.slow
def test_dpo_learns_the_held_out_preferences(smollm2):
    out = example("dpo").main(smollm2)
    assert out["margin_after"] > out["margin_before"] and out["accuracy_after"] >= out["accuracy_before"]


@pytest.mark.slow
def test_multi_turn_appending_hits_the_cache_and_retokenizing_is_diagnosed(smollm2):
    out = example("multi_turn_agent").main(smollm2)
    assert out["append"]["diagnostics"] == [] and out["append"]["hit_rate"] > 0.6
    # each turn whose re-rendered history leaves the sampled tokens is named by the diagnostic
    retok = out["retokenize"]
    assert retok["diverged_turns"] > 0  # seeded: on SmolLM2 this run has several
    assert retok["diagnosed_requests"] == retok["diverged_turns"]


@pytest.mark.slow
def test_distill_lowers_the_reverse_kl(smollm2):
    curve = example("distill").main(smollm2)["reverse_kl_curve"]
    assert sum(curve[-3:]) / 3 < sum(curve[:3]) / 3
