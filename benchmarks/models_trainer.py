"""A Qwen3.5 hybrid model's LoRA training step: trine's Trainer vs transformers + peft (issue 46, item 7).

    python benchmarks/models_trainer.py [--model DIR] [--batch 4] [--seq 256] [--rank 16] [--iters 3]
                                        [--mem-repeats 3] [--json] [--quick] [--profile]

The model: the Qwen3.5-0.8B text stack (`QWEN3_5_0_8B`, the published checkpoint's `text_config`: 24
layers, three Gated DeltaNet layers to each gated-attention layer, a 248,320-token tied vocabulary)
with random weights, written once as a checkpoint (`model_dir`: bf16 on disk, both sides load it in
fp32; `--model DIR` takes another). The step is benchmarks/trainer.py's, both sides in one process:
LoRA rank `--rank` (alpha 32) on every linear of both layer kinds (q/k/v/o, in_proj_qkv/z/a/b,
out_proj, gate/up/down; not the unembedding), AdamW, next-token cross-entropy on the same random
batch of `--batch` x `--seq` tokens, fp32 on CPU; the steps interleaved (each pair back to back,
alternating which goes first), each ratio the median of the per-iteration ratios.

Keys (`trainer_vs_hf`, which benchmarks/models.py calls; `prefix` names the model, `hybrid` the
Qwen3.5-0.8B shape):
- `<prefix>_trainer_vs_hf_peft`: HF step time / trine step time (the issue's goal: >= 1.5).
- `<prefix>_trainer_peak_memory_ratio`: trine / HF peak memory of one step, each side in fresh
  processes (benchmarks/trainer.py's `peak_memory`: the step's VmHWM over the RSS before it;
  median of `--mem-repeats`). The goal: <= 1.
- `<prefix>_trainer_step_s`, `<prefix>_hf_peft_step_s`, `<prefix>_trainer_peak_bytes`,
  `<prefix>_hf_peft_peak_bytes`: the figures behind the ratios.

`--quick`: a tiny hybrid shape (`QUICK`), 2 x 80 tokens, one iteration, one process per side for
memory: a smoke run that every path works; its figures mean nothing and are not recorded.
`--profile`: instead of the comparison, torch.profiler's table of one trine step (by self CPU
time): whether the chunked rule (its Python loop over chunks: the per-chunk `aten::matmul`s; the
UT transform: `aten::linalg_solve_triangular`) or the GEMMs of the projections dominate.
"""

from __future__ import annotations

import argparse
import os
import statistics
from pathlib import Path
from types import SimpleNamespace

from trine.engine.setup import configure

configure()  # before torch loads: the engine's OpenMP wait and allocator, as under `trine serve`

# isort: split

import torch
from report import emit  # benchmarks/report.py
from trainer import HFSide, TrineSide, make_batch, peak_memory, timed  # benchmarks/trainer.py

# Qwen/Qwen3.5-0.8B's text_config (the multimodal checkpoint's language model), random weights.
QWEN3_5_0_8B = dict(
    vocab_size=248320,
    hidden_size=1024,
    intermediate_size=3584,
    num_hidden_layers=24,
    layer_types=(["linear_attention"] * 3 + ["full_attention"]) * 6,
    num_attention_heads=8,
    num_key_value_heads=2,
    head_dim=256,
    linear_num_key_heads=16,
    linear_num_value_heads=16,
    linear_key_head_dim=128,
    linear_value_head_dim=128,
    linear_conv_kernel_dim=4,
    rms_norm_eps=1e-6,
    max_position_embeddings=262144,
    rope_parameters={"rope_type": "default", "rope_theta": 10000000.0, "partial_rotary_factor": 0.25},
    tie_word_embeddings=True,
    eos_token_id=248044,
)
# The same stack in miniature, for --quick.
QUICK = QWEN3_5_0_8B | dict(
    vocab_size=4096,
    hidden_size=128,
    intermediate_size=256,
    num_hidden_layers=4,
    layer_types=["linear_attention"] * 3 + ["full_attention"],
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=32,
    linear_num_key_heads=2,
    linear_num_value_heads=4,
    linear_key_head_dim=32,
    linear_value_head_dim=32,
    eos_token_id=2,
)


