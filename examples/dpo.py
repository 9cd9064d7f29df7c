"""DPO (direct preference optimization) with a frozen reference model, through
`compute_logprobs` and `forward_backward_custom`.

    python examples/dpo.py [--steps 12] [--batch 8] [--beta 0.1] [--url URL] [--model DIR]

Preference pairs come from `examples/data/chat_sft.jsonl`: the chosen reply is the data set's, the
rejected one the same sentence with its answer made wrong (another number, another capital); the
last 30 pairs are held out, the first `--pairs` (96) are trained on. The reference model is the base model: a
sampler on it scores every
reply once with `compute_logprobs`. The DPO loss,

    -log sigmoid(beta * ((logp(chosen) - ref(chosen)) - (logp(rejected) - ref(rejected)))),

is ordinary torch code on the policy's logprobs: `forward_backward_custom` runs a forward pass,
calls it, and sends its gradient back as a linear backward pass, so the server trains exactly
this loss. Printed: the held-out preference accuracy and mean reward margin, before and after.
"""

from __future__ import annotations

import json
import random
import re
from pathlib import Path

from common import Phases, StepTimer, chat_tokens, connect, end_of_turn, parser, sft_datum

import trine as trio

DATA = Path(__file__).parent / "data" / "chat_sft.jsonl"
HELD_OUT = 30
CAPITAL = re.compile(r"^The capital of (.+) is (.+)\.$")
LAST_NUMBER = re.compile(r"\d[\d,]*(?!.*\d)")


def preference_pairs(seed: int) -> list[tuple[list[dict], str, str]]:
    """(prompt messages, chosen reply, rejected reply) for every reply with a checkable answer."""
    rows = [json.loads(line)["messages"] for line in DATA.read_text().splitlines() if line.strip()]
    rng = random.Random(seed)
    cities = sorted({m.group(2) for r in rows if (m := CAPITAL.match(r[-1]["content"]))})
    pairs = []
    for messages in rows:
        chosen = messages[-1]["content"]
        if m := CAPITAL.match(chosen):
            wrong = rng.choice([c for c in cities if c != m.group(2)])
            rejected = f"The capital of {m.group(1)} is {wrong}."
        elif m := LAST_NUMBER.search(chosen):
            value = int(m.group().replace(",", ""))
            wrong = max(0, value + rng.choice([-10, -3, -2, -1, 1, 2, 3, 10])) or value + 1
            rejected = chosen[: m.start()] + f"{wrong:,}" + chosen[m.end() :]
        else:
            continue
        pairs.append((messages[:-1], chosen, rejected))
    return pairs


class Encoded:
    """One pair as two datums (chosen, rejected) and their reference logprob sums."""

    def __init__(self, tok, messages, chosen: str, rejected: str):
        prompt = chat_tokens(tok, messages, generation_prompt=True)
        eot = end_of_turn(tok)
        self.sequences = [
            prompt + tok.encode(reply, add_special_tokens=False) + [eot] for reply in (chosen, rejected)
        ]
        self.datums = [sft_datum(prompt, seq[len(prompt) :]) for seq in self.sequences]
        self.n_prompt = len(prompt)
        self.ref = (0.0, 0.0)

    def score_reference(self, ref_sampler) -> list:
        return [ref_sampler.compute_logprobs(trio.ModelInput.from_ints(s)) for s in self.sequences]


def dpo_loss(beta: float, refs: list[float]):
    """The loss function forward_backward_custom calls: data alternate chosen, rejected; `refs` are
    the matching reference logprob sums."""
    import torch

    def loss_fn(data, logprobs):
        sums = torch.stack(
            [(lp * d.loss_fn_inputs["weights"].to_torch()).sum() for d, lp in zip(data, logprobs)]
        )
        margin = (sums[0::2] - torch.tensor(refs[0::2])) - (sums[1::2] - torch.tensor(refs[1::2]))
        loss = -torch.nn.functional.logsigmoid(beta * margin).sum()
        m = margin.detach()
        return loss, {
            "dpo_loss": loss.item() / len(m),
            "accuracy": (m > 0).float().mean().item(),
            "margin": m.mean().item(),
        }

    return loss_fn


def evaluate(trainer, pairs: list[Encoded]) -> tuple[float, float]:
    """Held-out preference accuracy and mean margin (policy vs reference), by a forward pass."""
    data = [d for p in pairs for d in p.datums]
    out = trainer.forward(data, "cross_entropy").result()
    margins = []
    for i, p in enumerate(pairs):
        c, r = (
            sum(
                lp * w
                for lp, w in zip(
                    out.loss_fn_outputs[2 * i + k]["logprobs"].tolist(),
                    data[2 * i + k].loss_fn_inputs["weights"].tolist(),
                )
            )
            for k in (0, 1)
        )
        margins.append((c - p.ref[0]) - (r - p.ref[1]))
    return sum(m > 0 for m in margins) / len(margins), sum(margins) / len(margins)


def main(argv=None) -> dict:
    p = parser(__doc__, steps=12)
    p.add_argument("--batch", type=int, default=8, help="Preference pairs per training step.")
    p.add_argument(
        "--beta", type=float, default=0.1, help="DPO's beta: how far the policy may move from the reference."
    )
    p.add_argument("--lr", type=float, default=5e-4, help="Adam's learning rate.")
    p.add_argument("--pairs", type=int, default=96, help="Training pairs, each scored once by the reference.")
    args = p.parse_args(argv)
    rng = random.Random(args.seed)
    with connect(args) as conn:
        service, model = conn.service, conn.model
        phases = Phases(service)
        trainer = service.create_lora_training_client(base_model=model, rank=16, seed=args.seed)
        tok = trainer.get_tokenizer()
        pairs = [Encoded(tok, *t) for t in preference_pairs(args.seed)]
        train, held = pairs[:-HELD_OUT][: args.pairs], pairs[-HELD_OUT:]
        pairs = train + held
        with phases("reference"):
            reference = service.create_sampling_client(base_model=model)
            futures = [(p, p.score_reference(reference)) for p in pairs]  # all in flight at once
            for p, (fc, fr) in futures:
                p.ref = tuple(sum(lp for lp in f.result()[p.n_prompt :]) for f in (fc, fr))
        with phases("eval"):
            acc0, margin0 = evaluate(trainer, held)
        print(
            f"{len(train)} training and {len(held)} held-out pairs; held-out accuracy {acc0:.2f}, "
            f"margin {margin0:+.3f}"
        )
        adam = trio.AdamParams(learning_rate=args.lr)
        timer = StepTimer(service, args.steps)
        with phases("train"):
            for step in range(args.steps):
                batch = rng.sample(train, min(args.batch, len(train)))
                data = [d for p in batch for d in p.datums]
                refs = [r for p in batch for r in p.ref]
                out = trainer.forward_backward_custom(data, dpo_loss(args.beta, refs)).result()
                trainer.optim_step(adam).result()
                timer.done(
                    f"step {step + 1:>3}  dpo loss {out.metrics['dpo_loss']:.4f}  "
                    f"batch accuracy {out.metrics['accuracy']:.2f}  margin {out.metrics['margin']:+.3f}"
                )
        with phases("eval"):
            acc1, margin1 = evaluate(trainer, held)
        print(f"held-out accuracy {acc0:.2f} -> {acc1:.2f}, mean margin {margin0:+.3f} -> {margin1:+.3f}")
        phases.report()
    return {
        "accuracy_before": acc0,
        "accuracy_after": acc1,
        "margin_before": margin0,
        "margin_after": margin1,
    }


if __name__ == "__main__":
    main()
