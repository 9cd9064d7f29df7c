"""One LoRA training step (forward_backward + optim_step): trine's Trainer vs transformers + peft.

    python benchmarks/trainer.py [--model DIR] [--batch 8] [--seq 256] [--rank 16] [--iters 5] [--json]

Both sides train LoRA rank 16 (alpha 32) on attention and MLP of the same fp32 weights with AdamW, on
the same random batch (labels = inputs, next-token cross-entropy), in the same process; their steps
are interleaved (each pair back to back, alternating which goes first) and each ratio is the median
of the per-iteration ratios, which cancels most of the drift of a shared machine:
- vs_hf_peft: HF step time / trine step time (tokens/s ratio; >= 1 means trine is faster).
- mixed_adapter_overhead: forward_backward of the same batch split across 4 runs (4 adapters mixed
  in one pass) against one run's forward_backward, as a fraction (0.05 = 5% slower);
  mixed_adapter_overhead_with_optim adds the optim_steps (4 against 1) to both sides.
- peak_memory_ratio: trine / HF peak memory of one step. Measured in a fresh child process per side
  (the allocator keeps freed memory, so one process cannot measure two sides): after loading and
  setup, the kernel's peak-RSS counter is reset (`/proc/self/clear_refs` <- 5), then one step runs;
  peak = VmHWM - VmRSS before the step. That is every byte the step made resident: activations,
  logits, gradients, optimizer state. Median of --mem-repeats processes per side.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import statistics
import time
from pathlib import Path

import torch
from report import record  # benchmarks/report.py


def _rss_kb(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise RuntimeError(f"{field} not in /proc/self/status")


def make_batch(vocab: int, batch: int, seq: int, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, vocab, (batch, seq), generator=torch.Generator().manual_seed(seed))


class TrineSide:
    def __init__(self, model_dir: str, tokens: torch.Tensor, rank: int, runs: int = 1):
        from trine.engine.api import AdamConfig, LoRAConfig, Loss, TrainDatum
        from trine.engine.model.weights import load_model
        from trine.engine.trainer.trainer import Trainer

        self.trainer = Trainer(load_model(model_dir, "cpu"), base_model="bench")
        self.runs = [f"run{i}" for i in range(runs)]
        for i, run in enumerate(self.runs):
            self.trainer.create_run(run, LoRAConfig(rank=rank, alpha=32.0, train_unembed=False, seed=i))
        rows = [TrainDatum(tokens=t.tolist(), target_tokens=t[1:].tolist() + [-100]) for t in tokens]
        per_run = len(rows) // runs
        self.batch = [
            (run, rows[i * per_run : (i + 1) * per_run], Loss.parse("cross_entropy"))
            for i, run in enumerate(self.runs)
        ]
        self.adam = AdamConfig(learning_rate=1e-4)

    def forward_backward(self):
        self.trainer.forward_backward(self.batch)

    def step(self):
        self.forward_backward()
        for run in self.runs:
            self.trainer.optim_step(run, self.adam)


class HFSide:
    def __init__(self, model_dir: str, tokens: torch.Tensor, rank: int):
        from peft import LoraConfig, get_peft_model
        from transformers import AutoModelForCausalLM

        base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
        targets = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
        self.model = get_peft_model(
            base, LoraConfig(r=rank, lora_alpha=32, lora_dropout=0.0, target_modules=targets)
        )
        self.model.train()
        params = [p for p in self.model.parameters() if p.requires_grad]
        self.opt = torch.optim.AdamW(params, lr=1e-4, betas=(0.9, 0.95), eps=1e-12, weight_decay=0.0)
        self.tokens = tokens

    def step(self):
        loss = self.model(input_ids=self.tokens, labels=self.tokens).loss
        loss.backward()
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)


def _peak_child(side: str, model_dir: str, batch: int, seq: int, rank: int, threads: int, out):
    torch.set_num_threads(threads)
    import ctypes
    import gc

    from trine.engine.model.weights import read_config

    tokens = make_batch(read_config(model_dir).vocab_size, batch, seq)
    runner = TrineSide(model_dir, tokens, rank) if side == "trine" else HFSide(model_dir, tokens, rank)
    gc.collect()
    ctypes.CDLL("libc.so.6").malloc_trim(0)
    Path("/proc/self/clear_refs").write_text("5")  # reset VmHWM to the current RSS
    before = _rss_kb("VmRSS")
    runner.step()
    out.put((side, (_rss_kb("VmHWM") - before) * 1024))


def peak_memory(side: str, args) -> int:
    """Median over `args.mem_repeats` fresh processes (the allocator makes single readings noisy)."""
    ctx = mp.get_context("spawn")
    peaks = []
    for _ in range(args.mem_repeats):
        q = ctx.Queue()
        p = ctx.Process(
            target=_peak_child, args=(side, args.model, args.batch, args.seq, args.rank, args.threads, q)
        )
        p.start()
        peaks.append(q.get()[1])
        p.join()
    return int(statistics.median(peaks))


def timed(fn) -> float:
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", help="checkpoint dir (default: the embedded SmolLM2-135M-Instruct)")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq", type=int, default=256)
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--iters", type=int, default=5)
    ap.add_argument("--mem-repeats", type=int, default=3, help="fresh processes per side for peak memory")
    ap.add_argument("--threads", type=int, default=torch.get_num_threads())
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    if args.batch % 4:
        ap.error("--batch must be a multiple of 4 (the mixed-adapter pass splits it across 4 runs)")
    if args.model is None:
        from trine.engine.model.default_model import ensure_default_model

        args.model = str(ensure_default_model())
    torch.set_num_threads(args.threads)
    from trine.engine.model.weights import read_config

    tokens = make_batch(read_config(args.model).vocab_size, args.batch, args.seq)
    ours, mixed, hf = (
        TrineSide(args.model, tokens, args.rank),
        TrineSide(args.model, tokens, args.rank, runs=4),
        HFSide(args.model, tokens, args.rank),
    )
    ours.step(), mixed.step(), hf.step()  # warm-up
    t_ours, t_hf, t_fb1, t_fb4, t_mixed = [], [], [], [], []
    for it in range(args.iters):  # pairs run back to back, in alternating order (ABBA) against drift
        for fn, out in ((ours.step, t_ours), (hf.step, t_hf))[:: 1 if it % 2 == 0 else -1]:
            out.append(timed(fn))
        for fn, out in ((ours.forward_backward, t_fb1), (mixed.forward_backward, t_fb4))[
            :: 1 if it % 2 else -1
        ]:
            out.append(timed(fn))
        t_mixed.append(timed(mixed.step))
    del ours, mixed, hf
    peak_ours, peak_hf = peak_memory("trine", args), peak_memory("hf", args)
    ntok = args.batch * args.seq
    med = statistics.median
    result = {  # ratios: the median of the per-iteration ratios of paired timings
        "vs_hf_peft": med([h / o for h, o in zip(t_hf, t_ours)]),
        "mixed_adapter_overhead": med([m / o for m, o in zip(t_fb4, t_fb1)]) - 1,
        "mixed_adapter_overhead_with_optim": med([m / o for m, o in zip(t_mixed, t_ours)]) - 1,
        "peak_memory_ratio": peak_ours / peak_hf,
        "trine_step_s": med(t_ours),
        "hf_peft_step_s": med(t_hf),
        "trine_tokens_per_s": ntok / med(t_ours),
        "hf_peft_tokens_per_s": ntok / med(t_hf),
        "trine_fb_1run_s": med(t_fb1),
        "trine_fb_4runs_s": med(t_fb4),
        "trine_step_4runs_s": med(t_mixed),
        "trine_peak_bytes": peak_ours,
        "hf_peft_peak_bytes": peak_hf,
        "model": args.model,
        "batch": args.batch,
        "seq": args.seq,
        "rank": args.rank,
        "iters": args.iters,
        "threads": args.threads,
    }
    record(result)  # benchmarks/results/trainer.jsonl
    if args.json:
        print(json.dumps(result))
    else:
        for k, v in result.items():
            print(f"{k:36s} {v:.4g}" if isinstance(v, float) else f"{k:36s} {v}")


if __name__ == "__main__":
    main()
