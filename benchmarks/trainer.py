"""One LoRA training step (forward_backward + optim_step): trine's Trainer vs transformers + peft;
and one full fine-tuning step against a transformers Trainer-style loop.

    python benchmarks/trainer.py [--model DIR] [--batch 8] [--seq 256] [--rank 16] [--iters 5] [--json]
                                 [--no-prefix | --prefix-only] [--no-full | --full-only] [--quick]
                                 [--dtype float32|bfloat16]

Both sides train LoRA rank 16 (alpha 32) on attention and MLP of the same fp32 weights (both bf16 with
`--dtype bfloat16`; the GEMM peak is then bf16's) with AdamW, on
the same random batch (labels = inputs, next-token cross-entropy), in the same process; their steps
are interleaved (each pair back to back, alternating which goes first) and each ratio is the median
of the per-iteration ratios, which cancels most of the drift of a shared machine:
- vs_hf_peft: HF step time / trine step time (tokens/s ratio; >= 1 means trine is faster).
- mixed_adapter_overhead: forward_backward of the same batch split across 4 runs (4 adapters mixed
  in one pass) against one run's forward_backward, as a fraction (0.05 = 5% slower);
  mixed_adapter_overhead_with_optim adds the optim_steps (4 against 1) to both sides.
- vs_hf_peft_ceiling: the most vs_hf_peft could be, for a step that does only its GEMM work at this
  CPU's peak: HF step time / (linear-layer FLOPs of a step / gemm_peak_gflops). A step's GEMM work is
  the forward and the input-gradient product of every base linear and the LM head, 4 x tokens x their
  weights (a frozen base needs no weight gradient; LoRA's and attention's FLOPs are left out, so this
  is a bound); gemm_peak_gflops is the best fp32 1024^3 matmul measured in the same run.
  trine_fraction_of_floor: that GEMM-only time / trine's step time.
- peak_memory_ratio: trine / HF peak memory of one step. Measured in a fresh child process per side
  (the allocator keeps freed memory, so one process cannot measure two sides): after loading and
  setup, the kernel's peak-RSS counter is reset (`/proc/self/clear_refs` <- 5), then one step runs;
  peak = VmHWM - VmRSS before the step. That is every byte the step made resident: activations,
  logits, gradients, optimizer state. Median of --mem-repeats processes per side.

Prefix sharing (issue 26; `--prefix-only` runs just these): one run's step (forward_backward +
optim_step) with `TrainerConfig(prefix_sharing=True)` against the same Trainer with it off, interleaved
as above, on two batches of policy data (importance_sampling, a target at every position, zero
advantage on prompts):
- GRPO: `--grpo-groups` (8) prompts of `--grpo-prompt` (256) tokens x `--grpo-completions` (8)
  completions of `--grpo-completion` (64) tokens.
- multi-turn: `--trajectories` (8) trajectories of `--turns` (4) turns of `--turn-tokens` (128)
  tokens, one datum per turn (turn k's datum is turns 1..k).
- prefix_shared_grpo / prefix_shared_multiturn: plain step time / shared step time (median of
  the per-iteration ratios); train_tokens_computed_fraction_grpo / _multiturn: tokens computed /
  tokens sent (deterministic); prefix_peak_memory_ratio_grpo / _multiturn: shared / plain peak
  memory of one step, measured as above (fresh process per side, --mem-repeats each).

Full fine-tuning (issue 48; `--full-only` runs just this): a full run (rank 0: every weight, the
embedding and head included, AdamW) on the batch above against transformers' model trained the way
its `Trainer` does (all parameters, `model(input_ids, labels).loss`, backward, AdamW step,
`zero_grad(set_to_none=True)`), same fp32 weights and data, interleaved as above. With `--dtype
bfloat16` trine's run holds bf16 weights with fp32 masters, and HF's is its `bf16=True` on a CPU
(fp32 weights, the forward under bf16 autocast):
- full_ft_vs_hf: HF step time / trine step time (>= 1 means trine is faster; goal >= 1.5).
- full_ft_peak_memory_ratio: trine / HF peak memory of a training process (goal <= 1.0): in a fresh
  child per side, VmHWM after two steps minus the RSS before the model is loaded, so it counts the
  weights (trine's base model and the run's own copy; HF's one model), gradients, AdamW state and
  the steps' activations and logits. Median of --mem-repeats processes per side.
`--quick` shrinks everything to a check that the benchmark runs (batch 4 x 64 tokens, one
iteration, one process per side); its numbers mean nothing and are not recorded.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import statistics
import time
from pathlib import Path

from trine.engine.setup import configure

configure()  # before torch loads: the engine's OpenMP wait and allocator, as under `trine serve`

# isort: split

import torch
from report import record  # benchmarks/report.py
from sampler import gemm_peak_gflops  # benchmarks/sampler.py

from trine.engine.api import LORA_LINEAR_ATTN


def _rss_kb(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise RuntimeError(f"{field} not in /proc/self/status")


def make_batch(vocab: int, batch: int, seq: int, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, vocab, (batch, seq), generator=torch.Generator().manual_seed(seed))


class TrineSide:
    def __init__(
        self, model_dir: str, tokens: torch.Tensor, rank: int, runs: int = 1, dtype: str = "float32"
    ):
        from trine.engine.api import AdamConfig, Forward, LoRAConfig, Loss, TrainDatum
        from trine.engine.model.weights import load_model
        from trine.engine.trainer.trainer import Trainer

        self.trainer = Trainer(load_model(model_dir, "cpu", getattr(torch, dtype)), base_model="bench")
        self.runs = [f"run{i}" for i in range(runs)]
        for i, run in enumerate(self.runs):
            self.trainer.create_run(run, LoRAConfig(rank=rank, alpha=32.0, train_unembed=False, seed=i))
        rows = [TrainDatum(tokens=t.tolist(), target_tokens=t[1:].tolist() + [-100]) for t in tokens]
        per_run = len(rows) // runs
        self.batch = [
            (run, Forward(rows[i * per_run : (i + 1) * per_run], Loss.parse("cross_entropy")))
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
    def __init__(self, model_dir: str, tokens: torch.Tensor, rank: int, dtype: str = "float32"):
        from peft import LoraConfig, get_peft_model
        from transformers import AutoModelForCausalLM

        base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=getattr(torch, dtype))
        targets = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
        self.model = get_peft_model(  # and a hybrid model's linear attention, as TrineSide's LoRAConfig
            base,
            LoraConfig(
                r=rank, lora_alpha=32, lora_dropout=0.0, target_modules=targets + list(LORA_LINEAR_ATTN)
            ),
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


class FullSide:
    """A full fine-tuning run (rank 0: every weight) on the batch; bf16 weights keep fp32 masters."""

    def __init__(self, model_dir: str, tokens: torch.Tensor, dtype: str = "float32"):
        from trine.engine.api import AdamConfig, Forward, LoRAConfig, Loss, TrainDatum
        from trine.engine.model.weights import load_model
        from trine.engine.trainer.trainer import Trainer

        self.trainer = Trainer(load_model(model_dir, "cpu", getattr(torch, dtype)), base_model="bench")
        self.trainer.create_run("full", LoRAConfig(rank=0))
        rows = [TrainDatum(tokens=t.tolist(), target_tokens=t[1:].tolist() + [-100]) for t in tokens]
        self.batch = [("full", Forward(rows, Loss.parse("cross_entropy")))]
        self.adam = AdamConfig(learning_rate=1e-5)

    def step(self):
        self.trainer.forward_backward(self.batch)
        self.trainer.optim_step("full", self.adam)


class HFFullSide:
    """transformers' model trained as its Trainer does: every parameter, AdamW, grads freed. bf16 is
    `TrainingArguments(bf16=True)` on a CPU: fp32 weights, the forward under bf16 autocast."""

    def __init__(self, model_dir: str, tokens: torch.Tensor, dtype: str = "float32"):
        from transformers import AutoModelForCausalLM

        self.model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
        self.model.train()
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=1e-5, betas=(0.9, 0.95), eps=1e-12)
        self.tokens = tokens
        self.autocast = dtype == "bfloat16"

    def step(self):
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=self.autocast):
            loss = self.model(input_ids=self.tokens, labels=self.tokens).loss
        loss.backward()
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)


def _full_peak_child(side: str, model_dir: str, batch: int, seq: int, threads: int, dtype: str, out):
    torch.set_num_threads(threads)
    from trine.engine.model.weights import read_config

    tokens = make_batch(read_config(model_dir).vocab_size, batch, seq)
    Path("/proc/self/clear_refs").write_text("5")
    before = _rss_kb("VmRSS")
    runner = (FullSide if side == "trine" else HFFullSide)(model_dir, tokens, dtype)
    runner.step(), runner.step()
    out.put((_rss_kb("VmHWM") - before) * 1024)


def full_peak(side: str, args) -> int:
    ctx = mp.get_context("spawn")
    peaks = []
    for _ in range(args.mem_repeats):
        q = ctx.Queue()
        p = ctx.Process(
            target=_full_peak_child,
            args=(side, args.model, args.batch, args.seq, args.threads, args.dtype, q),
        )
        p.start()
        peaks.append(q.get())
        p.join()
    return int(statistics.median(peaks))


def full_case(args) -> dict:
    """Full fine-tuning against a transformers Trainer-style loop (see the module docstring)."""
    from trine.engine.model.weights import read_config

    tokens = make_batch(read_config(args.model).vocab_size, args.batch, args.seq)
    ours, hf = FullSide(args.model, tokens, args.dtype), HFFullSide(args.model, tokens, args.dtype)
    ours.step(), hf.step()  # warm-up
    t_ours, t_hf = [], []
    for it in range(args.iters):
        for fn, times in ((ours.step, t_ours), (hf.step, t_hf))[:: 1 if it % 2 == 0 else -1]:
            times.append(timed(fn))
    del ours, hf
    out = {}
    if args.iters:
        ntok = args.batch * args.seq
        out["full_ft_vs_hf"] = statistics.median([h / o for h, o in zip(t_hf, t_ours)])
        out["full_ft_step_s"] = statistics.median(t_ours)
        out["full_ft_hf_step_s"] = statistics.median(t_hf)
        out["full_ft_tokens_per_s"] = ntok / out["full_ft_step_s"]
    if args.mem_repeats:
        peak_ours, peak_hf = full_peak("trine", args), full_peak("hf", args)
        out["full_ft_peak_memory_ratio"] = peak_ours / peak_hf
        out["full_ft_peak_bytes"], out["full_ft_hf_peak_bytes"] = peak_ours, peak_hf
    return out


def grpo_data(vocab: int, groups: int, completions: int, prompt: int, completion: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    data = []
    for _ in range(groups):
        p = torch.randint(0, vocab, (prompt,), generator=g).tolist()
        data += [
            _policy_datum(p + torch.randint(0, vocab, (completion,), generator=g).tolist(), prompt)
            for _ in range(completions)
        ]
    return data


def multiturn_data(vocab: int, trajectories: int, turns: int, turn_tokens: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    data = []
    for _ in range(trajectories):
        tokens: list[int] = []
        for _ in range(turns):
            start = len(tokens)
            tokens = tokens + torch.randint(0, vocab, (turn_tokens,), generator=g).tolist()
            data.append(_policy_datum(tokens, start + turn_tokens // 2))  # the turn's second half is acted
    return data


def _policy_datum(tokens: list[int], prompt: int):
    from trine.engine.api import TrainDatum

    n = len(tokens)
    return TrainDatum(
        tokens=tokens,
        target_tokens=tokens[1:] + [-100],
        logprobs=[-10.0] * n,
        advantages=[0.0] * (prompt - 1) + [1.0] * (n - prompt + 1),
    )


class PrefixSide:
    """One run training on `data` with prefix sharing on or off."""

    def __init__(self, model, data, rank: int, sharing: bool, micro_batch_tokens: int = 4096):
        from trine.engine.api import AdamConfig, Forward, LoRAConfig, Loss
        from trine.engine.config import TrainerConfig
        from trine.engine.trainer.trainer import Trainer

        self.trainer = Trainer(
            model,
            base_model="bench",
            config=TrainerConfig(prefix_sharing=sharing, micro_batch_tokens=micro_batch_tokens),
        )
        self.trainer.create_run("r", LoRAConfig(rank=rank, alpha=32.0, train_unembed=False))
        self.batch = [("r", Forward(data, Loss.parse("importance_sampling")))]
        self.adam = AdamConfig(learning_rate=1e-4)
        self.usage = None

    def step(self):
        self.usage = self.trainer.forward_backward(self.batch)[0].usage
        self.trainer.optim_step("r", self.adam)


def prefix_data(case: str, vocab: int, args):
    if case == "grpo":
        return grpo_data(
            vocab, args.grpo_groups, args.grpo_completions, args.grpo_prompt, args.grpo_completion
        )
    return multiturn_data(vocab, args.trajectories, args.turns, args.turn_tokens)


def _prefix_peak_child(case: str, sharing: bool, args, out):
    torch.set_num_threads(args.threads)
    import ctypes
    import gc

    from trine.engine.model.weights import load_model

    model = load_model(args.model, "cpu", getattr(torch, args.dtype))
    side = PrefixSide(
        model, prefix_data(case, model.cfg.vocab_size, args), args.rank, sharing, args.micro_batch_tokens
    )
    gc.collect()
    ctypes.CDLL("libc.so.6").malloc_trim(0)
    Path("/proc/self/clear_refs").write_text("5")
    before = _rss_kb("VmRSS")
    side.step()
    out.put((_rss_kb("VmHWM") - before) * 1024)


def prefix_peak(case: str, sharing: bool, args) -> int:
    ctx = mp.get_context("spawn")
    peaks = []
    for _ in range(args.mem_repeats):
        q = ctx.Queue()
        p = ctx.Process(target=_prefix_peak_child, args=(case, sharing, args, q))
        p.start()
        peaks.append(q.get())
        p.join()
    return int(statistics.median(peaks))


def prefix_cases(args) -> dict:
    """The prefix-sharing figures of both cases (see the module docstring)."""
    from trine.engine.model.weights import load_model

    model = load_model(args.model, "cpu", getattr(torch, args.dtype))
    out = {}
    for case in ("grpo", "multiturn"):
        data = prefix_data(case, model.cfg.vocab_size, args)
        shared, plain = (
            PrefixSide(model, data, args.rank, sharing, args.micro_batch_tokens) for sharing in (True, False)
        )
        for _ in range(args.warmup):
            shared.step(), plain.step()
        t_shared, t_plain = [], []
        for it in range(args.iters):
            for fn, times in ((shared.step, t_shared), (plain.step, t_plain))[:: 1 if it % 2 else -1]:
                times.append(timed(fn))
            print(f"# {case} iteration {it}: shared {t_shared[-1]:.2f}s plain {t_plain[-1]:.2f}s", flush=True)
        if args.iters:
            out[f"prefix_shared_{case}"] = statistics.median([p / s for p, s in zip(t_plain, t_shared)])
            out[f"train_tokens_computed_fraction_{case}"] = (
                shared.usage.train_tokens / shared.usage.sequence_tokens
            )
            out[f"prefix_{case}_shared_step_s"] = statistics.median(t_shared)
            out[f"prefix_{case}_plain_step_s"] = statistics.median(t_plain)
            out[f"prefix_{case}_sequence_tokens"] = shared.usage.sequence_tokens
        del shared, plain
        if args.mem_repeats:
            out[f"prefix_peak_memory_ratio_{case}"] = prefix_peak(case, True, args) / prefix_peak(
                case, False, args
            )
    return out


def _peak_child(side: str, model_dir: str, batch: int, seq: int, rank: int, threads: int, dtype: str, out):
    torch.set_num_threads(threads)
    import ctypes
    import gc

    from trine.engine.model.weights import read_config

    tokens = make_batch(read_config(model_dir).vocab_size, batch, seq)
    runner = (
        TrineSide(model_dir, tokens, rank, dtype=dtype)
        if side == "trine"
        else HFSide(model_dir, tokens, rank, dtype)
    )
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
            target=_peak_child,
            args=(side, args.model, args.batch, args.seq, args.rank, args.threads, args.dtype, q),
        )
        p.start()
        peaks.append(q.get()[1])
        p.join()
    return int(statistics.median(peaks))


def gemm_flops(model_dir: str, tokens: int) -> float:
    """A LoRA step's base GEMM work: forward and input gradient of every linear and the LM head."""
    from trine.engine.model.weights import read_config

    c = read_config(model_dir)
    q, kv = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim
    layer = c.hidden_size * (2 * q + 2 * kv) + 3 * c.hidden_size * c.intermediate_size
    return 4.0 * tokens * (c.num_layers * layer + c.hidden_size * c.vocab_size)


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
    ap.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32", help="both sides' dtype")
    ap.add_argument("--prefix-only", action="store_true", help="only the prefix-sharing cases")
    ap.add_argument("--no-prefix", action="store_true", help="skip the prefix-sharing cases")
    ap.add_argument("--full-only", action="store_true", help="only the full fine-tuning case")
    ap.add_argument("--no-full", action="store_true", help="skip the full fine-tuning case")
    ap.add_argument("--quick", action="store_true", help="a tiny run that checks the benchmark works")
    ap.add_argument("--warmup", type=int, default=1, help="untimed steps per side before a prefix case")
    ap.add_argument("--micro-batch-tokens", type=int, default=4096, help="the prefix cases' Trainer budget")
    ap.add_argument("--grpo-groups", type=int, default=8)
    ap.add_argument("--grpo-completions", type=int, default=8)
    ap.add_argument("--grpo-prompt", type=int, default=256)
    ap.add_argument("--grpo-completion", type=int, default=64)
    ap.add_argument("--trajectories", type=int, default=8)
    ap.add_argument("--turns", type=int, default=4)
    ap.add_argument("--turn-tokens", type=int, default=128)
    args = ap.parse_args()
    if args.quick:
        args.batch, args.seq, args.iters, args.mem_repeats, args.warmup = 4, 64, 1, 1, 0
    if args.batch % 4:
        ap.error("--batch must be a multiple of 4 (the mixed-adapter pass splits it across 4 runs)")
    if args.model is None:
        from trine.engine.model.default_model import ensure_default_model

        args.model = str(ensure_default_model())
    torch.set_num_threads(args.threads)
    run_info = {"model": args.model, "iters": args.iters, "threads": args.threads}
    if args.full_only:
        _print(full_case(args) | run_info | {"batch": args.batch, "seq": args.seq}, args)
        return
    if args.prefix_only:
        _print(prefix_cases(args) | {"model": args.model, "iters": args.iters, "threads": args.threads}, args)
        return
    from trine.engine.model.weights import read_config

    tokens = make_batch(read_config(args.model).vocab_size, args.batch, args.seq)
    ours, mixed, hf = (
        TrineSide(args.model, tokens, args.rank, dtype=args.dtype),
        TrineSide(args.model, tokens, args.rank, runs=4, dtype=args.dtype),
        HFSide(args.model, tokens, args.rank, args.dtype),
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
    gemm_peak = gemm_peak_gflops(args.dtype)
    peak_ours, peak_hf = peak_memory("trine", args), peak_memory("hf", args)
    ntok = args.batch * args.seq
    med = statistics.median
    floor_s = gemm_flops(args.model, ntok) / (gemm_peak * 1e9)
    result = {  # ratios: the median of the per-iteration ratios of paired timings
        "vs_hf_peft": med([h / o for h, o in zip(t_hf, t_ours)]),
        "mixed_adapter_overhead": med([m / o for m, o in zip(t_fb4, t_fb1)]) - 1,
        "mixed_adapter_overhead_with_optim": med([m / o for m, o in zip(t_mixed, t_ours)]) - 1,
        "vs_hf_peft_ceiling": med(t_hf) / floor_s,
        "trine_fraction_of_floor": floor_s / med(t_ours),
        "gemm_peak_gflops": gemm_peak,
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
        "dtype": args.dtype,
    }
    if not args.no_full:
        result |= full_case(args)
    _print(result if args.no_prefix else result | prefix_cases(args), args)


def _print(result: dict, args) -> None:
    if not args.quick:  # a quick run's figures are not published
        record(result)  # benchmarks/results/trainer.jsonl
    if args.json:
        print(json.dumps(result))
    else:
        for k, v in result.items():
            print(f"{k:36s} {v:.4g}" if isinstance(v, float) else f"{k:36s} {v}")


if __name__ == "__main__":
    main()
