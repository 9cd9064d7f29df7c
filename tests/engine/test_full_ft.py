"""Full-parameter fine-tuning (engine/trainer/full.py): a run that owns a copy of the model and trains
its weights with AdamW on fp32 masters, beside LoRA runs on the shared base."""

from __future__ import annotations

import copy

import pytest
import torch
from test_losses import random_data
from tolerance import Rounding, assert_bitwise, assert_same_computation

from trine.engine.api import AdamConfig, Forward, LoRAConfig, Loss, TrainDatum
from trine.engine.config import TrainerConfig
from trine.engine.model.weights import load_model
from trine.engine.trainer.full import tuning_shape
from trine.engine.trainer.trainer import InsufficientMemory, Trainer

FULL = LoRAConfig(rank=0)
CE = Loss.parse("cross_entropy")


@pytest.fixture(scope="module")
def model(tiny_model_dir):
    return load_model(tiny_model_dir, "cpu")


def full_trainer(model, shape=FULL, **kw) -> Trainer:
    trainer = Trainer(model, base_model="tiny", **kw)
    trainer.create_run("f", shape)
    return trainer


def params(m) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in m.named_parameters()}


def shared_data(seed: int) -> list[TrainDatum]:
    """Two datums sharing a 20-token prompt (the shared-prefix path computes it once) and one more."""
    g = torch.Generator().manual_seed(seed)
    prompt = torch.randint(3, 2000, (20,), generator=g).tolist()
    out = []
    for n in (7, 11):
        toks = prompt + torch.randint(3, 2000, (n,), generator=g).tolist()
        out.append(TrainDatum(tokens=toks[:-1], target_tokens=[-100] * 19 + toks[20:]))
    return out + random_data(seed, lengths=(9,))


def test_a_full_step_equals_plain_autograd_and_torch_adamw(model, tiny_model64):
    """Two steps of a full run (its rows through the shared-prefix path and the plain one, the LM
    head in chunks, gradients into the masters) against the plainest training of the same model: a
    copy whose every weight requires grad, the summed weighted token losses of the whole logits
    backpropagated at once, and torch's AdamW. Logprobs and every weight's update agree (tolerance.py,
    kind 3; the model's forward against transformers' is test_model_parity's). eps is above the
    gradients' rounding, so an update is a smooth function of its gradient."""
    adam = AdamConfig(learning_rate=1e-2, beta1=0.9, beta2=0.99, eps=1.0, weight_decay=0.1)
    steps = [shared_data(1), shared_data(2)]

    def compute(m):
        ref = copy.deepcopy(m).requires_grad_(True)
        opt = torch.optim.AdamW(ref.parameters(), lr=1e-2, betas=(0.9, 0.99), eps=1.0, weight_decay=0.1)
        trainer = full_trainer(m, config=TrainerConfig(logits_chunk_tokens=7))
        run = trainer.full_weights("f").model
        before = params(run)
        want_lp, got_lp = [], []
        for data in steps:
            res = trainer.forward_backward([("f", Forward(data, CE))])[0]
            assert res.usage.train_tokens < res.usage.sequence_tokens  # the shared prompt once
            got_lp += [torch.tensor(lp, dtype=torch.float32) for lp in res.logprobs]  # as reported
            loss = 0
            for d in data:
                logp = ref(torch.tensor([d.tokens]))[0].log_softmax(-1)
                tgt = torch.tensor(d.target_tokens)
                lp = torch.where(tgt >= 0, logp.gather(1, tgt.clamp(min=0)[:, None])[:, 0], 0.0)
                want_lp.append(lp.detach())
                weights = torch.tensor(d.weights, dtype=m.dtype) if d.weights is not None else 1.0
                loss = loss - (weights * lp).sum()
            loss.backward()
            opt.step()
            opt.zero_grad()
            trainer.optim_step("f", adam)
        ref_params = dict(ref.named_parameters())
        got = {n: p - before[n] for n, p in params(run).items()}
        want = {n: ref_params[n].detach() - before[n] for n in got}
        return {"logprobs": want_lp, "updates": want}, {"logprobs": got_lp, "updates": got}

    assert_same_computation(compute, model, tiny_model64)


