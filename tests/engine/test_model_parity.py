"""Our Transformer equals transformers' own implementation of the same weights: in fp32, within
MARGIN x our fp32 rounding of our fp64 result (kind 3, tests/tolerance.py), not a fixed 1e-4."""

from __future__ import annotations

import pytest
import torch
from conftest import FAMILIES, build_tiny_model_dir
from tolerance import Rounding, assert_bitwise, assert_same_computation, fp64_adapter, fp64_model

from trine.engine.api import LoRAConfig
from trine.engine.model.lora import Adapter, AdapterBatch
from trine.engine.model.weights import load_model


def assert_like_ours(theirs32, ours32, ours64):
    """Kind 3, against our fp64 result: transformers cannot run the same math in fp64 (it normalises
    and computes RoPE angles in fp32 whatever the model's dtype), so the fp64 value is our model's,
    and our fp32 result's distance from it is what fp32 rounding does to this forward; transformers'
    fp32 result, the same math in its own order, must lie within MARGIN x that. A different
    computation (a wrong RoPE, norm or mask) lands 1e-3 or more away."""
    Rounding(ours32, ours64).assert_within(theirs32)


def hf_model(path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


def random_adapter(model, lora: LoRAConfig, seed: int) -> Adapter:
    adapter = Adapter(model, lora)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in adapter.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.05)
    return adapter.requires_grad_(False)


def batch_with_padding():
    """Two rows, the second right-padded; mask True on real tokens."""
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, 49152, (2, 13), generator=g)
    mask = torch.ones(2, 13, dtype=torch.bool)
    mask[1, 8:] = False
    return tokens, mask


@pytest.fixture(scope="module")
def untied_dir(tmp_path_factory):
    return build_tiny_model_dir(
        "llama", tmp_path_factory.mktemp("untied") / "tiny-llama-untied", seed=1, tie=False
    )


def model_dirs(tiny_model_dirs, untied_dir):
    return {**tiny_model_dirs, "llama-untied": untied_dir}


@pytest.mark.parametrize("family", FAMILIES + ("llama-untied",))
def test_logits_match_transformers_with_padding(tiny_model_dirs, untied_dir, family):
    path = model_dirs(tiny_model_dirs, untied_dir)[family]
    ours, ours64, ref = load_model(path, "cpu"), fp64_model(path), hf_model(path)
    assert ours.cfg.tie_word_embeddings == (family != "llama-untied")
    tokens, mask = batch_with_padding()
    with torch.no_grad():
        want = ref(tokens, attention_mask=mask.long()).logits
        got, got64 = ours(tokens, pad_mask=mask), ours64(tokens, pad_mask=mask)
    assert_like_ours(want[mask], got[mask], got64[mask])  # real tokens: the unpadded row's every position


@pytest.mark.parametrize("family", FAMILIES + ("llama-untied",))
def test_lora_logits_match_peft(tiny_model_dirs, untied_dir, family):
    from peft import LoraConfig, get_peft_model

    path = model_dirs(tiny_model_dirs, untied_dir)[family]
    ours = load_model(path, "cpu")
    lora = LoRAConfig(rank=8, alpha=32.0)  # attn + mlp + lm_head
    adapter = random_adapter(ours, lora, seed=3)
    peft_cfg = LoraConfig(r=8, lora_alpha=32, target_modules=list(lora.target_names()))
    peft_model = get_peft_model(hf_model(path), peft_cfg)
    with torch.no_grad():
        lora_params = dict(peft_model.named_parameters())
        for module in adapter.module_names():
            a, b = adapter.pair(module)
            lora_params[f"base_model.model.{module}.lora_A.default.weight"].copy_(a)
            lora_params[f"base_model.model.{module}.lora_B.default.weight"].copy_(b)
    peft_model.eval()
    tokens, mask = batch_with_padding()
    ours64 = fp64_model(path)
    with torch.no_grad():
        want = peft_model(tokens, attention_mask=mask.long()).logits
        got = ours(tokens, adapters=AdapterBatch.single(adapter), pad_mask=mask)
        got64 = ours64(tokens, adapters=AdapterBatch.single(fp64_adapter(adapter, ours64)), pad_mask=mask)
        base = ours(tokens, pad_mask=mask)
    assert (got - base)[mask].abs().max() > 1e-2  # the adapter changes the output
    assert_like_ours(want[mask], got[mask], got64[mask])


@pytest.mark.parametrize("layout", ["scattered", "contiguous"])
def test_mixed_adapters_in_one_batch_equal_each_row_alone(tiny_model_dir, layout):
    """Kind 3, against fp64: each row alone is the reference, the mixed batch the path."""
    g = torch.Generator().manual_seed(5)
    tokens = torch.randint(0, 49152, (4, 9), generator=g)

    def compute(model):
        a1 = random_adapter(model, LoRAConfig(rank=4), seed=1)
        a2 = random_adapter(model, LoRAConfig(rank=16, alpha=8.0, train_unembed=False), seed=2)
        rows = [a1, None, a2, a1] if layout == "scattered" else [a1, a1, None, a2]
        batch = AdapterBatch.from_rows(rows)
        assert (batch.spans is not None) == (layout == "contiguous")  # row views, not gather/scatter
        with torch.no_grad():
            mixed = model(tokens, adapters=batch)
            alone = [model(tokens[i : i + 1], adapters=AdapterBatch.single(a))[0] for i, a in enumerate(rows)]
        return {"logits": alone}, {"logits": list(mixed)}

    assert_same_computation(compute, load_model(tiny_model_dir, "cpu"), fp64_model(tiny_model_dir))


def test_a_checkpoint_sharded_into_many_safetensors_files_loads_the_same(tiny_model_dir, tmp_path):
    hf_model(tiny_model_dir).save_pretrained(tmp_path, max_shard_size="2MB")  # many files + an index
    assert len(list(tmp_path.glob("*.safetensors"))) > 1
    tokens, mask = batch_with_padding()
    with torch.no_grad():
        want = load_model(tiny_model_dir, "cpu")(tokens, pad_mask=mask)
        got = load_model(tmp_path, "cpu")(tokens, pad_mask=mask)
    assert_bitwise(got, want)  # kind 1: the same weights, the same computation


def test_a_directory_that_is_not_a_checkpoint_gets_a_clear_error(tmp_path):
    with pytest.raises(FileNotFoundError, match="config.json"):
        load_model(tmp_path, "cpu")


def test_llama3_rope_scaling_matches_transformers(tmp_path):
    import transformers as tf

    cfg = tf.LlamaConfig(
        vocab_size=49152,
        hidden_size=96,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=24,
        rope_parameters={
            "rope_type": "llama3",
            "rope_theta": 500000.0,
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 64,
        },
    )
    torch.manual_seed(0)
    tf.LlamaForCausalLM(cfg).save_pretrained(tmp_path)
    ours, ours64, ref = load_model(tmp_path, "cpu"), fp64_model(tmp_path), hf_model(tmp_path)
    assert ours.cfg.rope_scaling == (8.0, 1.0, 4.0, 64)
    tokens = torch.randint(0, 49152, (1, 300), generator=torch.Generator().manual_seed(0))  # past 64
    with torch.no_grad():
        assert_like_ours(ref(tokens).logits, ours(tokens), ours64(tokens))