def model_dir(config: dict, name: str) -> Path:
    """A checkpoint of `config` with random weights (seed 0, bf16 on disk), written once under
    $XDG_CACHE_HOME/trine/bench-models/`name` and reused."""
    root = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "trine" / "bench-models"
    out = root / name
    if (out / "config.json").is_file():
        return out
    import transformers as tf

    torch.manual_seed(0)
    model = tf.Qwen3_5ForCausalLM(tf.Qwen3_5TextConfig(**config)).to(torch.bfloat16)
    tmp = root / f".{name}.tmp-{os.getpid()}"
    model.save_pretrained(tmp)
    tmp.replace(out)
    return out


def default_model_dir(quick: bool) -> Path:
    return model_dir(QUICK, "qwen3_5-quick") if quick else model_dir(QWEN3_5_0_8B, "qwen3_5-0.8b")


def trainer_vs_hf(
    path: str | Path | None = None,
    *,
    quick: bool = False,
    batch: int = 4,
    seq: int = 256,
    rank: int = 16,
    iters: int = 3,
    mem_repeats: int = 3,
    threads: int | None = None,
    prefix: str = "hybrid",
) -> dict:
    """The keys above for the model at `path` (default: the Qwen3.5-0.8B shape, or with `quick` the
    tiny one at 2 x 80 tokens, one iteration and one process per side)."""
    if quick:
        batch, seq, iters, mem_repeats = 2, 80, 1, 1
    path = path or default_model_dir(quick)
    threads = threads or torch.get_num_threads()
    torch.set_num_threads(threads)
    from trine.engine.model.weights import read_config

    tokens = make_batch(read_config(path).vocab_size, batch, seq)
    ours, hf = TrineSide(str(path), tokens, rank), HFSide(str(path), tokens, rank)
    ours.step(), hf.step()  # warm-up
    t_ours, t_hf = [], []
    for it in range(iters):  # pairs back to back, in alternating order (ABBA) against drift
        for fn, out in ((ours.step, t_ours), (hf.step, t_hf))[:: 1 if it % 2 == 0 else -1]:
            out.append(timed(fn))
    del ours, hf
    args = SimpleNamespace(
        model=str(path),
        batch=batch,
        seq=seq,
        rank=rank,
        threads=threads,
        mem_repeats=mem_repeats,
        dtype="float32",
    )
    peak_ours, peak_hf = peak_memory("trine", args), peak_memory("hf", args)
    med = statistics.median
    return {
        f"{prefix}_trainer_vs_hf_peft": med([h / o for h, o in zip(t_hf, t_ours)]),
        f"{prefix}_trainer_peak_memory_ratio": peak_ours / peak_hf,
        f"{prefix}_trainer_step_s": med(t_ours),
        f"{prefix}_hf_peft_step_s": med(t_hf),
        f"{prefix}_trainer_peak_bytes": peak_ours,
        f"{prefix}_hf_peft_peak_bytes": peak_hf,
        f"{prefix}_trainer_model": str(path),
        f"{prefix}_trainer_batch": batch,
        f"{prefix}_trainer_seq": seq,
    }


def profile_step(path: Path, batch: int, seq: int, rank: int, rows: int = 25) -> str:
    """torch.profiler's table of one trine step (after a warm-up step), by self CPU time."""
    from torch.profiler import ProfilerActivity, profile

    from trine.engine.model.weights import read_config

    side = TrineSide(str(path), make_batch(read_config(path).vocab_size, batch, seq), rank)
    side.step()
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        side.step()
    return prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=rows)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", help="checkpoint dir (default: the Qwen3.5-0.8B shape, random weights)")
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--seq", type=int, default=256)
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--iters", type=int, default=3)
    ap.add_argument("--mem-repeats", type=int, default=3, help="fresh processes per side for peak memory")
    ap.add_argument("--threads", type=int, default=torch.get_num_threads())
    ap.add_argument("--quick", action="store_true", help="a tiny shape, one iteration: a smoke run")
    ap.add_argument("--profile", action="store_true", help="profile one trine step instead")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    if args.profile:
        torch.set_num_threads(args.threads)
        path = args.model or default_model_dir(args.quick)
        batch, seq = (2, 80) if args.quick else (args.batch, args.seq)
        print(profile_step(Path(path), batch, seq, args.rank))
        return
    result = trainer_vs_hf(
        args.model,
        quick=args.quick,
        batch=args.batch,
        seq=args.seq,
        rank=args.rank,
        iters=args.iters,
        mem_repeats=args.mem_repeats,
        threads=args.threads,
    )
    if args.quick:
        os.environ["TRINE_BENCH_RECORD"] = "0"  # a smoke run's figures are not published
    emit(result, args.json)  # recorded in benchmarks/results/models_trainer.jsonl


if __name__ == "__main__":
    main()
