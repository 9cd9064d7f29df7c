"""Qwen3.5's hybrid model (Gated DeltaNet + gated full attention) against transformers' own, and
the Gated DeltaNet's two forms of the rule against each other (kind 3, tests/tolerance.py)."""

from __future__ import annotations

import json

import pytest
import torch
from conftest import build_tiny_qwen3_5_dir
from safetensors.torch import load_file, save_file
from tolerance import (
    Rounding,
    assert_bitwise,
    assert_same_computation,
    assert_same_math_fp64,
    fp64_adapter,
    fp64_model,
)

from trine.engine.api import LORA_LINEAR_ATTN, LoRAConfig
from trine.engine.model.attention import KVContext
from trine.engine.model.gated_deltanet import (
    GatedDeltaNet,
    LinearAttentionShape,
    LinearState,
    chunked_rule,
    recurrent_rule,
)
from trine.engine.model.lora import AdapterBatch
from trine.engine.model.qwen3_5 import HybridConfig, HybridState, HybridTransformer
from trine.engine.model.weights import load_model, read_config

VOCAB = 49152  # SmolLM2's tokenizer (no Qwen tokenizer is available offline): tests/fixtures/README.md


@pytest.fixture(scope="module")
def qwen3_5_dir(tiny_qwen3_5_dir):
    return tiny_qwen3_5_dir


@pytest.fixture(scope="module")
def hf_qwen3_5(qwen3_5_dir):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(qwen3_5_dir, dtype=torch.float32).eval()


def padded_batch(T: int = 150, short: int = 97):
    """Two rows of T tokens (more than two chunks of the rule), the second right-padded after `short`."""
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, VOCAB, (2, T), generator=g)
    mask = torch.ones(2, T, dtype=torch.bool)
    mask[1, short:] = False
    return tokens, mask


def test_config_reads_the_hybrid_stack(qwen3_5_dir):
    cfg = read_config(qwen3_5_dir)
    assert isinstance(cfg, HybridConfig) and cfg.model_type == "qwen3_5_text"
    assert cfg.attention_layers == (2, 4) and cfg.linear_layers == (0, 1, 3)
    assert cfg.rotary_dim == 8 and cfg.linear == LinearAttentionShape(2, 4, 16, 24, 4)
    assert isinstance(load_model(qwen3_5_dir, "cpu"), HybridTransformer)


def test_logits_match_transformers_with_padding(qwen3_5_dir, hf_qwen3_5):
    ours, ours64 = load_model(qwen3_5_dir, "cpu"), fp64_model(qwen3_5_dir)
    tokens, mask = padded_batch()
    with torch.no_grad():
        want = hf_qwen3_5(tokens, attention_mask=mask.long()).logits
        got, got64 = ours(tokens, pad_mask=mask), ours64(tokens, pad_mask=mask)
    Rounding(got[mask], got64[mask]).assert_within(want[mask])


def test_an_untied_lm_head_matches_transformers(tmp_path):
    from transformers import AutoModelForCausalLM

    path = build_tiny_qwen3_5_dir(tmp_path / "untied", seed=1, tie=False)
    ours, ours64 = load_model(path, "cpu"), fp64_model(path)
    assert not ours.cfg.tie_word_embeddings and ours.lm_head.weight is not ours.model.embed_tokens.weight
    tokens, mask = padded_batch(40, 33)
    with torch.no_grad():
        want = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)(
            tokens, attention_mask=mask.long()
        ).logits
        got, got64 = ours(tokens, pad_mask=mask), ours64(tokens, pad_mask=mask)
    Rounding(got[mask], got64[mask]).assert_within(want[mask])


def test_a_multimodal_checkpoint_loads_its_language_model(qwen3_5_dir, tmp_path):
    """A `qwen3_5` checkpoint: the text config under `text_config`, the weights under
    `model.language_model.`, beside a vision tower and an MTP head that are not loaded."""
    text_cfg = json.loads((qwen3_5_dir / "config.json").read_text())
    state = {}
    for f in qwen3_5_dir.glob("*.safetensors"):
        state.update(load_file(str(f)))
    renamed = {"model.language_model." + k[6:] if k.startswith("model.") else k: v for k, v in state.items()}
    renamed["model.visual.patch_embed.proj.weight"] = torch.zeros(4, 3)
    renamed["mtp.fc.weight"] = torch.zeros(2, 2)
    save_file(renamed, str(tmp_path / "model.safetensors"))
    config = {
        "model_type": "qwen3_5",
        "tie_word_embeddings": text_cfg["tie_word_embeddings"],
        "text_config": text_cfg,
        "vision_config": {"depth": 1},
    }
    (tmp_path / "config.json").write_text(json.dumps(config))
    tokens, mask = padded_batch(40, 30)
    with torch.no_grad():
        want = load_model(qwen3_5_dir, "cpu")(tokens, pad_mask=mask)
        got = load_model(tmp_path, "cpu")(tokens, pad_mask=mask)
    assert_bitwise(got, want)  # kind 1: the same weights, the same computation


