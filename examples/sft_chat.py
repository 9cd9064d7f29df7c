"""Supervised fine-tuning on a small chat data set, with the held-out loss before and after.

    python examples/sft_chat.py [--steps 16] [--batch 16] [--url URL] [--model DIR]

The data, `examples/data/chat_sft.jsonl`, is 283 short conversations written for this example
(a system prompt asking for one-sentence answers; arithmetic, unit conversions, capitals, words),
one `{"messages": [...]}` per line, the format most chat data sets use. The last 40 are held out.

Each conversation is rendered with the served model's own chat template; only the assistant's reply
(and its end-of-turn token) is in the loss. Each step submits forward_backward and optim_step
before waiting, so a step is one clock cycle on the server.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

from common import Phases, StepTimer, chat_tokens, connect, end_of_turn, parser, sft_datum

import trine as trio

DATA = Path(__file__).parent / "data" / "chat_sft.jsonl"
HELD_OUT = 40


def to_datum(tokenizer, conversation: dict) -> trio.Datum:
    messages = conversation["messages"]
    prompt = chat_tokens(tokenizer, messages[:-1], generation_prompt=True)
    reply = tokenizer.encode(messages[-1]["content"], add_special_tokens=False) + [end_of_turn(tokenizer)]
    return sft_datum(prompt, reply)


def mean_loss(trainer, data: list[trio.Datum]) -> float:
    """Loss per reply token over `data`, by a forward pass only (no gradient, weights unchanged)."""
    out = trainer.forward(data, "cross_entropy").result()
    return out.metrics["loss_sum"] / out.metrics["token_count"]


def main(argv=None) -> dict:
    p = parser(__doc__, steps=16)
    p.add_argument("--batch", type=int, default=16, help="Conversations per training step.")
    p.add_argument("--lr", type=float, default=1e-3, help="Adam's learning rate.")
    args = p.parse_args(argv)
    rows = [json.loads(line) for line in DATA.read_text().splitlines() if line.strip()]
    train_rows, held_rows = rows[:-HELD_OUT], rows[-HELD_OUT:]
    rng = random.Random(args.seed)
    with connect(args) as conn:
        service, model = conn.service, conn.model
        phases = Phases(service)
        trainer = service.create_lora_training_client(base_model=model, rank=16, seed=args.seed)
        tok = trainer.get_tokenizer()
        train = [to_datum(tok, r) for r in train_rows]
        held = [to_datum(tok, r) for r in held_rows]
        with phases("eval"):
            before = mean_loss(trainer, held)
        print(f"{len(train)} training and {len(held)} held-out conversations; held-out loss {before:.4f}")
        adam = trio.AdamParams(learning_rate=args.lr)
        timer = StepTimer(service, args.steps)
        with phases("train"):
            for step in range(args.steps):
                batch = rng.sample(train, min(args.batch, len(train)))
                fb = trainer.forward_backward(batch, "cross_entropy")
                opt = trainer.optim_step(adam)  # queued behind it: the same clock cycle
                out, _ = fb.result(), opt.result()
                timer.done(
                    f"step {step + 1:>3}  train loss {out.metrics['loss_mean']:.4f}  "
                    f"tokens {out.usage.train_tokens:,} (in loss {out.usage.loss_tokens:,})  "
                    f"cycle {out.cycle}"
                )
        with phases("eval"):
            after = mean_loss(trainer, held)
            sampler = trainer.save_weights_and_get_sampling_client()
            question = held_rows[0]["messages"][:-1]
            reply = sampler.sample(
                trio.ModelInput.from_ints(chat_tokens(tok, question, generation_prompt=True)),
                sampling_params=trio.SamplingParams(max_tokens=32, temperature=0.0, stop=["<|im_end|>"]),
            ).result()
        print(f"held-out loss {before:.4f} -> {after:.4f}")
        print(
            f"held-out question: {question[-1]['content']!r}\n  reply: {reply.sequences[0].text!r}"
            f"\n  reference: {held_rows[0]['messages'][-1]['content']!r}"
        )
        phases.report()
    return {"held_out_before": before, "held_out_after": after}


if __name__ == "__main__":
    main()
