"""Gemma 3 and OLMo 3 (sliding-window layers beside global ones) against transformers' own
implementations: configs, logits, the KV-pool path, RoPE kinds and LoRA gradients (kind 3,
tests/tolerance.py). Prompts of 40 tokens cross the tiny models' window of 8."""

from __future__ import annotations

import copy
import dataclasses
import json

import pytest
import torch
from conftest import TINY_SHAPE, TINY_WINDOW, WINDOWED_FAMILIES, build_tiny_windowed_dir, save_tiny
from safetensors.torch import load_file, save_file
from test_model_parity import hf_model, random_adapter
from test_qwen3_5 import padded_batch as two_rows
from tolerance import Rounding, assert_bitwise, assert_same_computation, fp64_adapter, fp64_model

from trine.engine.api import LoRAConfig
from trine.engine.model.attention import KVContext
from trine.engine.model.gemma3 import Gemma3Config, Gemma3Transformer
from trine.engine.model.lora import AdapterBatch
from trine.engine.model.olmo3 import Olmo3Config, Olmo3Transformer
from trine.engine.model.sliding_window import FULL, SLIDING, RopeSpec, windowed
from trine.engine.model.weights import config_from_hf, load_model, read_config
from trine.engine.model.windowed_dense import DenseWindowedConfig, DenseWindowedTransformer
from trine.engine.sampler.window import freed_window

VOCAB = 49152


def padded_batch():
    """Two rows of 40 tokens, the second right-padded after 29; both longer than the window."""
    return two_rows(40, 29)


# ----------------------------------------------------------------------------- configs
def test_configs_read_layer_kinds_windows_and_each_kinds_rope(tiny_windowed_dirs):
    gemma = read_config(tiny_windowed_dirs["gemma3"])
    assert isinstance(gemma, Gemma3Config) and gemma.model_type == "gemma3_text"
    assert [gemma.window(i) for i in range(4)] == [TINY_WINDOW, TINY_WINDOW, None, TINY_WINDOW]
    assert dict(gemma.rope) == {FULL: RopeSpec(1e6), SLIDING: RopeSpec(1e4)}
    assert gemma.embed_scale == 96**0.5 and gemma.query_pre_attn_scalar == 32 and not gemma.all_windowed
    olmo = read_config(tiny_windowed_dirs["olmo3"])
    assert isinstance(olmo, Olmo3Config) and olmo.layer_types[2] == FULL
    assert dict(olmo.rope) == {FULL: RopeSpec(5e5), SLIDING: RopeSpec(5e5)} and olmo.rms_norm_eps == 1e-5
    assert isinstance(load_model(tiny_windowed_dirs["gemma3"], "cpu"), Gemma3Transformer)
    assert isinstance(load_model(tiny_windowed_dirs["olmo3"], "cpu"), Olmo3Transformer)


def test_a_config_of_older_transformers_reads_the_same():
    """Gemma 3's published config.json (transformers 4.x): `rope_theta` and `rope_local_base_freq`,
    a `_sliding_window_pattern` instead of `layer_types`."""
    cfg = {
        "model_type": "gemma3_text",
        "vocab_size": 262144,
        "hidden_size": 640,
        "intermediate_size": 2048,
        "num_hidden_layers": 18,
        "num_attention_heads": 4,
        "num_key_value_heads": 1,
        "head_dim": 256,
        "rope_theta": 1000000.0,
        "rope_local_base_freq": 10000.0,
        "rope_scaling": None,
        "sliding_window": 512,
        "_sliding_window_pattern": 6,
        "query_pre_attn_scalar": 256,
        "max_position_embeddings": 32768,
        "eos_token_id": [1, 106],
    }
    got = config_from_hf(cfg)
    assert got.layer_types == tuple(FULL if i % 6 == 5 else SLIDING for i in range(18))
    assert dict(got.rope) == {FULL: RopeSpec(1e6), SLIDING: RopeSpec(1e4)} and got.sliding_window == 512
    assert got.tie_word_embeddings and got.eos_token_ids == (1, 106)


@pytest.mark.parametrize(
    "change, field",
    [
        ({"final_logit_softcapping": 30.0}, "final_logit_softcapping"),
        ({"attn_logit_softcapping": 50.0}, "attn_logit_softcapping"),
        ({"rope_parameters": {"full_attention": {"rope_type": "dynamic", "rope_theta": 1.0}}}, "rope_type"),
        ({"sliding_window": None}, "sliding_window"),
        ({"layer_types": ["sliding_attention", "chunked_attention"]}, "layer_types"),
    ],
)
def test_what_the_engine_cannot_run_is_refused_by_name(tiny_windowed_dirs, change, field):
    cfg = {**json.loads((tiny_windowed_dirs["gemma3"] / "config.json").read_text()), **change}
    with pytest.raises(ValueError, match=field):
        config_from_hf(cfg)


