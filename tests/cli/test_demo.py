"""`trine demo` on a tiny model: it starts its own server, runs SFT and GRPO through the SDK and
prints usage by phase. Also the demo's reward and GRPO datum construction."""

from __future__ import annotations

import re
from types import SimpleNamespace

from click.testing import CliRunner

import trine as trio
from trine.cli.demo import grpo_datums, reward
from trine.cli.main import main


def test_demo_runs_end_to_end_and_prints_usage_by_phase(tiny_model_dir, tmp_path, monkeypatch):
    monkeypatch.setenv("TRINE_HOME", str(tmp_path / "home"))
    monkeypatch.setenv("COLUMNS", "80")
    result = CliRunner().invoke(
        main,
        [
            "demo",
            "--model",
            str(tiny_model_dir),
            "--sft-steps",
            "2",
            "--rl-steps",
            "1",
            "--home",
            str(tmp_path / "home"),
        ],
    )
    assert result.exit_code == 0, result.output + repr(result.exception)
    out = result.output
    assert "SFT loss" in out and "held-out question" in out and "GRPO" in out
    assert "Usage by phase" in out
    assert max(map(len, out.splitlines())) <= 80
    header = out.splitlines().index(
        next(line for line in out.splitlines() if line.strip().startswith("step  reward"))
    )
    step = out.splitlines()[header + 1].split()  # one GRPO step: one line, under its header
    assert step[0] == "1" and (step[-1].isdigit() or step[-1] == "update")
    for column in ("prefill computed", "prefill cached", "sample", "train computed", "train in loss"):
        assert all(word in out for word in column.split())  # headers wrap onto two lines at 80 columns
    total = next(line for line in out.splitlines() if "total" in line)
    numbers = [int(x.replace(",", "")) for x in total.split("│")[2:7]]
    prefill, cached, sampled, train, in_loss = numbers
    assert prefill > 0 and sampled > 0 and train > 0 and 0 < in_loss < train
    assert re.search(r"training: [\d,]+ tokens sent, [\d,]+ computed \(\d+% saved", out)
    assert "(USD)" in out and float(total.split("│")[7]) > 0  # priced by the server's rate card


def test_reward_checks_the_first_number():
    assert reward("17", 17) == 1.0
    assert reward("Repeat this number exactly: 17", 17) == 1.0
    assert reward("18, not 17", 17) == 0.0
    assert reward("seventeen", 17) == 0.0


def test_grpo_datums_use_group_relative_advantages_and_sampler_logprobs():
    prompt = [1, 2, 3]
    seqs = [
        SimpleNamespace(tokens=[4, 5], logprobs=[-0.5, -0.25]),
        SimpleNamespace(tokens=[6], logprobs=[-1.0]),
    ]
    data = grpo_datums(trio, prompt, seqs, [1.0, 0.0])
    assert [d.model_input.to_ints() for d in data] == [[1, 2, 3, 4], [1, 2, 3]]
    first = data[0].loss_fn_inputs
    assert first["target_tokens"].tolist() == [-100, -100, 4, 5]
    assert first["logprobs"].tolist() == [0.0, 0.0, -0.5, -0.25]
    assert first["advantages"].tolist() == [0.0, 0.0, 0.5, 0.5]
    assert data[1].loss_fn_inputs["advantages"].tolist() == [0.0, 0.0, -0.5]
    assert grpo_datums(trio, prompt, seqs, [1.0, 1.0]) == []  # no variance, no signal
