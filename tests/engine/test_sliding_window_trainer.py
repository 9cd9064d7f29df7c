"""The trainer on sliding-window models (Gemma 3, OLMo 3): a saved adapter loads into transformers +
peft and back, a merged export loads into transformers, and shared prefixes longer than the
window train as the plain path does (kind 3, tests/tolerance.py)."""

from __future__ import annotations

import pytest
import torch
from click.testing import CliRunner
from conftest import WINDOWED_FAMILIES, build_tiny_windowed_dir
from test_losses import randomize
from test_model_parity import hf_model
from test_train_prefix_sharing import shared_data, shared_vs_plain
from tolerance import Rounding, assert_bitwise, fp64_adapter, fp64_model

from trine.cli.main import main
from trine.engine.api import Forward, LoRAConfig, Loss
from trine.engine.model.lora import AdapterBatch
from trine.engine.model.weights import load_model
from trine.engine.trainer.checkpoint import load_peft_adapter
from trine.engine.trainer.trainer import Trainer

TOKENS = torch.randint(0, 49152, (1, 40), generator=torch.Generator().manual_seed(2))


def like_trines(theirs, model_dir, adapter, ours):
    """Kind 3: trine's fp32 logits with `adapter` are the reference, transformers' (PEFT's LoRA, or
    merged weights) the path; the fp64 value is trine's fp64 model (transformers rotates and
    normalises in fp32 whatever the dtype)."""
    model64 = fp64_model(model_dir)
    with torch.no_grad():
        ours64 = model64(TOKENS, adapters=AdapterBatch.single(fp64_adapter(adapter, model64)))
    Rounding(ours, ours64).assert_within(theirs)


@pytest.mark.parametrize("family", WINDOWED_FAMILIES)
def test_a_saved_adapter_round_trips_through_peft_and_merges(tiny_windowed_dirs, family, tmp_path):
    from peft import PeftModel

    path = tiny_windowed_dirs[family]
    model = load_model(path, "cpu")
    trainer = Trainer(model, base_model=f"tiny-{family}")
    trainer.create_run("r", LoRAConfig(rank=8, alpha=16.0))  # attention, MLP and the tied LM head
    randomize(trainer.adapter("r"), 0)
    trainer.save_weights("r", tmp_path / "ckpt")
    adapter = trainer.adapter("r")
    with torch.no_grad():
        ours, base = model(TOKENS, adapters=AdapterBatch.single(adapter)), model(TOKENS)
        peft_logits = PeftModel.from_pretrained(hf_model(path), str(tmp_path / "ckpt")).eval()(TOKENS).logits
    assert (ours - base).abs().max() > 1e-2  # the adapter matters
    like_trines(peft_logits, path, adapter, ours)
    back, _ = load_peft_adapter(model, tmp_path / "ckpt")
    assert_bitwise(dict(back.named_parameters()), dict(adapter.named_parameters()))
    r = CliRunner().invoke(main, ["export", str(tmp_path / "ckpt"), str(tmp_path / "merged"), "--merged"])
    assert r.exit_code == 0, r.output
    with torch.no_grad():
        merged = hf_model(tmp_path / "merged")(TOKENS).logits
    like_trines(merged, path, adapter, ours)


@pytest.fixture(scope="module")
def small_vocab_gemma(tmp_path_factory):
    """Gemma 3 with a 4K vocabulary (the fp64 twin's cost is mostly its LM head), window 8."""
    path = build_tiny_windowed_dir("gemma3", tmp_path_factory.mktemp("g4k") / "gemma3-4k", vocab_size=4096)
    return load_model(path, "cpu"), fp64_model(path)


def test_shared_prefixes_longer_than_the_window_train_as_the_plain_path(small_vocab_gemma):
    """A GRPO group (a prompt of 21 tokens, past the window of 8) and a multi-turn chain share their
    prefixes: their logprobs, losses and gradients are the plain path's."""
    model, model64 = small_vocab_gemma
    entry = [("r", Forward(shared_data(1), Loss.parse("importance_sampling")))]

    def shared_less(a, b):
        assert a.usage.train_tokens < b.usage.train_tokens  # it did share

    shared_vs_plain(model, model64, entry, "r", check=shared_less)