def test_a_multimodal_gemma3_checkpoint_loads_its_language_model(tiny_windowed_dirs, tmp_path):
    """A `gemma3` checkpoint: the text config under `text_config`, the weights under
    `model.language_model.`, beside a vision tower and a projector that are not loaded."""
    src = tiny_windowed_dirs["gemma3"]
    state = {}
    for f in src.glob("*.safetensors"):
        state.update(load_file(str(f)))
    renamed = {"model.language_model." + k[6:] if k.startswith("model.") else k: v for k, v in state.items()}
    renamed["model.vision_tower.vision_model.embeddings.patch_embedding.weight"] = torch.zeros(4, 3)
    renamed["model.multi_modal_projector.mm_input_projection_weight"] = torch.zeros(2, 2)
    save_file(renamed, str(tmp_path / "model.safetensors"))
    text = json.loads((src / "config.json").read_text())
    config = {"model_type": "gemma3", "text_config": text, "vision_config": {"hidden_size": 8}}
    (tmp_path / "config.json").write_text(json.dumps(config))
    tokens, mask = padded_batch()
    with torch.no_grad():
        assert_bitwise(
            load_model(tmp_path, "cpu")(tokens, pad_mask=mask), load_model(src, "cpu")(tokens, pad_mask=mask)
        )


# ----------------------------------------------------------------------------- forwards
@pytest.mark.parametrize("family", WINDOWED_FAMILIES)
def test_logits_match_transformers_with_padding(tiny_windowed_dirs, family):
    path = tiny_windowed_dirs[family]
    ours, ours64, ref = load_model(path, "cpu"), fp64_model(path), hf_model(path)
    tokens, mask = padded_batch()
    unwindowed = copy.deepcopy(ours)
    unwindowed.cfg = dataclasses.replace(ours.cfg, sliding_window=4096)
    with torch.no_grad():
        want = ref(tokens, attention_mask=mask.long()).logits
        got, got64 = ours(tokens, pad_mask=mask), ours64(tokens, pad_mask=mask)
        assert (unwindowed(tokens, pad_mask=mask) - got)[mask].abs().max() > 1e-2  # the window matters
    Rounding(got[mask], got64[mask]).assert_within(want[mask])


@pytest.mark.parametrize("family", WINDOWED_FAMILIES)
def test_prefill_chunks_then_decode_over_a_kv_pool_equal_the_whole_forward(tiny_windowed_dirs, family):
    """Prefill chunks of 10 and 15 tokens, then one token at a time, each over a KV pool whose
    windowed layers read a context cut to the window (`windowed`): the whole forward's logits."""
    T = 40
    tokens = torch.randint(0, VOCAB, (1, T), generator=torch.Generator().manual_seed(1))

    def run(model):
        cfg = model.cfg
        shape = (T, cfg.num_kv_heads, cfg.head_dim)
        pools = [torch.zeros(shape, dtype=model.dtype) for _ in range(cfg.num_layers)]
        vpools = [torch.zeros(shape, dtype=model.dtype) for _ in range(cfg.num_layers)]
        outs = []
        for a, e in [(0, 10), (10, 25)] + [(t, t + 1) for t in range(25, T)]:
            slots = torch.arange(a, e)[None]
            mask = torch.ones(e - a, e, dtype=torch.bool).tril(a)[None, None]
            outs.append(
                model(tokens[:, a:e], slots, kv=KVContext(pools, vpools, slots, torch.arange(e)[None], mask))
            )
        return {"logits": model(tokens)}, {"logits": torch.cat(outs, 1)}

    with torch.no_grad():
        assert_same_computation(
            run, load_model(tiny_windowed_dirs[family], "cpu"), fp64_model(tiny_windowed_dirs[family])
        )


def test_a_windowed_context_keeps_each_querys_last_keys_tile_aligned():
    """`windowed` on a decode step of rows at positions 40 and 70 and on a packed row: each query
    keeps exactly the keys of its last W positions, and the cut columns start on a key tile."""
    W, L = 8, 71
    read = torch.arange(2 * L).view(2, L)
    mask = torch.arange(L)[None, None, None] <= torch.tensor([40, 70])[:, None, None, None]
    ctx = windowed(KVContext([], [], read[:, :1], read, mask), W)
    assert ctx.read_slots[0, 0] % 16 == 0 and ctx.read_slots[1, 0] - L == 48
    for row, p in ((0, 40), (1, 70)):
        kept = ctx.read_slots[row][ctx.attn_mask[row, 0, 0]] - row * L
        assert kept.tolist() == list(range(p - W + 1, p + 1))
    packed = torch.zeros(1, 1, 2, 30, dtype=torch.bool)  # two samples: 10 shared keys, then 10 own each
    packed[0, 0, 0, :20] = packed[0, 0, 1, :10] = packed[0, 0, 1, 20:] = True
    ctx = windowed(KVContext([], [], read[:1, :2], read[:1, :30], packed, torch.zeros(1, 2)), W)
    assert ctx.attn_mask[0, 0, 0].nonzero().flatten().tolist() == list(range(12, 20))
    assert ctx.attn_mask[0, 0, 1].nonzero().flatten().tolist() == list(range(22, 30))


