"""Training Qwen3.5's hybrid models: the trainer's losses, shared prefixes over recurrent state,
mixed runs and checkpoints, against transformers + peft and against the trainer's own plain path
(kind 3, tests/tolerance.py); adapters and merged exports that load in transformers."""

from __future__ import annotations

import json

import pytest
import torch
from click.testing import CliRunner
from conftest import build_tiny_qwen3_5_dir
from test_checkpoint import hf_model, saved_by_peft
from test_losses import randomize
from test_train_prefix_sharing import assert_same_counts, datum, shared_vs_plain
from test_trainer import grads
from tolerance import Rounding, assert_bitwise, fp64_adapter, fp64_model

from trine.cli.main import main
from trine.engine.api import LOSS_NAMES, AdamConfig, Forward, LoRAConfig, Loss
from trine.engine.config import TrainerConfig
from trine.engine.model import invariant
from trine.engine.model.lora import AdapterBatch
from trine.engine.model.weights import load_model
from trine.engine.trainer import shared_prefix
from trine.engine.trainer.checkpoint import load_peft_adapter
from trine.engine.trainer.trainer import Trainer

PROMPT, COMMON = 50, 4  # the GRPO prompt ends inside the rule's first chunk (64 tokens)
COMPLETIONS = (6, 13, 20)  # the longer ones cross that chunk's end in the plain path
COMMON_TAILS = (5, 12)  # two more completions that start alike: a segment of depth 2
TURNS = (30, 40, 25)  # a multi-turn chain, 95 tokens: two chunks
UNRELATED = 12
VOCAB = 4096  # a small head, as in test_train_prefix_sharing.py: its GEMMs dominate the fp64 twins
COMPUTED = PROMPT + sum(COMPLETIONS) + COMMON + sum(COMMON_TAILS) + sum(TURNS) + UNRELATED


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return build_tiny_qwen3_5_dir(tmp_path_factory.mktemp("qwen3_5") / "tiny-qwen3_5", vocab_size=VOCAB)


@pytest.fixture(scope="module")
def model(model_dir):
    return load_model(model_dir, "cpu")


@pytest.fixture(scope="module")
def model64(model_dir):
    return fp64_model(model_dir)


def hybrid_data(seed: int) -> list:
    """A GRPO group (`PROMPT` tokens, completions `COMPLETIONS`, and `COMMON` shared tokens then
    `COMMON_TAILS`), a chain of `TURNS` (one datum per turn, each extending the last) and an
    unrelated datum, interleaved. Every datum has its own weights, logprobs and advantages."""
    g = torch.Generator().manual_seed(seed)

    def rand(n):
        return torch.randint(0, VOCAB, (n,), generator=g).tolist()

    prompt, common = rand(PROMPT), rand(COMMON)
    group = [datum(prompt + rand(n), g, prompt=10) for n in COMPLETIONS]
    group += [datum(prompt + common + rand(n), g) for n in COMMON_TAILS]
    turns = [rand(n) for n in TURNS]
    chain = [datum(sum(turns[: k + 1], []), g, prompt=3) for k in range(len(TURNS))]
    return group[:2] + chain[:1] + group[2:] + chain[1:] + [datum(rand(UNRELATED), g)]


def computes_each_position_once(a, b):
    """(shared, plain) results: the shared path computed each distinct position once."""
    assert a.usage.train_tokens == COMPUTED < b.usage.train_tokens == b.usage.sequence_tokens


# ----------------------------------------------------------------------------- shared prefixes
@pytest.mark.parametrize("name", LOSS_NAMES)
def test_every_loss_shared_equals_plain(model, model64, name):
    """A GRPO group's completions start from the prompt's recurrent state and K/V: the logprobs,
    losses and every LoRA gradient of the plain path, each position computed once. The losses
    alternate a denominator and an adapted unembedding, so both are covered without a product."""
    k = LOSS_NAMES.index(name)
    denominator = 41.0 if k % 2 else None
    entry = [("r", Forward(hybrid_data(1), Loss.parse(name), denominator=denominator))]
    shared_vs_plain(model, model64, entry, "r", unembed=k % 3 != 1, check=computes_each_position_once)