def test_a_full_run_cuts_its_micro_batches_at_full_micro_batch_tokens(model, tiny_model64, monkeypatch):
    """A full run's rows go in micro-batches of `full_micro_batch_tokens` (its gradients and AdamW
    state hold the memory that LoRA leaves to activations), and the step is the one a single
    micro-batch computes (kind 3) while a LoRA run keeps `micro_batch_tokens`."""
    from trine.engine.trainer import micro_batch

    sizes = []
    run = micro_batch.run_micro_batch
    monkeypatch.setattr(
        micro_batch, "run_micro_batch", lambda tr, rows, *a: (sizes.append(len(rows)), run(tr, rows, *a))
    )
    data = random_data(3, lengths=(12, 9, 12, 10))
    adam = AdamConfig(learning_rate=1e-2, eps=1.0, weight_decay=0.1)  # eps: an update smooth in its gradient

    def compute(m):
        out = []
        for cut in (4096, 12):
            trainer = full_trainer(m, config=TrainerConfig(full_micro_batch_tokens=cut, prefix_sharing=False))
            before = params(trainer.full_weights("f").model)
            trainer.forward_backward([("f", Forward(data, CE))])
            trainer.optim_step("f", adam)
            after = params(trainer.full_weights("f").model)
            out.append({"updates": {n: after[n] - before[n] for n in after}})
        return out[0], out[1]

    assert_same_computation(compute, model, tiny_model64)
    assert sizes == [4, 1, 1, 1, 1] * 2  # 4096: one micro-batch of 4 rows; 12: one row each
    sizes.clear()
    lora = Trainer(
        model, base_model="tiny", config=TrainerConfig(full_micro_batch_tokens=12, prefix_sharing=False)
    )
    lora.create_run("l", LoRAConfig(rank=4))
    lora.forward_backward([("l", Forward(data, CE))])
    assert sizes == [4]


def test_trainable_token_indices_move_only_their_rows(model):
    """The named embedding rows (here the tied head's too) train; every other row keeps its bits,
    however the optimizer's weight decay and momentum act."""
    rows = (5, 700, 1999)
    shape = LoRAConfig(rank=0, train_attn=False, train_mlp=False, trainable_token_indices=rows)
    trainer = full_trainer(model, shape)
    run = trainer.full_weights("f").model
    for step in range(2):
        trainer.forward_backward([("f", Forward(random_data(step, lengths=(12, 9)), CE))])
        trainer.optim_step("f", AdamConfig(learning_rate=1e-2, weight_decay=0.5))
    emb, base = run.model.embed_tokens.weight.detach(), model.model.embed_tokens.weight.detach()
    others = torch.ones(emb.shape[0], dtype=torch.bool)
    others[list(rows)] = False
    assert_bitwise(emb[others], base[others])
    assert all(not torch.equal(emb[r], base[r]) for r in rows)
    assert_bitwise(  # attention and MLP stay frozen; the norms train
        run.model.layers[0].self_attn.q_proj.weight.detach(), model.model.layers[0].self_attn.q_proj.weight
    )
    assert not torch.equal(run.model.norm.weight, model.model.norm.weight)


def test_a_restored_full_run_continues_bit_for_bit(model, tmp_path):
    adam = AdamConfig(learning_rate=1e-3, weight_decay=0.01)
    data = [random_data(i, lengths=(10, 6)) for i in range(3)]
    a = full_trainer(model)
    for d in data[:2]:
        a.forward_backward([("f", Forward(d, CE))])
        a.optim_step("f", adam)
    a.save_state("f", tmp_path / "state")
    a.forward_backward([("f", Forward(data[2], CE))])
    a.optim_step("f", adam)

    b = Trainer(model, base_model="tiny")
    b.load_state("f", tmp_path / "state", with_optimizer=True)
    b.forward_backward([("f", Forward(data[2], CE))])
    b.optim_step("f", adam)
    assert_bitwise(params(b.full_weights("f").model), params(a.full_weights("f").model))
    # without the optimizer's state the same step goes elsewhere (AdamW's moments matter)
    c = Trainer(model, base_model="tiny")
    c.load_state("f", tmp_path / "state", with_optimizer=False)
    c.forward_backward([("f", Forward(data[2], CE))])
    c.optim_step("f", adam)
    norm = [t.full_weights("f").model.model.norm.weight for t in (a, c)]
    assert not torch.equal(*norm)