# ----------------------------------------------------------------------------- the rule's two forms
SHAPE = LinearAttentionShape(num_key_heads=2, num_value_heads=4, key_head_dim=16, value_head_dim=24)


def gdn_layer(dtype: torch.dtype) -> GatedDeltaNet:
    torch.manual_seed(7)
    layer = GatedDeltaNet(96, SHAPE, 1e-6)
    with torch.no_grad():
        for p in layer.parameters():
            p.copy_(torch.randn_like(p) * 0.2)
        layer.A_log.copy_(torch.linspace(-2, 1, 4))
    return layer.to(dtype).requires_grad_(False)


def start_state(dtype: torch.dtype, batch: int = 2) -> LinearState:
    g = torch.Generator().manual_seed(3)
    state = LinearState.zeros(SHAPE, batch, dtype=dtype)
    state.conv.copy_(torch.randn(state.conv.shape, generator=g))
    state.recurrent.copy_(torch.randn(state.recurrent.shape, generator=g) * 0.3)
    return state


@pytest.mark.parametrize("T", [1, 5, 64, 150])
def test_chunked_rule_equals_the_recurrent_steps_and_two_pieces(T):
    """From a given state S: T tokens chunked = T recurrent steps = chunked in two pieces (the
    state carried over), outputs and final states, within fp32 rounding (what a prefix cache of
    recurrent state relies on)."""
    x32 = torch.randn(2, T, 96, generator=torch.Generator().manual_seed(1))

    def compute(layer):
        dtype = layer.out_proj.weight.dtype
        x = x32.to(dtype)
        whole, after = layer(x, None, None, start_state(dtype))
        steps, state = [], start_state(dtype)
        for t in range(T):
            out, state = layer(x[:, t : t + 1], None, None, state)
            steps.append(out)
        cut = T // 3
        first, mid = (
            layer(x[:, :cut], None, None, start_state(dtype)) if cut else (x[:, :0], start_state(dtype))
        )
        second, end = layer(x[:, cut:], None, None, mid)
        ref = {"out": whole, "conv": after.conv, "state": after.recurrent}
        return {"steps": ref, "pieces": ref}, {
            "steps": {"out": torch.cat(steps, 1), "conv": state.conv, "state": state.recurrent},
            "pieces": {"out": torch.cat([first, second], 1), "conv": end.conv, "state": end.recurrent},
        }

    assert_same_computation(compute, gdn_layer(torch.float32), gdn_layer(torch.float64))


def test_the_rule_functions_agree_from_a_given_state():
    """`chunked_rule` and `recurrent_rule` directly, with grouped key heads and a tail chunk."""
    g = torch.Generator().manual_seed(2)
    B, T = 2, 70
    q, k = torch.randn(B, T, 2, 16, generator=g), torch.randn(B, T, 2, 16, generator=g)
    v = torch.randn(B, T, 4, 24, generator=g)
    gate, beta = -torch.rand(B, T, 4, generator=g), torch.rand(B, T, 4, generator=g)
    s0 = torch.randn(B, 4, 16, 24, generator=g)

    def compute(dtype):
        args = [t.to(dtype) for t in (q, k, v, gate, beta, s0)]
        o1, s1, _ = chunked_rule(*args, chunk=16)
        o2, s2, _ = recurrent_rule(*args)
        return {"rule": {"o": o2, "s": s2}}, {"rule": {"o": o1, "s": s1}}

    assert_same_computation(compute, torch.float32, torch.float64)


