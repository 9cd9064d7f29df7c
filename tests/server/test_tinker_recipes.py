"""Slow tier: cookbook-shaped loops with the official tinker client on the real SmolLM2 weights.

tests/server/test_tinker_cookbook.py runs tinker-cookbook 0.6.1's recipes themselves; these loops are the
same recipes written with the client directly, small enough to read line by line:
- `sl_basic`: supervised learning on chat conversations, loss on the assistant tokens only,
  weights 1/N (Tinker sums), `submit_ahead` pipelining;
- `math_rl` with the arithmetic environment ("What is x + y?", a few-shot prefix, max_tokens 5,
  groups of 4, advantages centred per group; operands below 10 rather than the recipe's 100, which a
  135M model never gets right), once with `importance_sampling` and once with
  `stable_reinforce` (sampled with `record_stability_info`, tokens named by provenance spans).
Run `python tests/server/test_tinker_recipes.py` to print the figures docs/benchmarks.md quotes
("tinker-cookbook recipes").
"""

from __future__ import annotations

import dataclasses
import os
import random
import re

import pytest

tinker = pytest.importorskip("tinker")
from tinker import types  # noqa: E402

CONVERSATIONS = [
    ("What is the capital of France?", "The capital of France is Paris."),
    ("Name a primary color.", "Red is a primary color."),
    ("How many legs does a spider have?", "A spider has eight legs."),
    ("What do bees make?", "Bees make honey."),
    ("What is frozen water called?", "Frozen water is called ice."),
    ("Which planet is known as the red planet?", "Mars is known as the red planet."),
    ("What is the opposite of hot?", "The opposite of hot is cold."),
    ("How many days are in a week?", "There are seven days in a week."),
]
FEWSHOT = [{"role": "user", "content": "What is 4 + 5?"}, {"role": "assistant", "content": "9"}]


def chat_datum(tok, question: str, answer: str, scale: float) -> types.Datum:
    prompt = tok.apply_chat_template(
        [{"role": "user", "content": question}], add_generation_prompt=True, tokenize=True, return_dict=False
    )
    full = tok.apply_chat_template(
        [{"role": "user", "content": question}, {"role": "assistant", "content": answer}],
        tokenize=True,
        return_dict=False,
    )
    weights = [0.0] * (len(prompt) - 1) + [scale] * (len(full) - len(prompt))
    return types.Datum(
        model_input=types.ModelInput.from_ints(full[:-1]),
        loss_fn_inputs={"target_tokens": full[1:], "weights": weights},
    )


def sl_basic(sc, model: str, steps: int = 8, batch: int = 4, lr: float = 2e-4) -> list[float]:
    """Mean NLL per assistant token, one value per step."""
    tc = sc.create_lora_training_client(base_model=model, rank=16, seed=0).result()
    tok = tc.get_tokenizer()
    rng = random.Random(0)
    batches = []
    for _ in range(steps):
        pairs = rng.sample(CONVERSATIONS, batch)
        raw = [chat_datum(tok, q, a, 1.0) for q, a in pairs]
        n = sum(sum(1 for w in d.loss_fn_inputs["weights"].tolist() if w) for d in raw)
        batches.append(([chat_datum(tok, q, a, 1.0 / n) for q, a in pairs], n))
    pending = [
        (
            tc.forward_backward(batches[0][0], "cross_entropy"),
            tc.optim_step(types.AdamParams(learning_rate=lr)),
        )
    ]
    nll = []
    for i in range(steps):
        if i + 1 < steps:  # submit_ahead = 1
            pending.append(
                (
                    tc.forward_backward(batches[i + 1][0], "cross_entropy"),
                    tc.optim_step(types.AdamParams(learning_rate=lr)),
                )
            )
        fb, opt = pending.pop(0)
        nll.append(fb.result().metrics["loss:sum"])  # weights are 1/N: the mean NLL
        opt.result()
    return nll


