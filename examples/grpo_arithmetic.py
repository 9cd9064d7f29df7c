"""GRPO on generated arithmetic problems with a verifiable reward; prints the reward curve.

    python examples/grpo_arithmetic.py [--steps 10] [--prompts 8] [--group 8] [--lr 3e-4] [--url URL]
                                       [--model DIR]

Each step: a sampler on the current weights, `--prompts` fresh addition problems, `--group`
samples per problem in ONE request (the prompt is prefilled once for the whole group), reward 1 when
the first number in the reply is the sum, group-relative advantages (reward - group mean), and one
`importance_sampling` step with the sampler's own logprobs. A group whose rewards are all equal
teaches nothing and is left out.
"""

from __future__ import annotations

import random
import re
import statistics

from common import Phases, StepTimer, chat_tokens, connect, parser, policy_datum

import trine as trio

QUESTION = "What is {a} + {b}? Reply with the number only."


def reward(text: str, answer: int) -> float:
    m = re.search(r"-?\d+", text.replace(",", ""))
    return 1.0 if m and int(m.group()) == answer else 0.0


def main(argv=None) -> dict:
    p = parser(__doc__, steps=10)
    p.add_argument("--prompts", type=int, default=8, help="Addition problems (groups) per step.")
    p.add_argument("--group", type=int, default=8, help="Samples per problem, sent as one request.")
    # 8 problems at 3e-4 learn within ~10 steps (benchmarks/grpo_dtype.py); 4 at 1e-3 learned nothing in 20
    p.add_argument("--lr", type=float, default=3e-4, help="Adam's learning rate.")
    args = p.parse_args(argv)
    rng = random.Random(args.seed)
    params = trio.SamplingParams(max_tokens=8, temperature=1.0, stop=["<|im_end|>", "\n"])
    curve = []
    with connect(args) as conn:
        service, model = conn.service, conn.model
        phases = Phases(service)
        trainer = service.create_lora_training_client(
            base_model=model, rank=16, seed=args.seed, name="grpo-arithmetic", tags=["example", "grpo"]
        )
        tok = trainer.get_tokenizer()
        timer = StepTimer(service, args.steps)
        for step in range(args.steps):
            with phases("sample"):
                sampler = trainer.save_weights_and_get_sampling_client()
                problems = [(rng.randint(1, 30), rng.randint(1, 30)) for _ in range(args.prompts)]
                prompts = [
                    chat_tokens(
                        tok, [{"role": "user", "content": QUESTION.format(a=a, b=b)}], generation_prompt=True
                    )
                    for a, b in problems
                ]
                futures = [
                    sampler.sample(
                        trio.ModelInput.from_ints(pr), num_samples=args.group, sampling_params=params
                    )
                    for pr in prompts
                ]  # every group in flight at once
                data, rewards = [], []
                for (a, b), prompt, fut in zip(problems, prompts, futures):
                    seqs = fut.result().sequences
                    group = [reward(s.text or "", a + b) for s in seqs]
                    rewards += group
                    mean = statistics.fmean(group)
                    if any(r != mean for r in group):
                        data += [
                            policy_datum(prompt, s.tokens, s.logprobs, [r - mean] * len(s.tokens))
                            for s, r in zip(seqs, group)
                            if s.tokens
                        ]
            curve.append(statistics.fmean(rewards))
            trainer.log_metrics({"reward": curve[-1]}, step=step + 1)  # plotted in the console's run page
            line = f"step {step + 1:>3}  mean reward {curve[-1]:.3f}  "
            if data:
                with phases("train"):
                    fb = trainer.forward_backward(data, "importance_sampling")
                    opt = trainer.optim_step(trio.AdamParams(learning_rate=args.lr))
                    out, _ = fb.result(), opt.result()
                line += f"trained on {len(data)} samples, cycle {out.cycle}"
            else:
                line += "no reward variance in any group: no update"
            timer.done(line)
        print("reward curve: " + " ".join(f"{r:.2f}" for r in curve))
        phases.report()
    return {"reward_curve": curve}


if __name__ == "__main__":
    main()