def test_padded_positions_leave_the_state_as_it_is():
    """A row's state after its real tokens is the same with or without padding after them: the same
    math in fp64 (the conv state holds the input projection's outputs, whose GEMM over 2 x 20 rows
    may sum in another order than over 1 x 13 on some CPUs, so not bit for bit)."""
    layer = gdn_layer(torch.float64)
    x = torch.randn(2, 20, 96, dtype=torch.float64, generator=torch.Generator().manual_seed(4))
    real = torch.ones(2, 20, dtype=torch.bool)
    real[1, 13:] = False
    _, padded = layer(x, None, real, start_state(torch.float64))
    _, alone = layer(x[1:, :13], None, None, start_state(torch.float64).rows(slice(1, 2)))
    assert_same_math_fp64(
        {"conv": padded.conv[1:], "state": padded.recurrent[1:]},
        {"conv": alone.conv, "state": alone.recurrent},
    )


def test_states_at_cuts_equal_the_prefix_run_alone():
    """`cuts` (row, t): the layer's state after row's first t tokens, taken inside one forward
    (the chunked form ends a chunk at each cut), is the state a forward of those t tokens alone
    ends with (kind 3), conv state included; the outputs and final states are those of the
    forward without cuts."""
    x32 = torch.randn(3, 150, 96, generator=torch.Generator().manual_seed(11))
    real = torch.ones(3, 150, dtype=torch.bool)
    real[1, 97:] = False
    cuts = [(0, 5), (0, 64), (0, 100), (1, 30), (1, 97), (2, 150)]

    def compute(layer):
        dtype = layer.out_proj.weight.dtype
        x = x32.to(dtype)
        out, after = layer(x, None, real, start_state(dtype, 3), cuts)
        plain, plain_after = layer(x, None, real, start_state(dtype, 3))
        alone = [
            layer(x[b : b + 1, :t], None, None, start_state(dtype, 3).rows(slice(b, b + 1)))[1]
            for b, t in cuts
        ]
        ref = {"out": plain[real], "state": plain_after.recurrent, "conv": plain_after.conv}
        ref |= {
            "cut": torch.cat([a.recurrent for a in alone]),
            "cut_conv": torch.cat([a.conv for a in alone]),
        }
        path = {"out": out[real], "state": after.recurrent, "conv": after.conv}
        path |= {"cut": after.snapshots.recurrent, "cut_conv": after.snapshots.conv}
        return {"cuts": ref}, {"cuts": path}

    with torch.no_grad():
        assert_same_computation(compute, gdn_layer(torch.float32), gdn_layer(torch.float64))


def test_batch_invariant_layer_is_the_same_bits_whatever_the_batch_and_pieces():
    """Batch-invariant kernels on: a row's outputs and states are the same bits alone or in a
    batch, in one forward or in a prefix then one token at a time (a prefill chunk from a snapshot,
    then decode steps), and at a cut."""
    from trine.engine.model import invariant

    layer = gdn_layer(torch.float32)
    x = torch.randn(3, 90, 96, generator=torch.Generator().manual_seed(12))
    invariant.enable(True)
    try:
        with torch.no_grad():
            whole, after = layer(x, None, None, start_state(torch.float32, 3), [(0, 70)])
            alone, _ = layer(x[:1], None, None, start_state(torch.float32, 3).rows(slice(0, 1)))
            outs, state = [], start_state(torch.float32, 3).rows(slice(0, 1))
            first, state = layer(x[:1, :70], None, None, state)
            snapshot = state
            for t in range(70, 90):
                out, state = layer(x[:1, t : t + 1], None, None, state)
                outs.append(out)
    finally:
        invariant.enable(False)
    assert_bitwise(alone[0], whole[0])
    assert_bitwise(torch.cat([first, *outs], 1)[0], whole[0])
    assert_bitwise(
        {"s": state.recurrent[0], "c": state.conv[0]}, {"s": after.recurrent[0], "c": after.conv[0]}
    )
    assert_bitwise(
        {"s": snapshot.recurrent[0], "c": snapshot.conv[0]},
        {"s": after.snapshots.recurrent[0], "c": after.snapshots.conv[0]},
    )


