"""Importing a PEFT adapter trained elsewhere (engine/trainer/adapter_import.py): checked against the
base model before anything is written, then an ordinary trine checkpoint."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file
from tolerance import Rounding, fp64_adapter, fp64_model

from trine.engine.api import SampleRequest, SamplingOptions, WeightsIdentity
from trine.engine.config import SamplerConfig
from trine.engine.model.lora import AdapterBatch
from trine.engine.model.tokenizer import Tokenizer
from trine.engine.model.weights import load_model
from trine.engine.sampler.sampler import Sampler
from trine.engine.trainer.adapter_import import adapter_targets, import_adapter
from trine.engine.trainer.checkpoint import load_peft_adapter, trine_facts

NAMES = ("tiny-llama",)


@pytest.fixture(scope="module")
def model(tiny_model_dir):
    return load_model(tiny_model_dir, "cpu")


def peft_adapter(model_dir, out, dtype=torch.float32, targets=("q_proj", "v_proj", "down_proj"), r=4):
    """An adapter trained elsewhere: peft's own, with random (non-zero) B, saved by peft."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    peft_model = get_peft_model(hf, LoraConfig(r=r, lora_alpha=8, target_modules=list(targets)))
    torch.manual_seed(0)
    with torch.no_grad():
        for n, p in peft_model.named_parameters():
            if "lora_" in n:
                p.normal_(0, 0.1)
    peft_model = peft_model.to(dtype)
    peft_model.save_pretrained(out, save_embedding_layers=False)  # the tied head's LoRA, not its copy
    return peft_model.eval()


def do_import(model, src, dst):
    return import_adapter(src, dst, adapter_targets(model), NAMES, "tiny-llama", origin="test upload")


def test_an_imported_peft_adapter_samples_as_transformers_and_peft(model, tiny_model_dir, tmp_path):
    """Greedy samples are the same tokens; their logprobs are PEFT's within fp32 rounding (kind 3
    against trine's fp64 model with the adapter: PEFT cannot run in fp64)."""
    theirs = peft_adapter(tiny_model_dir, tmp_path / "ext")
    lora, source, size = do_import(model, tmp_path / "ext", tmp_path / "ck")
    assert (lora.rank, lora.alpha, lora.train_attn, lora.train_mlp, lora.train_unembed) == (
        4,
        8.0,
        True,
        True,
        False,
    )
    assert size == sum(f.stat().st_size for f in (tmp_path / "ck").iterdir())
    assert "test upload" in source and "sha256" in source and trine_facts(tmp_path / "ck")["source"] == source
    adapter, _ = load_peft_adapter(model, tmp_path / "ck")

    prompt = [5, 900, 17, 4000, 23, 8, 4900, 3]
    sampler = Sampler(model, Tokenizer(tiny_model_dir), SamplerConfig(kv_cache_bytes=16 << 20))
    req = SampleRequest(
        "a",
        prompt,
        SamplingOptions(max_tokens=6, temperature=0.0, stop_at_eos=False),
        WeightsIdentity("tiny-llama", "ck", 0),
    )
    seq = sampler.run([(req, adapter)])[0].sequences[0]
    tokens = torch.tensor([prompt + seq.tokens])
    with torch.no_grad():
        logp = theirs(tokens).logits[0].log_softmax(-1)
        want = [int(logp[len(prompt) - 1 + i].argmax()) for i in range(6)]
        model64 = fp64_model(tiny_model_dir)
        ours64 = model64(tokens, adapters=AdapterBatch.single(fp64_adapter(adapter, model64)))[0]
    assert seq.tokens == want  # greedy: the same tokens as transformers + peft
    at = torch.arange(len(prompt) - 1, tokens.shape[1] - 1)
    picked = tokens[0, len(prompt) :]
    Rounding(torch.tensor(seq.logprobs), ours64.log_softmax(-1)[at, picked]).assert_within(logp[at, picked])


def test_a_bf16_adapter_is_imported_as_its_exact_values(model, tiny_model_dir, tmp_path):
    peft_adapter(tiny_model_dir, tmp_path / "ext", dtype=torch.bfloat16, targets=("o_proj", "lm_head"))
    lora, _, _ = do_import(model, tmp_path / "ext", tmp_path / "ck")
    assert (lora.train_attn, lora.train_mlp, lora.train_unembed) == (True, False, True)
    theirs, ours = (
        load_file(str(d / "adapter_model.safetensors")) for d in (tmp_path / "ext", tmp_path / "ck")
    )
    assert theirs.keys() == ours.keys()
    for k in theirs:  # kind 1: bf16 values are exact in fp32
        assert ours[k].dtype == torch.float32 and torch.equal(ours[k], theirs[k].float())


def _broken(src, tmp_path, *, config=None, tensors=None):
    """A copy of the PEFT directory `src` with its config updated and its tensors replaced."""
    dst = tmp_path / "broken"
    dst.mkdir()
    cfg = json.loads((src / "adapter_config.json").read_text())
    (dst / "adapter_config.json").write_text(json.dumps({**cfg, **(config or {})}))
    state = load_file(str(src / "adapter_model.safetensors"))
    save_file(tensors(state) if tensors else state, str(dst / "adapter_model.safetensors"))
    return dst


Q_A = "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight"
Q_B = "base_model.model.model.layers.0.self_attn.q_proj.lora_B.weight"


@pytest.mark.parametrize(
    "change,message",
    [
        (dict(config={"base_model_name_or_path": "Qwen/Qwen3-8B"}), r"'Qwen/Qwen3-8B' is not the base model"),
        (dict(config={"use_dora": True}), "use_dora"),
        (dict(config={"r": 300}), "r 300: use an integer from 1 to 256"),
        (
            dict(tensors=lambda s: {**s, Q_A: torch.zeros(4, 95)}),
            rf"{Q_A} has shape \(4, 95\); the base model needs \(4, 96\)",
        ),
        (
            dict(tensors=lambda s: {**s, Q_B: torch.zeros(96, 4, dtype=torch.int8)}),
            f"{Q_B} has dtype I8",
        ),
        (
            dict(
                tensors=lambda s: {
                    **s,
                    "base_model.model.model.layers.9.mlp.up_proj.lora_A.weight": s[Q_A].clone(),
                }
            ),
            "adapts model.layers.9.mlp.up_proj, which the base model does not have",
        ),
        (dict(tensors=lambda s: {k: v for k, v in s.items() if k != Q_B}), f"{Q_B} is missing"),
    ],
)
def test_a_mismatch_is_refused_naming_the_tensor_and_what_the_model_needs(
    model, tiny_model_dir, tmp_path, change, message
):
    peft_adapter(tiny_model_dir, tmp_path / "ext", targets=("q_proj",))
    with pytest.raises(ValueError, match=message):
        do_import(model, _broken(tmp_path / "ext", tmp_path, **change), tmp_path / "ck")
    assert not (tmp_path / "ck").exists()  # nothing stored
