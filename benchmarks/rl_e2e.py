"""End-to-end GRPO: trine (its SDK on an embedded server) vs TRL's GRPOTrainer (peft LoRA,
transformers generation), on CPU, each in its own process, interleaved step by step.

The same job on both sides: SmolLM2-135M-Instruct fp32; LoRA rank 16, alpha 32, no dropout, on
q/k/v/o/gate/up/down; each step 8 fresh addition problems x 8 samples (temperature 1, up to 96 new
tokens, ending at the end-of-turn token); reward 1 when the first number in the reply is the sum;
group-normalised advantages (r - mean) / (std + 1e-4) (TRL's default scaling); one AdamW step at
lr 1e-5 on all 64 samples; 5 steps. trine trains with `importance_sampling` on the sampler's own
logprobs; TRL with its default GRPO loss (dapo, beta 0, one iteration per generation).

Interleaving: TRL runs in a child process whose callback, after each TRL step, waits while this
process runs one trine step, so both see the same machine state and never compute at once. They
are separate processes as they would be for a user, who runs one or the other: in one process,
trine's sampler thread ran 1.5x slower once TRL's main thread had computed (libgomp cuts every
thread pool's spin to its "throttled" count when it counts more OpenMP threads than cores; since
2026-12-02 trine.engine's default, OMP_WAIT_POLICY=ACTIVE with GOMP_SPINCOUNT, raises that count
from 100 to 1000: docs/serving.md#shared-cpu-cores).

Times per step: trine = sampling (save_weights_and_get_sampling_client + the 8 group
requests) + training (forward_backward + optim_step); TRL = generation (`GRPOTrainer._generate`)
+ the rest of its step (scoring, logprob forward, loss, backward, optimizer).

    pip install -e '.[bench]'   # TRL, for this benchmark only
    python benchmarks/rl_e2e.py [--steps 5] [--prompts 8] [--group 8] [--new 96] [--json]

Keys: trine_step_s and trl_step_s (medians over the steps), trine_vs_trl_steps_per_hour
(= trl_step_s / trine_step_s), and the phase medians of each side.
"""

from __future__ import annotations

import argparse
import contextlib
import multiprocessing as mp
import random
import re
import statistics
import sys
import tempfile
import time
from pathlib import Path

from trine.engine.setup import configure

configure()  # before torch loads: the engine's OpenMP wait and allocator, as under `trine serve`

# isort: split

import torch
from report import emit  # benchmarks/report.py

QUESTION = "What is {a} + {b}? Reply with the number only."
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def reward(text: str, answer: int) -> float:
    m = re.search(r"-?\d+", text.replace(",", ""))
    return 1.0 if m and int(m.group()) == answer else 0.0


def advantages(rewards: list[float]) -> list[float]:
    """TRL's default group scaling: (r - mean) / (std + 1e-4), std unbiased."""
    mean = statistics.fmean(rewards)
    std = statistics.stdev(rewards) if len(rewards) > 1 else 0.0
    return [(r - mean) / (std + 1e-4) for r in rewards]


class TrineSide:
    """The GRPO job through trine's SDK on an embedded server."""

    def __init__(self, model_dir: Path, home: Path, args):
        import trine as trio
        from trine.server.app import start_server

        self.trio, self.args = trio, args
        self.server = start_server(models=[model_dir], home=home, port=0)
        self.service = trio.ServiceClient(api_key=self.server.api_key, base_url=self.server.url)
        self.trainer = self.service.create_lora_training_client(
            base_model=model_dir.name, rank=16, seed=0, train_unembed=False
        )
        self.tok = self.trainer.get_tokenizer()
        self.params = trio.SamplingParams(max_tokens=args.new, temperature=1.0, stop=["<|im_end|>"])
        self.times: list[tuple[float, float]] = []  # (sample s, train s) per step
        self.rewards: list[float] = []

    def step(self, problems: list[tuple[int, int]]) -> None:
        trio = self.trio
        t0 = time.perf_counter()
        sampler = self.trainer.save_weights_and_get_sampling_client()
        prompts = [
            self.tok.encode(
                self.tok.apply_chat_template(
                    [{"role": "user", "content": QUESTION.format(a=a, b=b)}],
                    tokenize=False,
                    add_generation_prompt=True,
                ),
                add_special_tokens=False,
            )
            for a, b in problems
        ]
        futures = [
            sampler.sample(
                trio.ModelInput.from_ints(p), num_samples=self.args.group, sampling_params=self.params
            )
            for p in prompts
        ]
        data, rewards = [], []
        for (a, b), prompt, fut in zip(problems, prompts, futures):
            seqs = fut.result().sequences
            group = [reward(s.text or "", a + b) for s in seqs]
            rewards += group
            for s, adv in zip(seqs, advantages(group)):
                n = len(prompt) - 1
                data.append(
                    trio.Datum(
                        model_input=trio.ModelInput.from_ints((prompt + s.tokens)[:-1]),
                        loss_fn_inputs={
                            "target_tokens": [-100] * n + list(s.tokens),
                            "logprobs": [0.0] * n + list(s.logprobs),
                            "advantages": [0.0] * n + [adv] * len(s.tokens),
                        },
                    )
                )
        t1 = time.perf_counter()
        fb = self.trainer.forward_backward(data, "importance_sampling")
        opt = self.trainer.optim_step(trio.AdamParams(learning_rate=self.args.lr))
        fb.result(), opt.result()
        self.times.append((t1 - t0, time.perf_counter() - t1))
        self.rewards.append(statistics.fmean(rewards))
        log(
            f"  trine step {len(self.times)}: sample {t1 - t0:.1f}s train {self.times[-1][1]:.1f}s "
            f"reward {self.rewards[-1]:.3f}"
        )

    def close(self) -> None:
        self.service.close()
        self.server.stop()