def test_batch_invariant_training_forward_is_the_inference_bits_and_differentiates():
    """Batch-invariant kernels on, with gradients (the trainer's forward: the recurrent form in
    checkpointed pieces): the outputs are the inference forward's bits, and the input gradient is
    the chunked form's in fp64 (the same math)."""
    from trine.engine.model import invariant

    x = torch.randn(2, 150, 96, generator=torch.Generator().manual_seed(13), dtype=torch.float64)
    w = torch.randn(2, 150, 96, generator=torch.Generator().manual_seed(14), dtype=torch.float64)

    def grad(layer, enabled: bool):
        invariant.enable(enabled)
        try:
            xg = x.clone().requires_grad_(True)
            out, _ = layer(xg, None)
            (out * w).sum().backward()
            with torch.no_grad():
                plain, _ = layer(x, None)
        finally:
            invariant.enable(False)
        return out.detach(), plain, xg.grad

    layer = gdn_layer(torch.float64)
    out, plain, bi_grad = grad(layer, True)
    assert_bitwise(out, plain)
    assert_same_math_fp64(bi_grad, grad(layer, False)[2])


# ----------------------------------------------------------------------------- the model's state
def test_prefill_then_decode_over_a_kv_cache_equals_the_whole_forward(qwen3_5_dir):
    """The hybrid model over a KV pool and a `HybridState`: a prefill of 70 tokens, then one token
    at a time, gives the whole forward's logits (kind 3)."""
    T, P = 80, 70
    tokens = torch.randint(0, VOCAB, (1, T), generator=torch.Generator().manual_seed(6))

    def run(model):
        cfg = model.cfg
        shape = (T, cfg.num_kv_heads, cfg.head_dim)
        pools = [torch.zeros(shape, dtype=model.dtype) for _ in cfg.attention_layers]
        vpools = [torch.zeros(shape, dtype=model.dtype) for _ in cfg.attention_layers]
        state, outs = HybridState.zeros(cfg, 1, dtype=model.dtype), []
        for a, e in [(0, P)] + [(t, t + 1) for t in range(P, T)]:
            slots = torch.arange(a, e)[None]
            kv = KVContext(
                pools,
                vpools,
                slots,
                torch.arange(e)[None],
                torch.ones(e - a, e, dtype=torch.bool).tril(a)[None, None],
            )
            outs.append(model(tokens[:, a:e], slots, kv=kv, state=state))
        assert state.nbytes > 0 and all(s is not None for s in state.layers)
        return {"logits": model(tokens)}, {"logits": torch.cat(outs, 1)}

    with torch.no_grad():
        assert_same_computation(run, load_model(qwen3_5_dir, "cpu"), fp64_model(qwen3_5_dir))


def test_a_kv_forward_without_the_recurrent_state_is_refused(qwen3_5_dir):
    model = load_model(qwen3_5_dir, "cpu")
    kv = KVContext(
        [],
        [],
        torch.zeros(1, 1, dtype=torch.long),
        torch.zeros(1, 1, dtype=torch.long),
        torch.ones(1, 1, 1, 1, dtype=torch.bool),
    )
    with pytest.raises(ValueError, match="recurrent state"):
        model(torch.zeros(1, 1, dtype=torch.long), kv=kv)


# ----------------------------------------------------------------------------- LoRA
def test_lora_gradients_match_transformers_and_peft(qwen3_5_dir, hf_qwen3_5):
    """A LoRA on every linear of both layer kinds (PEFT's names for qwen3_5): the gradients of a
    loss through it equal peft's on transformers' model, every LoRA parameter (kind 3)."""
    import copy

    from peft import LoraConfig, get_peft_model
    from test_model_parity import random_adapter

    ours = load_model(qwen3_5_dir, "cpu")
    lora = LoRAConfig(rank=4, alpha=8.0)
    adapter = random_adapter(ours, lora, seed=3)
    names = {n.rsplit(".", 1)[-1] for n in adapter.module_names()}
    assert set(LORA_LINEAR_ATTN) | {"q_proj", "o_proj", "gate_proj", "lm_head"} <= names
    targets = sorted(names)
    peft_model = get_peft_model(
        copy.deepcopy(hf_qwen3_5), LoraConfig(r=4, lora_alpha=8, target_modules=targets)
    )
    params = dict(peft_model.named_parameters())
    with torch.no_grad():
        for module in adapter.module_names():
            a, b = adapter.pair(module)
            params[f"base_model.model.{module}.lora_A.default.weight"].copy_(a)
            params[f"base_model.model.{module}.lora_B.default.weight"].copy_(b)
    tokens, mask = padded_batch(90, 75)
    weights = torch.randn(2, 90, VOCAB, generator=torch.Generator().manual_seed(8)) * mask[..., None]

    def ours_grads(model, adapter):
        adapter.requires_grad_(True)
        logits = model(tokens, adapters=AdapterBatch.single(adapter), pad_mask=mask)
        (logits * weights.to(logits.dtype)).sum().backward()
        return {
            m: torch.cat([adapter.pair(m)[0].grad.flatten(), adapter.pair(m)[1].grad.flatten()])
            for m in adapter.module_names()
        }

    got = ours_grads(ours, adapter)
    ours64 = fp64_model(qwen3_5_dir)
    got64 = ours_grads(ours64, fp64_adapter(adapter, ours64))
    peft_model.eval()
    logits = peft_model(tokens, attention_mask=mask.long()).logits
    (logits * weights).sum().backward()
    want = {
        m: torch.cat(
            [
                params[f"base_model.model.{m}.lora_A.default.weight"].grad.flatten(),
                params[f"base_model.model.{m}.lora_B.default.weight"].grad.flatten(),
            ]
        )
        for m in adapter.module_names()
    }
    Rounding(got, got64).assert_within(want)