def math_rl(
    sc,
    model: str,
    loss_fn: str,
    steps: int = 6,
    groups: int = 8,
    group_size: int = 4,
    lr: float = 3e-4,
    seed: int = 0,
    high: int = 10,
) -> list[float]:
    """Mean reward of each step's samples (before that step's update)."""
    tc = sc.create_lora_training_client(base_model=model, rank=16, seed=seed).result()
    tok = tc.get_tokenizer()
    rng = random.Random(seed)
    record = loss_fn == "stable_reinforce"
    rewards_by_step = []
    for _ in range(steps):
        sampler = tc.save_weights_and_get_sampling_client(record_stability_info=record).result()
        problems = [(rng.randrange(high), rng.randrange(high)) for _ in range(groups)]
        futures = []
        for x, y in problems:
            prompt = tok.apply_chat_template(
                FEWSHOT + [{"role": "user", "content": f"What is {x} + {y}?"}],
                add_generation_prompt=True,
                tokenize=True,
                return_dict=False,
            )
            futures.append(
                (
                    x + y,
                    prompt,
                    sampler.sample(
                        types.ModelInput.from_ints(prompt),
                        group_size,
                        types.SamplingParams(max_tokens=5, temperature=1.0, seed=rng.randrange(1 << 30)),
                    ),
                )
            )
        data, all_rewards = [], []
        for answer, prompt, fut in futures:
            seqs = fut.result().sequences
            rewards = []
            for s in seqs:
                found = re.findall(r"-?\d+", tok.decode(s.tokens).replace(",", ""))
                rewards.append(1.0 if found and int(found[-1]) == answer else 0.0)
            all_rewards += rewards
            mean = sum(rewards) / len(rewards)
            for s, r in zip(seqs, rewards):
                if r == mean or not s.tokens:
                    continue  # no signal in this sample
                full = prompt + list(s.tokens)
                p = len(prompt) - 1
                d = types.Datum(
                    model_input=types.ModelInput.from_ints(full[:-1]),
                    loss_fn_inputs={
                        "target_tokens": full[1:],
                        "logprobs": [0.0] * p + list(s.logprobs),
                        "advantages": [0.0] * p + [r - mean] * len(s.tokens),
                    },
                )
                if record:
                    d = d.with_provenance(
                        model_input=[
                            types.PromptProvenanceSpan(sequence_id=s.sequence_id, length=len(prompt)),
                            types.SampledProvenanceSpan(sequence_id=s.sequence_id, length=len(s.tokens) - 1),
                        ],
                        loss_fn_inputs=[
                            types.PromptProvenanceSpan(sequence_id=s.sequence_id, offset=1, length=p),
                            types.SampledProvenanceSpan(sequence_id=s.sequence_id, length=len(s.tokens)),
                        ],
                    )
                data.append(d)
        rewards_by_step.append(sum(all_rewards) / len(all_rewards))
        if data:
            tc.forward_backward(data, loss_fn)
            tc.optim_step(types.AdamParams(learning_rate=lr)).result()
    return rewards_by_step


def _serve_default(tmp):
    from serverutil import TEST_ENGINE, serve

    from trine.engine.config import SamplerConfig, TrainerConfig
    from trine.engine.model.default_model import ensure_default_model

    model_dir = ensure_default_model()
    os.environ.update(TINKER_TELEMETRY="0", HF_HUB_OFFLINE="1", NO_PROXY="127.0.0.1,localhost")
    return serve(
        model_dir,
        tmp,
        engine=dataclasses.replace(
            TEST_ENGINE,
            sampler=SamplerConfig(kv_cache_bytes=256 << 20, max_batch_tokens=2048),
            trainer=TrainerConfig(micro_batch_tokens=4096),
        ),
    ), model_dir.name


@pytest.mark.slow
def test_sl_basic_and_math_rl_shaped_loops_on_smollm2(tmp_path):
    ctx, model = _serve_default(tmp_path / "home")
    with ctx as srv:
        sc = tinker.ServiceClient(base_url=srv.url, api_key="tml-" + srv.api_key)
        try:
            nll = sl_basic(sc, model)
            assert nll[-1] < 0.6 * nll[0], nll
            for loss in ("importance_sampling", "stable_reinforce"):
                rewards = math_rl(sc, model, loss)
                assert len(rewards) == 6 and all(0.0 <= r <= 1.0 for r in rewards), rewards
        finally:
            sc.close("success").result()


if __name__ == "__main__":  # the figures for docs/benchmarks.md
    import sys
    import tempfile
    import time

    sys.path.insert(0, os.path.dirname(os.path.dirname(__file__)))  # tests/: serverutil
    ctx, model = _serve_default(tempfile.mkdtemp())
    with ctx as srv:
        sc = tinker.ServiceClient(base_url=srv.url, api_key="tml-" + srv.api_key)
        t = time.time()
        print(
            "sl_basic mean NLL per step:",
            [round(x, 3) for x in sl_basic(sc, model)],
            f"({time.time() - t:.0f} s)",
        )
        for loss in ("importance_sampling", "stable_reinforce"):
            t = time.time()
            print(
                f"math_rl {loss} mean reward per step:",
                [round(x, 3) for x in math_rl(sc, model, loss, steps=int(os.environ.get("STEPS", 6)))],
                f"({time.time() - t:.0f} s)",
            )
        sc.close("success").result()