def test_a_multi_turn_chain_alone_is_one_pass(model, model64):
    """Single-segment trees (no K/V pool, no state handed on): each turn reads a prefix of one pass."""
    data = hybrid_data(2)
    chain = [data[2], data[6], data[7]]
    assert [len(d.tokens) for d in chain] == [30, 70, 95]
    entry = [("r", Forward(chain, Loss.parse("importance_sampling")))]

    def check(a, b):
        assert a.usage.train_tokens == sum(TURNS) < b.usage.train_tokens

    shared_vs_plain(model, model64, entry, "r", check=check)


@pytest.mark.parametrize("batch_invariant", [False, True], ids=["fused", "batch_invariant"])
def test_passes_split_by_length_hand_each_child_its_parents_state(
    model, model64, monkeypatch, batch_invariant
):
    """Every segment length in a pass of its own, out of slot order: each child still starts from
    its own parent's state. Under the batch-invariant kernels too (equal within rounding here:
    bit for bit needs a form of the rule that does not depend on where it is cut)."""
    monkeypatch.setattr(shared_prefix, "PAD_BOUND", 1.0)
    monkeypatch.setattr(shared_prefix, "MIN_PASS_POSITIONS", 1)
    entry = [("r", Forward(hybrid_data(3), Loss.parse("ppo")))]
    invariant.enable(batch_invariant)
    try:
        shared_vs_plain(model, model64, entry, "r", check=computes_each_position_once)
    finally:
        invariant.enable(False)


def test_small_micro_batches_split_trees_and_stay_exact(model, model64):
    """A tree larger than the budget is split by its root's children, each part recomputing the
    prompt and its state."""
    entry = [("r", Forward(hybrid_data(4), Loss.parse("dro")))]

    def check(a, b):
        assert COMPUTED < a.usage.train_tokens < b.usage.train_tokens

    shared_vs_plain(model, model64, entry, "r", check=check, micro_batch_tokens=90)


def test_several_runs_in_one_call(model, model64):
    """Mixed adapters: two runs' datums in one call (one run's in two events), each run's gradient
    its own, shared only within a run."""
    data = hybrid_data(5)
    batch = [
        ("a", Forward(data[:4], Loss.parse("ppo"), denominator=50.0)),
        ("b", Forward(data, Loss.parse("cross_entropy"))),
        ("a", Forward(data[4:], Loss.parse("importance_sampling"))),
    ]
    shared_vs_plain(model, model64, batch, "a", "b", grads_of=("a", "b"))


def test_forward_shares_and_changes_no_gradient(model):
    trainers = [
        Trainer(model, base_model="tiny", config=TrainerConfig(prefix_sharing=s, min_shared_tokens=4))
        for s in (True, False)
    ]
    for t in trainers:
        t.create_run("r", LoRAConfig(rank=4))
        randomize(t.adapter("r"), 1)
    entry = [("r", Forward(hybrid_data(6), Loss.parse("cispo")))]
    before = grads(trainers[0], "r")
    a, b = (t.forward_backward(entry, backward=False)[0] for t in trainers)
    assert_same_counts(a, b)
    computes_each_position_once(a, b)
    assert_bitwise(grads(trainers[0], "r"), before)


# ----------------------------------------------------------------------------- against transformers + peft
def test_trainer_gradients_match_transformers_and_peft(model_dir, model, model64):
    """A LoRA on every linear of both layer kinds, trained by cross entropy with weights (shared
    prefixes on): every LoRA parameter's gradient is peft's on transformers' model, each datum
    run alone there (kind 3)."""
    from peft import LoraConfig, get_peft_model

    data = hybrid_data(7)
    lora = LoRAConfig(rank=4, alpha=8.0)

    def ours(m):
        t = Trainer(m, base_model="tiny", config=TrainerConfig(min_shared_tokens=4, logits_chunk_tokens=7))
        t.create_run("r", lora)
        randomize(t.adapter("r"), 3)
        res = t.forward_backward([("r", Forward(data, Loss.parse("cross_entropy")))])[0]
        assert res.usage.train_tokens == COMPUTED  # it shared
        return t.adapter("r")

    adapter, adapter64 = ours(model), ours(model64)
    names = sorted({m.rsplit(".", 1)[-1] for m in adapter.module_names()})
    assert len(names) == 13  # 4 attention + 5 linear-attention + 3 MLP projections + lm_head
    peft_model = get_peft_model(hf_model(model_dir), LoraConfig(r=4, lora_alpha=8, target_modules=names))
    params = dict(peft_model.named_parameters())
    key = "base_model.model.{}.lora_{}.default.weight"
    with torch.no_grad():
        for module in adapter.module_names():
            for which, p in zip("AB", adapter.pair(module)):
                params[key.format(module, which)].copy_(p)
    peft_model.eval()
    for d in data:
        targets = torch.tensor(d.target_tokens)
        active = targets >= 0
        logits = peft_model(torch.tensor([d.tokens])).logits[0]
        logp = logits.float().log_softmax(-1)[active].gather(1, targets[active, None])[:, 0]
        (-(torch.tensor(d.weights)[active] * logp).sum()).backward()

    def flat(pair_grads):
        return {m: torch.cat([g.flatten() for g in pair_grads(m)]) for m in adapter.module_names()}

    got = flat(lambda m: [p.grad for p in adapter.pair(m)])
    got64 = flat(lambda m: [p.grad for p in adapter64.pair(m)])
    want = flat(lambda m: [params[key.format(m, w)].grad for w in "AB"])
    Rounding(got, got64).assert_within(want)


