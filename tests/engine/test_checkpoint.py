"""Checkpoints: PEFT-compatible sampler adapters, exact training resumption, atomic writes."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch
from test_losses import random_data, randomize
from tolerance import Rounding, fp64_adapter, fp64_model

from trine.engine.api import AdamConfig, Forward, LoRAConfig, Loss
from trine.engine.model.lora import AdapterBatch
from trine.engine.model.weights import load_model
from trine.engine.trainer.checkpoint import atomic_write, load_peft_adapter, save_peft_adapter
from trine.engine.trainer.trainer import Trainer, checkpoint


@pytest.fixture(scope="module")
def model(tiny_model_dir):
    return load_model(tiny_model_dir, "cpu")


def hf_model(path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


def assert_like_trines(theirs, ours, model_dir, adapter, tokens):
    """Kind 3, against fp64: trine's fp32 logits with `adapter` are the reference, PEFT's the path
    (the same LoRA math in its own order). PEFT on transformers cannot run it in fp64 (it normalises
    and rotates in fp32 in any dtype), so the fp64 value is trine's fp64 model with the adapter."""
    model64 = fp64_model(model_dir)
    with torch.no_grad():
        ours64 = model64(tokens, adapters=AdapterBatch.single(fp64_adapter(adapter, model64)))
    Rounding(ours, ours64).assert_within(theirs)


def test_sampler_adapter_loads_into_peft_with_the_same_logits(model, tiny_model_dir, tmp_path):
    from peft import PeftModel

    trainer = Trainer(model, base_model="tiny-llama")
    trainer.create_run("r", LoRAConfig(rank=8, alpha=16.0))  # attn + mlp + lm_head (tied embeddings)
    randomize(trainer.adapter("r"), 0)
    size = trainer.save_weights("r", tmp_path / "ckpt")
    assert size == sum(f.stat().st_size for f in (tmp_path / "ckpt").iterdir())
    cfg = json.loads((tmp_path / "ckpt" / "adapter_config.json").read_text())
    assert cfg["r"] == 8 and cfg["lora_alpha"] == 16.0 and "trine_base_model" not in cfg
    facts = json.loads((tmp_path / "ckpt" / "trine_checkpoint.json").read_text())
    assert facts["base_model"] == "tiny-llama"
    assert cfg["base_model_name_or_path"] == str(Path(tiny_model_dir).resolve())  # loads with no hub
    from safetensors.torch import load_file

    keys = load_file(str(tmp_path / "ckpt" / "adapter_model.safetensors"))
    assert "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight" in keys
    assert "base_model.model.lm_head.lora_B.weight" in keys

    peft_model = PeftModel.from_pretrained(hf_model(tiny_model_dir), str(tmp_path / "ckpt")).eval()
    from peft import AutoPeftModelForCausalLM  # the adapter alone names its base model's directory

    auto_model = AutoPeftModelForCausalLM.from_pretrained(str(tmp_path / "ckpt"), dtype=torch.float32).eval()
    tokens = torch.tensor([[5, 900, 17, 4000, 23, 8, 49000, 3]])
    with torch.no_grad():
        want = peft_model(tokens).logits
        # kind 1: the same adapter on the same base, loaded two ways: the same computation
        assert (auto_model(tokens).logits - want).abs().max() == 0
        got = model(tokens, adapters=AdapterBatch.single(trainer.adapter("r")))
        base = model(tokens)
    assert (got - base).abs().max() > 1e-2  # the adapter matters
    assert_like_trines(want, got, tiny_model_dir, trainer.adapter("r"), tokens)


def saved_by_peft(hf, targets: list[str], path):
    """An adapter trained elsewhere (random rank-4 LoRA weights on `targets` of transformers' model
    `hf`), saved at `path` by peft itself; returns the peft model."""
    from peft import LoraConfig, get_peft_model

    peft_model = get_peft_model(hf, LoraConfig(r=4, lora_alpha=8, target_modules=targets))
    with torch.no_grad():
        for n, p in peft_model.named_parameters():
            if "lora_" in n:
                p.normal_(0, 0.1)
    peft_model.save_pretrained(path)
    return peft_model.eval()


def test_peft_adapter_round_trip_and_partial_targets(model, tiny_model_dir, tmp_path):
    peft_model = saved_by_peft(hf_model(tiny_model_dir), ["q_proj", "v_proj"], tmp_path / "ext")
    adapter, lora = load_peft_adapter(model, tmp_path / "ext")
    assert (lora.rank, lora.alpha, lora.train_attn, lora.train_mlp, lora.train_unembed) == (
        4,
        8.0,
        True,
        False,
        False,
    )
    tokens = torch.tensor([[7, 70, 700, 7000, 12]])
    with torch.no_grad():
        got, want = model(tokens, adapters=AdapterBatch.single(adapter)), peft_model(tokens).logits
    assert_like_trines(want, got, tiny_model_dir, adapter, tokens)
    # Our own save -> load gives back the same tensors and config, seed included.
    lora2 = LoRAConfig(rank=4, alpha=8.0, train_attn=False, train_mlp=True, train_unembed=False, seed=7)
    trainer = Trainer(model, base_model="tiny")
    trainer.create_run("r", lora2)
    randomize(trainer.adapter("r"), 3)
    save_peft_adapter(trainer.adapter("r"), lora2, tmp_path / "own", "tiny")
    back, lora_back = load_peft_adapter(model, tmp_path / "own")
    assert lora_back == lora2
    for (n, p), (m, q) in zip(trainer.adapter("r").named_parameters(), back.named_parameters()):
        assert n == m and torch.equal(p, q)  # kind 1: saved and loaded data, bit for bit