def test_rope_kinds_match_transformers(tmp_path):
    """Gemma 3's linear-scaled global RoPE (the 4B and larger models) and OLMo 3's YaRN-scaled one
    (its long-context models), against transformers on 40 tokens."""
    rope_gemma = {
        "full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1e6},
        "sliding_attention": {"rope_theta": 1e4},
    }
    yarn = {
        "rope_type": "yarn",
        "factor": 8.0,
        "original_max_position_embeddings": 32,
        "beta_fast": 32,
        "beta_slow": 1,
        "rope_theta": 5e5,
    }
    rope_olmo = {"full_attention": yarn, "sliding_attention": {"rope_theta": 5e5}}
    tokens, mask = padded_batch()
    for family, rope in (("gemma3", rope_gemma), ("olmo3", rope_olmo)):
        path = build_tiny_windowed_dir(family, tmp_path / family, rope_parameters=rope)
        kind = dict(read_config(path).rope)[FULL].kind
        assert kind == rope["full_attention"]["rope_type"]
        ours, ours64 = load_model(path, "cpu"), fp64_model(path)
        with torch.no_grad():
            want = hf_model(path)(tokens, attention_mask=mask.long()).logits
            got, got64 = ours(tokens, pad_mask=mask), ours64(tokens, pad_mask=mask)
        Rounding(got[mask], got64[mask]).assert_within(want[mask])


@pytest.mark.parametrize("family", ["mistral", "qwen2"])
def test_dense_checkpoints_with_a_window_match_transformers(tmp_path, family):
    """A Mistral with a `sliding_window` (every layer windowed: what slides out is freed) and a Qwen2
    with `use_sliding_window` (layers from `max_window_layers` on): windowed as transformers does."""
    import transformers as tf

    shape = dict(TINY_SHAPE, vocab_size=VOCAB, num_hidden_layers=3, sliding_window=TINY_WINDOW)
    torch.manual_seed(4)
    if family == "mistral":
        hf = tf.MistralForCausalLM(tf.MistralConfig(**shape))
    else:
        hf = tf.Qwen2ForCausalLM(tf.Qwen2Config(**shape, use_sliding_window=True, max_window_layers=1))
    path = save_tiny(hf, tmp_path / family)
    cfg = read_config(path)
    assert isinstance(cfg, DenseWindowedConfig) and isinstance(
        load_model(path, "cpu"), DenseWindowedTransformer
    )
    assert cfg.layer_types == ((SLIDING,) * 3 if family == "mistral" else (FULL, SLIDING, SLIDING))
    assert freed_window(cfg) == (TINY_WINDOW if family == "mistral" else None)
    ours, ours64 = load_model(path, "cpu"), fp64_model(path)
    tokens, mask = padded_batch()
    with torch.no_grad():
        want = hf_model(path)(tokens, attention_mask=mask.long()).logits
        got, got64 = ours(tokens, pad_mask=mask), ours64(tokens, pad_mask=mask)
    Rounding(got[mask], got64[mask]).assert_within(want[mask])


# ----------------------------------------------------------------------------- LoRA
@pytest.mark.parametrize("family", WINDOWED_FAMILIES)
def test_lora_gradients_match_transformers_and_peft(tiny_windowed_dirs, family):
    """A LoRA on every linear (attention, MLP, LM head; PEFT's names): the gradients of a loss
    through it equal peft's on transformers' model, every LoRA parameter (kind 3)."""
    from peft import LoraConfig, get_peft_model

    path = tiny_windowed_dirs[family]
    ours = load_model(path, "cpu")
    adapter = random_adapter(ours, LoRAConfig(rank=4, alpha=8.0), seed=3)
    targets = sorted({n.rsplit(".", 1)[-1] for n in adapter.module_names()})
    assert targets == sorted(
        ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj", "lm_head"]
    )
    peft_model = get_peft_model(hf_model(path), LoraConfig(r=4, lora_alpha=8, target_modules=targets))
    params = dict(peft_model.named_parameters())
    with torch.no_grad():
        for module in adapter.module_names():
            a, b = adapter.pair(module)
            params[f"base_model.model.{module}.lora_A.default.weight"].copy_(a)
            params[f"base_model.model.{module}.lora_B.default.weight"].copy_(b)
    tokens, mask = padded_batch()
    weights = torch.randn(2, 40, VOCAB, generator=torch.Generator().manual_seed(8)) * mask[..., None]

    def grads(model, adapter):
        adapter.requires_grad_(True)
        logits = model(tokens, adapters=AdapterBatch.single(adapter), pad_mask=mask)
        (logits * weights.to(logits.dtype)).sum().backward()
        return {m: torch.cat([p.grad.flatten() for p in adapter.pair(m)]) for m in adapter.module_names()}

    got = grads(ours, adapter)
    ours64 = fp64_model(path)
    got64 = grads(ours64, fp64_adapter(adapter, ours64))
    peft_model.eval()
    (peft_model(tokens, attention_mask=mask.long()).logits * weights).sum().backward()
    want = {
        m: torch.cat([params[f"base_model.model.{m}.lora_{x}.default.weight"].grad.flatten() for x in "AB"])
        for m in adapter.module_names()
    }
    Rounding(got, got64).assert_within(want)