@pytest.fixture(scope="module")
def trained(model, model_dir, tmp_path_factory):
    """A run trained for two steps (shared prefixes on), saved as a sampler checkpoint, with its
    logits on some tokens and their fp64 twin."""
    trainer = Trainer(model, base_model="tiny-qwen3_5", config=TrainerConfig(min_shared_tokens=4))
    trainer.create_run("r", LoRAConfig(rank=8, alpha=16.0))
    randomize(trainer.adapter("r"), 2)
    for seed in (8, 9):
        trainer.forward_backward([("r", Forward(hybrid_data(seed), Loss.parse("cross_entropy")))])
        trainer.optim_step("r", AdamConfig(learning_rate=1e-2))
    path = tmp_path_factory.mktemp("ck") / "weights"
    trainer.save_weights("r", path)
    tokens = torch.tensor([hybrid_data(10)[2].tokens])
    model64 = fp64_model(model_dir)
    adapter = trainer.adapter("r")
    with torch.no_grad():
        want = model(tokens, adapters=AdapterBatch.single(adapter))
        base = model(tokens)
        want64 = model64(tokens, adapters=AdapterBatch.single(fp64_adapter(adapter, model64)))
    assert (want - base).abs().max() > 1e-2  # the adapter matters
    return path, adapter, tokens, want, want64


def test_a_trained_adapter_loads_into_peft_and_back(trained, model, model_dir):
    """The sampler checkpoint names every target PEFT needs: transformers + peft compute its logits
    (kind 3), and loading it back gives the same tensors (kind 1)."""
    from peft import PeftModel

    path, adapter, tokens, want, want64 = trained
    cfg = json.loads((path / "adapter_config.json").read_text())
    assert {"in_proj_qkv", "in_proj_z", "in_proj_a", "in_proj_b", "out_proj", "q_proj"} <= set(
        cfg["target_modules"]
    )
    peft_model = PeftModel.from_pretrained(hf_model(model_dir), str(path)).eval()
    with torch.no_grad():
        Rounding(want, want64).assert_within(peft_model(tokens).logits)
    back, lora = load_peft_adapter(model, path)
    assert lora == LoRAConfig(rank=8, alpha=16.0)
    assert_bitwise(dict(adapter.named_parameters()), dict(back.named_parameters()))


def test_an_adapter_saved_by_peft_on_linear_attention_loads(model, model_dir, tmp_path):
    """An adapter trained elsewhere on a linear-attention projection only (no trine metadata)."""
    peft_model = saved_by_peft(hf_model(model_dir), ["in_proj_qkv"], tmp_path / "ext")
    adapter, lora = load_peft_adapter(model, tmp_path / "ext")
    assert (lora.train_attn, lora.train_mlp, lora.train_unembed) == (True, False, False)
    tokens = torch.tensor([[7, 70, 700, 4000, 12, 5]])
    model64 = fp64_model(model_dir)
    with torch.no_grad():
        got = model(tokens, adapters=AdapterBatch.single(adapter))
        got64 = model64(tokens, adapters=AdapterBatch.single(fp64_adapter(adapter, model64)))
        Rounding(got, got64).assert_within(peft_model(tokens).logits)