def test_load_state_with_optimizer_resumes_exactly(model, tmp_path):
    adam = AdamConfig(learning_rate=1e-3, weight_decay=0.01, grad_clip_norm=1.0)
    batches = [random_data(s, lengths=(7, 5)) for s in range(4)]

    def step(trainer, run, data):
        trainer.forward_backward([(run, Forward(data, Loss.parse("cross_entropy")))])
        return trainer.optim_step(run, adam)

    a = Trainer(model, base_model="tiny")
    a.create_run("r", LoRAConfig(rank=4, seed=1))
    for data in batches[:2]:
        step(a, "r", data)
    size = a.save_state("r", tmp_path / "state")
    assert size == sum(f.stat().st_size for f in (tmp_path / "state").iterdir())
    version = a.weights_identity("r").version

    b = Trainer(model, base_model="tiny")
    b.load_state("resumed", tmp_path / "state", with_optimizer=True)
    assert b.lora_config("resumed") == LoRAConfig(rank=4, seed=1)
    for data in batches[2:]:  # kind 1: the same steps, in the same order, from the same state
        assert step(a, "r", data) == step(b, "resumed", data)
    for (n, p), (m, q) in zip(a.adapter("r").named_parameters(), b.adapter("resumed").named_parameters()):
        assert n == m and torch.equal(p, q)

    # Without the optimizer: same weights, fresh moments; and loading bumps the version.
    a.load_state("r", tmp_path / "state", with_optimizer=False)
    assert a.weights_identity("r").version > version
    assert all(not s for s in a._runs["r"].optimizer.state.values())


def test_sampler_checkpoint_has_no_optimizer_state(model, tmp_path):
    trainer = Trainer(model, base_model="tiny")
    trainer.create_run("r", LoRAConfig(rank=4))
    trainer.save_weights("r", tmp_path / "w")
    with pytest.raises(ValueError, match="optimizer"):
        trainer.load_state("r2", tmp_path / "w", with_optimizer=True)
    assert not trainer.has_run("r2")
    with pytest.raises(ValueError, match="not a LoRA checkpoint"):
        trainer.load_state("r2", tmp_path / "missing", with_optimizer=False)


@pytest.mark.parametrize("fail_at", ["fsync", "replace"])
def test_atomic_write_keeps_the_previous_file_when_a_write_fails(tmp_path, monkeypatch, fail_at):
    target = tmp_path / "adapter_model.safetensors"
    assert atomic_write(target, b"old contents") == 12

    def crash(*args, **kwargs):
        raise OSError("disk full")

    monkeypatch.setattr(checkpoint.os, fail_at, crash)
    with pytest.raises(OSError, match="disk full"):
        atomic_write(target, b"new contents that never fully land" * 1000)
    monkeypatch.undo()
    assert target.read_bytes() == b"old contents"
    assert os.listdir(tmp_path) == ["adapter_model.safetensors"]  # no temp file left behind


def test_restoring_a_checkpoint_deleted_after_the_restore_was_accepted_says_not_found(model, tmp_path):
    """The service checks a checkpoint exists when it accepts an init from it; the cycle that runs
    it later finds the directory gone (deleted meanwhile) and answers not found, naming its URI."""
    import shutil
    from types import SimpleNamespace

    from trine.engine import api as ops
    from trine.engine.runtime.cycle import CycleRunner
    from trine.limits import INIT_RUN

    trainer = Trainer(model, base_model="tiny")
    trainer.create_run("r", LoRAConfig(rank=2))
    trainer.save_state("r", tmp_path / "state")
    shutil.rmtree(tmp_path / "state")
    worker = SimpleNamespace(trainer=trainer, adapters={}, tick=lambda: None)
    init = ops.InitRun(LoRAConfig(rank=2), str(tmp_path / "state"), True, "trio://r/state/s1")
    cycle = ops.TrainingCycle(1, {"r2": ops.RunShare(pre=[ops.CycleEvent("e1", INIT_RUN, init)])})
    code, message = CycleRunner(worker).run(cycle).outcomes["e1"].error
    assert code == "checkpoint_not_found"
    assert "trio://r/state/s1 not found" in message and str(tmp_path) not in message
