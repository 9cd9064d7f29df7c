"""bf16 against fp32: the engine in bfloat16 (what CUDA runs) stays close to fp32, with stated
tolerances, so the GPU path is not untested code.

On CPU by default; `TRINE_TEST_DEVICE=cuda pytest tests/engine/test_dtype_parity.py` runs the same suite
on a GPU. Measured on CPU (tiny random models, 2-core machine) and stated as tolerances:
- sampler vs trainer, fp32 and bf16: the sampled tokens' logprobs equal the trainer's forward
  logprobs bit for bit on CPU (kind 1, tests/tolerance.py: the kernels are batch invariant, in bf16
  too); on CUDA, bf16 within BF16_SELF_ATOL.
- bf16 vs fp32 on the same tokens: logprobs within BF16_VS_FP32_ATOL (mean) / _MAX (measured
  0.005 / 0.022).
- a short LoRA SFT: the bf16 loss curve follows fp32's within SFT_CURVE_RTOL per step, and both
  learn (the 12th loss is under 0.7 of the first); measured within 0.03%.
The bf16 tolerances are product contracts, not rounding models: what bf16 serving may cost a user
against fp32 (bf16's unit roundoff is 2^-9, 65536 x fp32's, through every weight and activation);
they are kept as stated. The fp32 reference itself is compared bit for bit (kind 1).
"""

from __future__ import annotations

import asyncio
import os
import random

import pytest
import torch

from trine.engine.api import (
    AdamConfig,
    Forward,
    LoRAConfig,
    Loss,
    SampleRequest,
    SamplingOptions,
    TrainDatum,
    WeightsIdentity,
)
from trine.engine.config import EngineConfig, SamplerConfig
from trine.engine.model import invariant
from trine.engine.model.tokenizer import Tokenizer
from trine.engine.model.weights import load_model
from trine.engine.runtime.local import LocalEngine
from trine.engine.sampler.sampler import Sampler
from trine.engine.trainer.trainer import Trainer


@pytest.fixture(autouse=True)
def batch_invariant():
    """These tests pin the batch-invariant kernels (opt-in: `trine serve --batch-invariant`)."""
    invariant.enable(True)
    yield
    invariant.enable(False)


DEVICE = os.environ.get("TRINE_TEST_DEVICE", "cpu")
BF16_SELF_ATOL = 0.0 if DEVICE == "cpu" else 0.05  # sampler vs trainer, both bf16
BF16_VS_FP32_ATOL = 0.02  # mean |logprob bf16 - logprob fp32|
BF16_VS_FP32_MAX = 0.1  # the worst token
SFT_CURVE_RTOL = 0.01  # |loss bf16 - loss fp32| / loss fp32, per step
MB = 2**20

if DEVICE == "cuda" and not torch.cuda.is_available():
    pytest.skip("TRINE_TEST_DEVICE=cuda but no GPU is visible", allow_module_level=True)


@pytest.fixture(scope="module")
def models(tiny_model_dir):
    return {dt: load_model(tiny_model_dir, DEVICE, dt) for dt in (torch.float32, torch.bfloat16)}


def trainer_with_adapter(model) -> Trainer:
    trainer = Trainer(model, base_model="tiny")
    trainer.create_run("r", LoRAConfig(rank=4))
    with torch.no_grad():
        for b in trainer.adapter("r").B.values():
            b.copy_(torch.randn(b.shape, generator=torch.Generator().manual_seed(2)).mul_(0.05))
    return trainer


def test_bf16_runs_in_bf16_with_fp32_where_numerics_need_it(models):
    model = models[torch.bfloat16]
    assert model.dtype == torch.bfloat16 and model.lm_head.weight.dtype == torch.bfloat16
    trainer = trainer_with_adapter(model)
    run = trainer._run("r")
    assert all(p.dtype == torch.float32 for p in trainer.adapter("r").parameters())  # LoRA master weights
    s = Sampler(model, Tokenizer(model.source_dir), SamplerConfig(kv_cache_bytes=4 * MB))
    assert s.kv.k.dtype == torch.bfloat16
    logits = model(torch.tensor([[5, 6, 7]], device=model.device))
    assert logits.dtype == torch.float32
    trainer.forward_backward(
        [("r", Forward([TrainDatum([5, 6, 7], [6, 7, 8])], Loss.parse("cross_entropy")))]
    )
    trainer.optim_step("r", AdamConfig(learning_rate=1e-3))
    assert all(
        v.dtype == torch.float32
        for st in run.optimizer.state.values()
        for v in st.values()
        if torch.is_tensor(v) and v.is_floating_point()
    )


