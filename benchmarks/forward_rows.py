"""What a forward's row count costs on this CPU: the body's GEMMs and one layer's prefill attention
at a chat turn's sizes (a few dozen new tokens over a long cached context).

Why: a chat turn's time to first token is a forward of its new tokens, and its cost has steps in
the row count, not a line. MKL's packed GEMMs over every weight of SmolLM2-135M's 30 layers (120
weights, 425 MB of fp32, streamed from memory as in the engine) cost markedly more at 65 rows than
at 64 when the weights are packed for 64 rows (`--pack-rows 64`), and not when packed for the
engine's `PACK_ROWS` (docs/vs-vllm.md#the-latest-run); SDPA's CPU kernel takes queries 32 at a
time. That is why the prefix cache serving a chat's previous reply to the token (65 rows a turn
instead of 80) pays.

Prints, per row count: the 120 GEMMs' milliseconds and one layer's SDPA (9 query heads over 3 KV
heads of 64 dims, `--context` cached keys plus the rows, causal over the rows). Medians of
`--repeats`. No record: figures are for reading beside the vs_vllm run.

    .venv/bin/python benchmarks/forward_rows.py [--rows 48,64,65,80] [--context 1056] [--pack-rows 256]
"""

from __future__ import annotations

import argparse
import statistics
import time

from trine.engine.setup import configure

configure()  # trine's OpenMP settings, before torch starts its threads

# isort: split
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from trine.engine.model.kernels.packed import PACK_ROWS  # noqa: E402

SHAPES = [(960, 576), (576, 576), (3072, 576), (576, 1536)]  # fused q/k/v, o, gate/up, down
LAYERS, HEADS, KV_HEADS, HEAD_DIM = 30, 9, 3, 64


def median_ms(f, repeats: int) -> float:
    f()
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        f()
        times.append(time.perf_counter() - t)
    return statistics.median(times) * 1e3


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", default="48,64,65,80")
    ap.add_argument("--context", type=int, default=1056)
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--pack-rows", type=int, default=PACK_ROWS, help="the row count weights are packed for")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    weights = [torch.randn(o, i) for _ in range(LAYERS) for o, i in SHAPES]
    with torch.inference_mode():
        packed = [torch.ops.mkl._mkl_reorder_linear_weight(w, args.pack_rows) for w in weights]
        print(f"rows  gemms (30 layers)  sdpa (one layer, {args.context} cached keys)")
        for m in [int(r) for r in args.rows.split(",")]:
            xs = {576: torch.randn(m, 576), 1536: torch.randn(m, 1536)}

            def gemms(m=m, xs=xs):
                for w, p in zip(weights, packed):
                    torch.ops.mkl._mkl_linear(xs[w.shape[1]], p, w, None, m)

            keys = args.context + m
            q = torch.randn(1, HEADS, m, HEAD_DIM)
            k, v = torch.randn(1, KV_HEADS, keys, HEAD_DIM), torch.randn(1, KV_HEADS, keys, HEAD_DIM)
            mask = torch.ones(m, keys, dtype=torch.bool).tril(args.context)[None, None]

            def sdpa(q=q, k=k, v=v, mask=mask):
                F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)

            g, a = median_ms(gemms, args.repeats), median_ms(sdpa, 5 * args.repeats)
            print(f"{m:4d}  {g:9.1f} ms  {a:9.3f} ms")


if __name__ == "__main__":
    main()