def test_bf16_weights_keep_fp32_masters_that_accumulate_small_updates(tiny_model_dir, tmp_path):
    """A bf16 model's weights are their fp32 masters rounded, after every step; updates below half a
    bf16 ulp move the master, not the weight, until they add up. The masters survive a restore."""
    m16 = load_model(tiny_model_dir, "cpu", torch.bfloat16)
    trainer = full_trainer(m16)
    full = trainer.full_weights("f")
    slot = next(s for s in full.slots if s.name == "model.norm.weight")
    assert slot.master.dtype == torch.float32 and slot.param.dtype == torch.bfloat16
    start = slot.param.detach().clone()
    tiny_step = AdamConfig(learning_rate=1e-5)  # ~1e-5 per step against a bf16 ulp of ~4e-3 at 1.0
    trainer.forward_backward([("f", Forward(random_data(0, lengths=(8,)), CE))])
    trainer.optim_step("f", tiny_step)
    assert torch.equal(slot.param.detach(), start) and not torch.equal(slot.master, start.float())
    for s in full.slots:
        assert_bitwise(s.param.detach(), s.master.detach().to(torch.bfloat16))
    trainer.save_state("f", tmp_path / "s")
    again = Trainer(m16, base_model="tiny")
    again.load_state("f", tmp_path / "s", with_optimizer=True)
    restored = next(s for s in again.full_weights("f").slots if s.name == "model.norm.weight")
    assert_bitwise(restored.master.detach(), slot.master.detach())


def test_a_run_that_does_not_fit_is_refused_before_it_allocates(model):
    shape = tuning_shape(model, budget_bytes=0)
    need = shape.run_bytes(FULL)
    trainer = Trainer(model, base_model="tiny", full_tuning=tuning_shape(model, budget_bytes=need + 10))
    trainer.create_run("a", FULL)
    with pytest.raises(InsufficientMemory, match=rf"needs {need} bytes.* 10 of the {need + 10} bytes"):
        trainer.create_run("b", FULL)
    assert not trainer.has_run("b")
    trainer.create_run("lora", LoRAConfig(rank=4))  # LoRA runs do not count against it
    trainer.delete_run("a")
    trainer.create_run("b", FULL)


def test_full_and_lora_runs_in_one_call_each_get_what_they_get_alone(model):
    """Two full runs and a LoRA run in one call: each run's rows are computed on its own weights,
    in micro-batches of their own, so batched together or alone they take the same operations in
    the same order (kind 1). The base model never moves."""
    base = params(model)
    data = {"f": random_data(3, lengths=(10, 5)), "g": random_data(5, lengths=(7,)), "l": random_data(4)}

    def make():
        t = full_trainer(model)
        t.create_run("g", LoRAConfig(rank=0, train_unembed=False))
        t.create_run("l", LoRAConfig(rank=4, seed=1))
        return t

    mixed = make()
    together = mixed.forward_backward([(r, Forward(d, CE)) for r, d in data.items()])
    alone = make()
    apart = [alone.forward_backward([(r, Forward(d, CE))])[0] for r, d in data.items()]
    assert [r.logprobs for r in together] == [r.logprobs for r in apart]
    for t in (mixed, alone):
        for run in ("f", "g"):
            t.optim_step(run, AdamConfig(learning_rate=1e-2))
    for run in ("f", "g"):
        assert_bitwise(params(mixed.full_weights(run).model), params(alone.full_weights(run).model))
    assert_bitwise(params(model), base)


def test_a_full_runs_weights_load_in_transformers_with_its_logits(model, tiny_model_dir, tmp_path):
    """A full run's weights save is a Hugging Face directory: transformers computes the run's logits
    from it (kind 3: the run's fp32 model is the reference, transformers' the path, the same weights
    in fp64 the exact value)."""
    from transformers import AutoModelForCausalLM

    trainer = full_trainer(model)
    trainer.forward_backward([("f", Forward(random_data(1, lengths=(12, 9)), CE))])
    trainer.optim_step("f", AdamConfig(learning_rate=1e-2))
    trainer.save_weights("f", tmp_path / "w")
    assert {"config.json", "model.safetensors", "tokenizer.json"} <= {
        f.name for f in (tmp_path / "w").iterdir()
    }
    tokens = torch.tensor([[5, 900, 17, 4000, 23, 8, 4900, 3]])
    run = trainer.full_weights("f").model
    with torch.no_grad():
        ours = run(tokens)
        ours64 = copy.deepcopy(run).double()(tokens)
        theirs = AutoModelForCausalLM.from_pretrained(tmp_path / "w", dtype=torch.float32)(tokens).logits
        base = model(tokens)
    assert (ours - base).abs().max() > 1e-2  # trained
    Rounding(ours, ours64).assert_within(theirs)