@pytest.mark.parametrize("layout", ["scattered", "contiguous"])
def test_mixed_adapters_in_one_batch_equal_each_row_alone(qwen3_5_dir, layout):
    """Kind 3, against fp64: each row alone is the reference, the mixed batch the path."""
    from test_model_parity import random_adapter

    tokens = torch.randint(0, VOCAB, (4, 9), generator=torch.Generator().manual_seed(5))

    def compute(model):
        a1 = random_adapter(model, LoRAConfig(rank=4), seed=1)
        a2 = random_adapter(model, LoRAConfig(rank=8, alpha=8.0, train_unembed=False), seed=2)
        rows = [a1, None, a2, a1] if layout == "scattered" else [a1, a1, None, a2]
        with torch.no_grad():
            mixed = model(tokens, adapters=AdapterBatch.from_rows(rows))
            alone = [model(tokens[i : i + 1], adapters=AdapterBatch.single(a))[0] for i, a in enumerate(rows)]
        return {"logits": alone}, {"logits": list(mixed)}

    assert_same_computation(compute, load_model(qwen3_5_dir, "cpu"), fp64_model(qwen3_5_dir))


def test_state_rows_batch_and_snapshot(qwen3_5_dir):
    """`HybridState` rows concatenate and split back exactly; a clone is a snapshot that a later
    forward from the original does not change."""
    model = load_model(qwen3_5_dir, "cpu")
    cfg = model.cfg
    tokens = torch.randint(0, VOCAB, (2, 6), generator=torch.Generator().manual_seed(9))
    pools = [torch.zeros(8, cfg.num_kv_heads, cfg.head_dim) for _ in cfg.attention_layers]
    vpools = [torch.zeros(8, cfg.num_kv_heads, cfg.head_dim) for _ in cfg.attention_layers]
    state = HybridState.cat([HybridState.zeros(cfg, 1), HybridState.zeros(cfg, 1)])
    slots = torch.stack([torch.arange(3), torch.arange(4, 7)])
    mask = torch.ones(3, 3, dtype=torch.bool).tril()[None, None].expand(2, 1, 3, 3)
    with torch.no_grad():
        model(
            tokens[:, :3],
            torch.arange(3).expand(2, 3),
            kv=KVContext(pools, vpools, slots, slots, mask),
            state=state,
        )
    snapshot = state.clone()
    first, second = state.rows(slice(0, 1)), state.rows(slice(1, 2))
    again = HybridState.cat([first, second])
    for a, b in zip(again.layers, snapshot.layers):
        assert_bitwise({"conv": a.conv, "s": a.recurrent}, {"conv": b.conv, "s": b.recurrent})
    assert snapshot.nbytes == state.nbytes > 0
    with torch.no_grad():
        model(
            tokens[:, 3:4],
            torch.full((2, 1), 3),
            kv=KVContext(
                pools,
                vpools,
                slots[:, :1] + 3,
                torch.cat([slots, slots[:, :1] + 3], 1),
                torch.ones(2, 1, 1, 4, dtype=torch.bool),
            ),
            state=state,
        )
    assert not torch.equal(state.layers[0].recurrent, snapshot.layers[0].recurrent)
    assert torch.equal(again.layers[0].recurrent, snapshot.layers[0].recurrent)
