"""On-policy distillation from a teacher adapter: the student samples, the teacher grades every
token, and the per-token reverse KL is the (negated) advantage.

    python examples/distill.py [--steps 8] [--teacher-steps 12] [--url URL] [--model DIR]

1. Teacher: a LoRA adapter fine-tuned on `examples/data/chat_sft.jsonl` (one-sentence answers),
   published as a sampler.
2. Student: a fresh LoRA adapter on the same base model. Each step it samples replies to questions
   from the data set (on its current weights); the teacher scores exactly those tokens with
   `compute_logprobs`; each token's advantage is log p_teacher - log p_student, i.e. minus that
   token's contribution to the reverse KL(student || teacher); one `importance_sampling` step with
   the student's sampling logprobs follows.

Printed each step: the student's mean reverse KL per token, which falls as it imitates the teacher
on its own samples (no teacher-written text is ever trained on).
"""

from __future__ import annotations

import json
import random
import statistics
from pathlib import Path

from common import Phases, StepTimer, chat_tokens, connect, end_of_turn, parser, policy_datum, sft_datum

import trine as trio

DATA = Path(__file__).parent / "data" / "chat_sft.jsonl"


def main(argv=None) -> dict:
    p = parser(__doc__, steps=8)
    p.add_argument("--teacher-steps", type=int, default=12, help="SFT steps that train the teacher first.")
    p.add_argument("--prompts", type=int, default=4, help="Prompts the student answers per step.")
    p.add_argument("--group", type=int, default=4, help="Student samples per prompt.")
    p.add_argument("--lr", type=float, default=5e-4, help="The student's Adam learning rate.")
    args = p.parse_args(argv)
    rows = [json.loads(line)["messages"] for line in DATA.read_text().splitlines() if line.strip()]
    rng = random.Random(args.seed)
    curve = []
    with connect(args) as conn:
        service, model = conn.service, conn.model
        phases = Phases(service)
        with phases("teacher SFT"):
            teacher = service.create_lora_training_client(base_model=model, rank=16, seed=args.seed)
            tok = teacher.get_tokenizer()
            eot = end_of_turn(tok)
            data = [
                sft_datum(
                    chat_tokens(tok, m[:-1], generation_prompt=True),
                    tok.encode(m[-1]["content"], add_special_tokens=False) + [eot],
                )
                for m in rows
            ]
            teacher_timer = StepTimer(service, args.teacher_steps)
            for step in range(args.teacher_steps):
                fb = teacher.forward_backward(rng.sample(data, 16), "cross_entropy")
                teacher.optim_step(trio.AdamParams(learning_rate=1e-3))
                loss = fb.result().metrics["loss_mean"]
                teacher_timer.done(f"teacher step {step + 1:>3}  loss {loss:.4f}")
            teacher_sampler = teacher.save_weights_and_get_sampling_client()
        if args.teacher_steps:
            print(f"teacher: {args.teacher_steps} SFT steps, last loss {loss:.4f}")
        student = service.create_lora_training_client(base_model=model, rank=16, seed=args.seed + 1)
        params = trio.SamplingParams(max_tokens=24, temperature=1.0, stop=["<|im_end|>"])
        timer = StepTimer(service, args.steps)
        for step in range(args.steps):
            with phases("student samples"):
                sampler = student.save_weights_and_get_sampling_client()
                prompts = [
                    chat_tokens(tok, m[:-1], generation_prompt=True) for m in rng.sample(rows, args.prompts)
                ]
                groups = [
                    sampler.sample(
                        trio.ModelInput.from_ints(pr), num_samples=args.group, sampling_params=params
                    )
                    for pr in prompts
                ]
                samples = [
                    (pr, s) for pr, g in zip(prompts, groups) for s in g.result().sequences if s.tokens
                ]
            with phases("teacher grades"):
                graded = [
                    teacher_sampler.compute_logprobs(trio.ModelInput.from_ints(pr + s.tokens))
                    for pr, s in samples
                ]
                batch, kls = [], []
                for (pr, s), fut in zip(samples, graded):
                    teacher_lp = fut.result()[len(pr) :]
                    advantages = [t - q for t, q in zip(teacher_lp, s.logprobs)]  # -(log q - log p) per token
                    kls += [-a for a in advantages]
                    batch.append(policy_datum(pr, s.tokens, s.logprobs, advantages))
            curve.append(statistics.fmean(kls))
            with phases("student train"):
                fb = student.forward_backward(batch, "importance_sampling")
                opt = student.optim_step(trio.AdamParams(learning_rate=args.lr))
                out, _ = fb.result(), opt.result()
            timer.done(
                f"step {step + 1:>3}  reverse KL per token {curve[-1]:.4f}  ({len(kls)} tokens, "
                f"{len(batch)} samples)  cycle {out.cycle}"
            )
        print("reverse KL curve: " + " ".join(f"{k:.3f}" for k in curve))
        phases.report()
    return {"reverse_kl_curve": curve}


if __name__ == "__main__":
    main()