def test_full_runs_refuse_dimuon_and_tokens_outside_the_vocabulary(model):
    trainer = Trainer(model, base_model="tiny")
    with pytest.raises(ValueError, match="trains with adamw"):
        trainer.create_run("a", FULL, optimizer="dimuon")
    with pytest.raises(ValueError, match="outside the vocabulary"):
        trainer.create_run("a", LoRAConfig(rank=0, trainable_token_indices=(49152,)))
    assert trainer.num_runs == 0


def test_a_full_run_samples_its_own_weights_never_the_base_models_cache(tiny_model_dir, tmp_path):
    """Through the engine interface: a full run's weights save is a model of its own, sampled by a
    sampler of its own (its prefix cache keyed by the snapshot), spilled to disk as a model
    directory and loaded back; its prompt logprobs are the trainer's forward on the run."""
    import asyncio

    from test_engine_interface import _cycle, _engine
    from tolerance import assert_served_paths

    from trine.engine.api import (
        FORWARD_BACKWARD,
        INIT_RUN,
        OPTIMIZE_STEP,
        SAVE_WEIGHTS,
        InitRun,
        OptimStep,
        SampleRequest,
        SamplingOptions,
        Save,
        WeightsIdentity,
    )

    prompt = list(range(300, 340))  # two full 16-token blocks and 8 more
    data = [TrainDatum(prompt, prompt[1:] + [-100], [1.0] * 40)]

    def req(rid, ck=None, **kw):
        opts = SamplingOptions(max_tokens=3, temperature=0.0, stop_at_eos=False)
        return SampleRequest(rid, prompt, opts, WeightsIdentity("tiny", ck), **kw)

    async def main():
        eng = _engine(tiny_model_dir)
        info = await eng.start()
        try:
            assert info.full_tuning.params == sum(p.numel() for p in load_model(tiny_model_dir).parameters())
            assert info.linear_shapes["model.layers.0.self_attn.q_proj"] == (96, 96)
            res = await eng.run_cycle(
                _cycle(
                    1,
                    "f",
                    ("e1", INIT_RUN, InitRun(FULL)),
                    ("e2", FORWARD_BACKWARD, Forward(data, CE)),
                    ("e3", OPTIMIZE_STEP, OptimStep(AdamConfig(learning_rate=1e-2))),
                    ("e4", SAVE_WEIGHTS, Save("weights", checkpoint_id="ck1")),
                )
            )
            assert [res.outcomes[e].error for e in ("e1", "e2", "e3", "e4")] == [None] * 4
            base = [await eng.sample(req(f"b{i}")) for i in range(2)]
            assert base[1].usage.cached_tokens == 39  # the base model's blocks are cached...
            tuned = [await eng.sample(req(f"t{i}", "ck1")) for i in range(2)]
            assert tuned[0].usage.cached_tokens == 0  # ...and never served to the run's weights
            assert tuned[1].usage.cached_tokens == 39  # its own cache
            assert tuned[0].sequences[0].logprobs != base[0].sequences[0].logprobs  # trained weights
            scored = await eng.sample(req("s", "ck1", prompt_logprobs=True, generate=False))
            fwd = await eng.run_cycle(
                _cycle(2, "f", ("e5", FORWARD_BACKWARD, Forward(data, CE, backward=False)))
            )
            assert_served_paths(scored.prompt_logprobs[1:], fwd.outcomes["e5"].logprobs[0][:-1])

            inflight = await eng.run_cycle(
                _cycle(3, "f", ("e6", SAVE_WEIGHTS, Save("weights", checkpoint_id="ck9", inflight=True)))
            )
            assert "inflight samplers follow LoRA runs" in inflight.outcomes["e6"].error[1]

            path = str(tmp_path / "snap")
            assert await eng.spill_adapter("ck1", FULL, path) > 0
            assert (tmp_path / "snap" / "model.safetensors").is_file()
            await eng.evict_adapter("ck1")
            assert await eng.load_adapter("ck2", path) > 0
            again = await eng.sample(req("d", "ck2"))
            assert (
                again.sequences[0].logprobs == tuned[0].sequences[0].logprobs
            )  # the same weights, bit for bit
        finally:
            await eng.stop()

    asyncio.run(main())