def sample_and_score(model, trainer, prompts):
    """Seeded samples of `prompts` from the sampler on `model` with the trainer's adapter: their
    training data, and the logprobs the sampler reported for their tokens."""
    s = Sampler(model, Tokenizer(model.source_dir), SamplerConfig(kv_cache_bytes=8 * MB))
    opts = SamplingOptions(max_tokens=8, temperature=1.0, seed=3, stop_at_eos=False)
    res = s.run(
        [
            (
                SampleRequest(f"p{i}", p, opts, trainer.weights_identity("r"), num_samples=2),
                trainer.snapshot("r"),
            )
            for i, p in enumerate(prompts)
        ]
    )
    data, reported = [], []
    for p, r in zip(prompts, res):
        for seq in r.sequences:
            data.append(TrainDatum(p + seq.tokens[:-1], [-100] * (len(p) - 1) + seq.tokens))
            reported.append(torch.tensor(seq.logprobs))
    return data, reported


def test_bf16_sampler_matches_trainer_and_stays_near_fp32(models):
    rng = random.Random(5)
    prompts = [[rng.randrange(100, 40000) for _ in range(n)] for n in (9, 40, 70)]
    trainers = {dt: trainer_with_adapter(m) for dt, m in models.items()}
    tb = trainers[torch.bfloat16]
    data, want = sample_and_score(models[torch.bfloat16], tb, prompts)
    got = {
        dt: t.forward_backward([("r", Forward(data, Loss.parse("cross_entropy")))], backward=False)[
            0
        ].logprobs
        for dt, t in trainers.items()
    }
    self_diff = max(
        float((torch.tensor(g[-len(w) :]) - w).abs().max()) for g, w in zip(got[torch.bfloat16], want)
    )
    assert self_diff <= BF16_SELF_ATOL  # 0 on CPU: kind 1, the batch-invariant contract
    # the fp32 reference's own contract: its sampler and trainer, bit for bit
    if DEVICE == "cpu":
        data32, want32 = sample_and_score(models[torch.float32], trainers[torch.float32], prompts)
        got32 = (
            trainers[torch.float32]
            .forward_backward([("r", Forward(data32, Loss.parse("cross_entropy")))], backward=False)[0]
            .logprobs
        )
        for g, w in zip(got32, want32):
            assert torch.equal(torch.tensor(g[-len(w) :]), w)
    diffs = torch.cat(
        [
            (torch.tensor(a[-len(w) :]) - torch.tensor(b[-len(w) :])).abs()
            for a, b, w in zip(got[torch.bfloat16], got[torch.float32], want)
        ]
    )
    print(
        f"bf16 vs fp32 logprobs: mean {float(diffs.mean()):.4f} max {float(diffs.max()):.4f}; "
        f"bf16 sampler vs trainer {self_diff}"
    )
    assert float(diffs.mean()) < BF16_VS_FP32_ATOL and float(diffs.max()) < BF16_VS_FP32_MAX


def test_bf16_sft_loss_curve_follows_fp32(models):
    tok = Tokenizer(models[torch.float32].source_dir)
    ids = tok.encode("The secret password is marmalade-42, and the backup is quince-7.")
    datum = TrainDatum(tokens=ids[:-1], target_tokens=[-100] * 2 + ids[3:])
    curves = {}
    for dt, model in models.items():
        trainer = Trainer(model, base_model="tiny")
        trainer.create_run("sft", LoRAConfig(rank=8))
        curve = []
        for _ in range(12):
            curve.append(
                trainer.forward_backward([("sft", Forward([datum] * 2, Loss.parse("cross_entropy")))])[
                    0
                ].loss_mean
            )
            trainer.optim_step("sft", AdamConfig(learning_rate=2e-3))
        curves[dt] = curve
    fp, bf = curves[torch.float32], curves[torch.bfloat16]
    for a, b in zip(fp, bf):
        assert abs(b - a) <= SFT_CURVE_RTOL * a, (fp, bf)
    print("sft loss fp32", [round(x, 4) for x in fp], "bf16", [round(x, 4) for x in bf])
    assert fp[-1] < fp[0] * 0.7 and bf[-1] < bf[0] * 0.7


def test_engine_dtype_option(tiny_model_dir):
    """`trine serve --dtype bfloat16` -> EngineConfig(dtype=...) -> LocalEngine: the engine serves in bf16."""
    with pytest.raises(ValueError, match="dtype"):
        EngineConfig(dtype="float16")

    async def run():
        engine = LocalEngine(
            "tiny",
            tiny_model_dir,
            EngineConfig(
                device=DEVICE, num_threads=1, dtype="bfloat16", sampler=SamplerConfig(kv_cache_bytes=4 * MB)
            ),
        )
        await engine.start()
        try:
            res = await engine.sample(
                SampleRequest(
                    "d", [5, 6, 7], SamplingOptions(max_tokens=3, stop_at_eos=False), WeightsIdentity("tiny")
                )
            )
            return engine.worker.model.dtype, res
        finally:
            await engine.stop()

    dtype, res = asyncio.run(run())
    assert dtype == torch.bfloat16 and len(res.sequences[0].tokens) == 3
