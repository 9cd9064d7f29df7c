"""Sampler = trainer, bit for bit: a sampled token's logprob is exactly (== in fp32) the one
compute_logprobs and the trainer's forward give it, whatever the batch, the cache split, the
prefill chunking, the packing of samples or the thread count; seeded samples are identical alone,
batched, cached or not."""

from __future__ import annotations

import dataclasses
import random

import pytest
import torch

from trine.engine.api import Forward, LoRAConfig, Loss, SampleRequest, SamplingOptions, TrainDatum
from trine.engine.config import SamplerConfig, TrainerConfig
from trine.engine.model import invariant
from trine.engine.model.tokenizer import Tokenizer
from trine.engine.model.weights import load_model
from trine.engine.sampler.sampler import Sampler
from trine.engine.trainer.trainer import Trainer


@pytest.fixture(autouse=True)
def batch_invariant():
    """These tests pin the batch-invariant kernels (opt-in: `trine serve --batch-invariant`). Their
    comparisons are kind 1 (tests/tolerance.py), the contract being exact, on every kernel path
    (`make test-portable` runs them on the second one)."""
    invariant.enable(True)
    yield
    invariant.enable(False)


MB = 2**20
_ids = iter(range(10**9))


@pytest.fixture()
def threads(request):
    old = torch.get_num_threads()
    torch.set_num_threads(request.param)
    yield request.param
    torch.set_num_threads(old)


def setup(model_dir):
    """A model, a trainer run whose LoRA adapter is not the identity, and its weights."""
    model = load_model(model_dir, "cpu")
    trainer = Trainer(model, base_model="tiny", config=TrainerConfig(micro_batch_tokens=256))
    trainer.create_run("r", LoRAConfig(rank=4))
    with torch.no_grad():
        for b in trainer.adapter("r").B.values():
            b.normal_(0, 0.05, generator=torch.Generator().manual_seed(1))
    return model, Tokenizer(model_dir), trainer


def sample_req(trainer, p, n=1, generate=True):
    opts = SamplingOptions(max_tokens=7, temperature=1.0, seed=11, stop_at_eos=False)
    return (
        SampleRequest(
            f"n{next(_ids)}", list(p), opts, trainer.weights_identity("r"), num_samples=n, generate=generate
        ),
        trainer.snapshot("r"),
    )


def prompts() -> list[list[int]]:
    rng = random.Random(3)
    base = [rng.randrange(100, 40000) for _ in range(150)]
    tail = [rng.randrange(100, 40000) for _ in range(30)]
    # lengths across block and key-tile boundaries; the last shares 40 tokens with the first, so
    # once the first is cached it starts from a cached prefix; 150 tokens take several prefill chunks
    return [base, [7, 8, 9], base[:16], base[:37], base[:53], base[:40] + tail]


@pytest.mark.parametrize(
    "family,threads",
    [
        ("llama", 1),
        ("llama", 2),
        pytest.param("qwen2", 1, marks=pytest.mark.slow),
        pytest.param("qwen3", 1, marks=pytest.mark.slow),
        # sliding-window layers read a context cut to the window (sliding_window.py); with every
        # layer windowed, the blocks that slid out are freed as the sequences run (window.py)
        ("gemma3-sliding", 1),
        pytest.param("gemma3", 1, marks=pytest.mark.slow),
        pytest.param("olmo3", 1, marks=pytest.mark.slow),
    ],
    indirect=["threads"],
)
def test_sampler_compute_logprobs_and_trainer_agree_exactly(
    tiny_model_dirs, tiny_windowed_dirs, family, threads
):
    model, tok, trainer = setup({**tiny_model_dirs, **tiny_windowed_dirs}[family])
    ps = prompts()
    samples = [1, 3, 1, 2, 4, 2]
    new = lambda: Sampler(model, tok, SamplerConfig(kv_cache_bytes=16 * MB))  # noqa: E731
    batched = new()
    first = batched.run([sample_req(trainer, ps[0], samples[0])])  # caches the shared prefix
    together = first + batched.run([sample_req(trainer, p, n) for p, n in zip(ps[1:], samples[1:])])
    # the cache split is exercised: full blocks, and the first tokens of a cached block copied
    assert [r.usage.cached_tokens for r in together] == [0, 0, 15, 36, 52, 40]
    alone = [new().run([sample_req(trainer, p, n)])[0] for p, n in zip(ps, samples)]
    data, want = [], []
    for p, a, b in zip(ps, alone, together):
        for sa, sb in zip(a.sequences, b.sequences):
            assert sa.tokens == sb.tokens  # seeded: alone = batched = cached
            assert sa.logprobs == sb.logprobs
            data.append(
                TrainDatum(tokens=p + sa.tokens[:-1], target_tokens=[-100] * (len(p) - 1) + sa.tokens)
            )
            want.append(sa.logprobs)
    fwd = trainer.forward_backward([("r", Forward(data, Loss.parse("cross_entropy")))], backward=False)[0]
    computed = batched.run(
        [sample_req(trainer, d.tokens + d.target_tokens[-1:], generate=False) for d in data]
    )
    for w, t, c in zip(want, fwd.logprobs, computed):
        assert t[-len(w) :] == w  # the trainer's forward, padded into micro-batches with the others
        assert c.prompt_logprobs[-len(w) :] == w  # compute_logprobs, with other requests in its prefill


def test_cached_prompt_scores_are_the_fresh_ones_bit_for_bit(tiny_model_dir):
    """Scores served with cached KV blocks (the OpenAI plane's reuse) equal a fresh prefill's."""
    model, tok, trainer = setup(tiny_model_dir)
    ps = prompts()

    def scoring(p, reuse):
        r, adapter = sample_req(trainer, p, generate=False)
        return dataclasses.replace(
            r, prompt_logprobs=True, topk_prompt_logprobs=3, reuse_prompt_scores=reuse
        ), adapter

    warm = Sampler(model, tok, SamplerConfig(kv_cache_bytes=16 * MB))
    warm.run([scoring(ps[0], True)])  # keys base's blocks with their scores
    served = warm.run([scoring(p, True) for p in ps[3:]])
    assert [r.usage.cached_tokens for r in served] == [32, 48, 32]  # base[:37], base[:53], base[:40] + tail
    for p, got in zip(ps[3:], served):
        fresh = Sampler(model, tok, SamplerConfig(kv_cache_bytes=16 * MB)).run([scoring(p, False)])[0]
        assert got.prompt_logprobs == fresh.prompt_logprobs
        assert got.topk_prompt_logprobs == fresh.topk_prompt_logprobs
