"""A server-side custom loss (one forward and one backward) against the client-side two-pass path.

    python benchmarks/custom_loss.py [--model DIR] [--batch 4] [--seq 256] [--iters 3] [--json]

The loss is a clipped policy gradient traced by the official tinker client (`create_custom_loss`'s
own tracer) and checked by `engine/loss_graph.py`. One run's forward_backward with it, on the
Trainer, against what `forward_backward_custom` did before server-side losses: a forward pass, the
graph on the logprobs in torch, and a cross_entropy forward_backward with weights -dC/dlogp. The two
sides are interleaved (each pair back to back, alternating which goes first) and
`two_pass_over_one_pass` is the median of the per-iteration time ratios (> 1: the server-side loss is
faster), which cancels most of a shared machine's drift. Client-server transfers are not counted:
on a real server the two-pass path also makes two round trips and ships the logprobs both ways.
"""

from __future__ import annotations

import argparse
import statistics
import time

from trine.engine.setup import configure

configure()  # before torch loads: the engine's OpenMP wait and allocator, as under `trine serve`

# isort: split

import torch
from report import emit  # benchmarks/report.py


def clipped_pg(logprobs, advantages, old):
    ratio = torch.exp(logprobs - old)
    return -torch.minimum(ratio * advantages, torch.clamp(ratio, 0.8, 1.2) * advantages).sum(), {}


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", help="checkpoint dir (default: the embedded SmolLM2-135M-Instruct)")
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--seq", type=int, default=256)
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--iters", type=int, default=3)
    ap.add_argument("--threads", type=int, default=torch.get_num_threads())
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    from tinker.lib.public_interfaces.custom_loss import encode_graph, trace_loss

    from trine.engine.api import Forward, LoRAConfig, Loss, LossTensor, TrainDatum, parse_custom_loss
    from trine.engine.config import TrainerConfig
    from trine.engine.model.weights import load_model
    from trine.engine.trainer.trainer import Trainer

    if args.model is None:
        from trine.engine.model.default_model import ensure_default_model

        args.model = str(ensure_default_model())
    torch.set_num_threads(args.threads)
    handle = trace_loss(clipped_pg, {"logprobs": 1, "advantages": 1, "old": 1}, "bench")
    wire = encode_graph(handle).model_dump(mode="json")
    loss = Loss.of_custom(parse_custom_loss(handle.name, [x.model_dump() for x in handle.inputs], wire))
    model = load_model(args.model, "cpu")
    g = torch.Generator().manual_seed(0)
    data = []
    for _ in range(args.batch):
        tokens = torch.randint(0, model.cfg.vocab_size, (args.seq,), generator=g).tolist()
        inputs = {
            "advantages": LossTensor((args.seq,), torch.randn(args.seq, generator=g).tolist()),
            "old": LossTensor((args.seq,), (-torch.rand(args.seq, generator=g) * 10).tolist()),
        }
        data.append(TrainDatum(tokens=tokens, target_tokens=tokens[1:] + [-100], custom_inputs=inputs))
    trainer = Trainer(model, base_model="bench", config=TrainerConfig(prefix_sharing=False))
    trainer.create_run("r", LoRAConfig(rank=args.rank, alpha=2.0 * args.rank))

    def one_pass():
        trainer.forward_backward([("r", Forward(data, loss))])

    def two_pass():
        fwd = trainer.forward_backward([("r", Forward(data, Loss.parse("cross_entropy")))], backward=False)[0]
        linear = []
        for d, lp in zip(data, fwd.logprobs):
            x = torch.tensor(lp).requires_grad_(True)
            value, _ = handle.graph(x, *(torch.tensor(d.custom_inputs[n].values) for n in handle.input_names))
            value.backward()
            linear.append(
                TrainDatum(tokens=d.tokens, target_tokens=d.target_tokens, weights=(-x.grad).tolist())
            )
        trainer.forward_backward([("r", Forward(linear, Loss.parse("cross_entropy")))])

    one_pass(), two_pass()  # warm up both
    ratios, times = [], {"one": [], "two": []}
    for it in range(args.iters):
        order = [("one", one_pass), ("two", two_pass)][:: 1 if it % 2 == 0 else -1]
        took = {}
        for name, step in order:
            t0 = time.perf_counter()
            step()
            took[name] = time.perf_counter() - t0
            times[name].append(took[name])
        ratios.append(took["two"] / took["one"])
    emit(
        {
            "two_pass_over_one_pass": statistics.median(ratios),
            "one_pass_s": statistics.median(times["one"]),
            "two_pass_s": statistics.median(times["two"]),
            "batch": args.batch,
            "seq": args.seq,
            "iters": args.iters,
            "threads": args.threads,
            "model": args.model,
        },
        args.json,
    )


if __name__ == "__main__":
    main()