def trl_job(model_dir: Path, out: Path, problems: list[list[tuple[int, int]]], args, between_steps):
    """TRL's GRPOTrainer on the same problems; `between_steps()` runs after each of its steps.
    Returns per step (generation s, total s) and the mean reward per step."""
    from datasets import Dataset
    from peft import LoraConfig
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    rows = [
        {"prompt": [{"role": "user", "content": QUESTION.format(a=a, b=b)}], "answer": a + b}
        for step in problems
        for a, b in step
    ]

    def trl_reward(completions, answer, **_):
        return [reward(c[0]["content"] if isinstance(c, list) else c, x) for c, x in zip(completions, answer)]

    times, gen, rewards = [], [], []

    class Interleave(TrainerCallback):
        def on_step_begin(self, *a, **k):
            self.t = time.perf_counter()

        def on_step_end(self, *a, **k):
            times.append(time.perf_counter() - self.t)
            log(f"  TRL step {len(times)}: generate {gen[-1]:.1f}s total {times[-1]:.1f}s")
            between_steps()

        def on_log(self, _args, _state, _control, logs=None, **k):
            if logs and "reward" in logs:
                rewards.append(logs["reward"])

    config = GRPOConfig(
        output_dir=str(out),
        per_device_train_batch_size=args.prompts * args.group,
        num_generations=args.group,
        max_completion_length=args.new,
        max_steps=args.steps,
        learning_rate=args.lr,
        lr_scheduler_type="constant",
        temperature=1.0,
        beta=0.0,
        use_cpu=True,
        bf16=False,
        fp16=False,
        logging_steps=1,
        report_to=[],
        save_strategy="no",
        shuffle_dataset=False,
        seed=0,
        dataloader_num_workers=0,
        disable_tqdm=True,
    )
    tok = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    peft = LoraConfig(r=16, lora_alpha=32, lora_dropout=0.0, target_modules=TARGETS, task_type="CAUSAL_LM")
    trainer = GRPOTrainer(
        model=model,
        reward_funcs=trl_reward,
        args=config,
        train_dataset=Dataset.from_list(rows),
        processing_class=tok,
        peft_config=peft,
        callbacks=[Interleave()],
    )
    generate = trainer._generate

    def timed_generate(prompts):
        t = time.perf_counter()
        res = generate(prompts)
        gen.append(time.perf_counter() - t)
        return res

    trainer._generate = timed_generate
    with contextlib.redirect_stdout(sys.stderr):  # TRL prints its logs; stdout is for --json
        trainer.train()
    return list(zip(gen, times)), rewards


def trl_child(model_dir: Path, out: Path, problems, args, conn) -> None:
    """The TRL side in its own process: after each of its steps, hands the machine to the parent
    for one trine step; sends back (per-step times, rewards) at the end."""

    def between_steps():
        conn.send("step")
        conn.recv()

    conn.send(trl_job(model_dir, out, problems, args, between_steps))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument(
        "--model", type=Path, help="model directory (default: the embedded SmolLM2-135M-Instruct)"
    )
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--group", type=int, default=8)
    ap.add_argument("--new", type=int, default=96)
    ap.add_argument("--lr", type=float, default=1e-5)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    try:
        import trl  # noqa: F401
    except ImportError:
        sys.exit("benchmarks/rl_e2e.py needs TRL: pip install -e '.[bench]'")
    model_dir = args.model
    if model_dir is None:
        from trine.engine.model.default_model import ensure_default_model

        model_dir = ensure_default_model()
    rng = random.Random(0)
    problems = [
        [(rng.randint(1, 30), rng.randint(1, 30)) for _ in range(args.prompts)] for _ in range(args.steps)
    ]
    with tempfile.TemporaryDirectory() as tmp:
        side = TrineSide(model_dir, Path(tmp) / "home", args)
        ctx = mp.get_context("spawn")
        here, there = ctx.Pipe()
        child = ctx.Process(target=trl_child, args=(model_dir, Path(tmp) / "trl", problems, args, there))
        child.start()
        try:
            while (msg := here.recv()) == "step":
                side.step(problems[len(side.times)])
                here.send("go")
            trl_steps, trl_rewards = msg
        finally:
            child.join(60)
            side.close()
    trine_total = [a + b for a, b in side.times]
    trine_step, trl_step = statistics.median(trine_total), statistics.median(t for _, t in trl_steps)
    trl_gen = statistics.median(g for g, _ in trl_steps)
    out = dict(
        model=str(model_dir),
        steps=args.steps,
        prompts=args.prompts,
        group=args.group,
        new_tokens=args.new,
        threads=torch.get_num_threads(),
        trine_step_s=trine_step,
        trl_step_s=trl_step,
        trine_vs_trl_steps_per_hour=trl_step / trine_step,
        trine_sample_s=statistics.median(a for a, _ in side.times),
        trine_train_s=statistics.median(b for _, b in side.times),
        trl_generate_s=trl_gen,
        trl_train_s=statistics.median(t - g for g, t in trl_steps),
        trine_steps_s=trine_total,
        trl_steps_s=[t for _, t in trl_steps],
        trine_reward=side.rewards,
        trl_reward=trl_rewards,
    )
    emit(out, args.json)


if __name__ == "__main__":
    main()