def test_exports_give_the_adapters_logits_in_transformers(trained, tmp_path):
    """`trine export --merged` of a hybrid model's adapter: transformers' `Qwen3_5ForCausalLM` on the
    merged weights, and peft on the base with the adapter `trine export` writes, both compute
    trine's adapter logits (kind 3; the tied embeddings untied, the unembedding being adapted)."""
    from peft import AutoPeftModelForCausalLM

    path, _, tokens, want, want64 = trained
    for args, out in ((["--merged"], tmp_path / "merged"), ([], tmp_path / "adapter")):
        r = CliRunner().invoke(main, ["export", str(path), str(out), *args])
        assert r.exit_code == 0, r.output
    assert json.loads((tmp_path / "merged" / "config.json").read_text())["tie_word_embeddings"] is False
    merged = hf_model(tmp_path / "merged")
    assert type(merged).__name__ == "Qwen3_5ForCausalLM"
    on_base = AutoPeftModelForCausalLM.from_pretrained(str(tmp_path / "adapter"), dtype=torch.float32).eval()
    with torch.no_grad():
        for theirs in (merged(tokens).logits, on_base(tokens).logits):
            Rounding(want, want64).assert_within(theirs)


def test_merged_export_of_a_multimodal_checkpoint_folds_into_its_language_model(trained, model_dir, tmp_path):
    """A `qwen3_5` checkpoint keeps its language model under `model.language_model.`: the merge
    lands there, the vision tower is kept as it is, and trine loads the result with the adapter's
    logits (the same weights as the text export's merge: kind 1)."""
    from safetensors.torch import load_file, save_file

    path, *_ = trained
    base = tmp_path / "multimodal"
    base.mkdir()
    state = load_file(str(model_dir / "model.safetensors"))
    state = {"model.language_model." + k[6:] if k.startswith("model.") else k: v for k, v in state.items()}
    state["model.visual.patch_embed.proj.weight"] = torch.ones(4, 3)
    save_file(state, str(base / "model.safetensors"))
    text_cfg = json.loads((model_dir / "config.json").read_text())
    config = {"model_type": "qwen3_5", "tie_word_embeddings": True, "text_config": text_cfg}
    (base / "config.json").write_text(json.dumps(config))
    for out, src in ((tmp_path / "mm", base), (tmp_path / "text", model_dir)):
        r = CliRunner().invoke(main, ["export", str(path), str(out), "--merged", "--base", str(src)])
        assert r.exit_code == 0, r.output
    mm, text = (
        load_file(str(tmp_path / "mm" / "model.safetensors")),
        load_file(str(tmp_path / "text" / "model.safetensors")),
    )
    assert torch.equal(mm["model.visual.patch_embed.proj.weight"], torch.ones(4, 3))
    renamed = {"model.language_model." + k[6:] if k.startswith("model.") else k: v for k, v in text.items()}
    assert_bitwise({k: v for k, v in mm.items() if "visual" not in k}, renamed)
    cfg = json.loads((tmp_path / "mm" / "config.json").read_text())
    assert cfg["tie_word_embeddings"] is False is cfg["text_config"]["tie_word_embeddings"]


# ----------------------------------------------------------------------------- checkpoints
def test_load_state_with_optimizer_resumes_exactly(model, tmp_path):
    adam = AdamConfig(learning_rate=1e-3, weight_decay=0.01, grad_clip_norm=1.0)
    batches = [hybrid_data(s)[:4] for s in range(11, 14)]

    def step(trainer, run, data):
        trainer.forward_backward([(run, Forward(data, Loss.parse("cross_entropy")))])
        return trainer.optim_step(run, adam)

    a = Trainer(model, base_model="tiny")
    a.create_run("r", LoRAConfig(rank=4, seed=1))
    step(a, "r", batches[0])
    a.save_state("r", tmp_path / "state")
    b = Trainer(model, base_model="tiny")
    b.load_state("resumed", tmp_path / "state", with_optimizer=True)
    for data in batches[1:]:  # kind 1: the same steps, in the same order, from the same state
        assert step(a, "r", data) == step(b, "resumed", data)
    assert_bitwise(dict(a.adapter("r").named_parameters()), dict(b.adapter("resumed").named_parameters()))
