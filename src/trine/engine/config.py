"""The engine's configuration, built once (by `trine serve`, `Service(engine=...)` or a test) and
passed down unchanged: `Service` → `LocalEngine` / `ray_engines` → `EngineWorker` → `Sampler`
(`EngineConfig.sampler`) and `Trainer` (`EngineConfig.trainer`).

Invariants
- Every config is frozen and checked once, in `__post_init__`: a bad value is a `ValueError`
  naming its field, raised where the config is built, before any weights load.
- Every field carries its meaning (`metadata["doc"]`) and, where `trine serve` sets it, the flag
  (`metadata["flag"]`); the docs' engine table (docs/limits.md) is generated from them, and
  tests/docs/test_docs_tables.py fails on a field without a meaning.
- No torch: the front ends and the CLI build a config without loading the engine, and it pickles
  (a Ray replica gets it as it was built).

The sampler's and the trainer's measured constants are defined here, so the config's defaults and
the code that reads them are one number (docs/serving.md, "Where the engine's constants come from").
"""

from __future__ import annotations

from dataclasses import dataclass, field

DTYPE_NAMES = ("float32", "bfloat16")  # the model dtypes the engine runs (model/weights.py maps them)
# EngineConfig.gemm: kernels/gemm.py's MODES
GEMM_NAMES = ("auto", "packed", "onednn", "transposed", "linear")

TENANT_SHARE = 0.5  # of max_running and of the KV pool, per tenant while another one is active
# Prefill rows below which a chunk is not cut while others decode: fp32 GEMMs of fewer rows run well
# below their peak rate (docs/serving.md, "Where the engine's constants come from").
MIN_PREFILL_TOKENS = 128
BURST_SECONDS = 0.5  # requests arriving within this of one another are one batch sent together
BURST_STALL_SECONDS = 5.0  # the most a batch's first sequences wait, undecoded, for its other prompts
# The shortest token prefix that datums of one run share and the trainer computes once: a shorter
# one costs more to split out than it saves (benchmarks/prefix_threshold.py).
MIN_SHARED_TOKENS = 16
# A hybrid model's prompt keeps a state snapshot every this many tokens: a prompt that diverges
# from a cached one recomputes at most this many tokens more than a dense model would, and a
# snapshot of Qwen3.5-0.8B is 19 MiB (docs/architecture.md, "Prefix cache of a hybrid model").
STATE_SNAPSHOT_TOKENS = 512
# Vision-language models: the encoded images the engine keeps, by content hash (a 448x448 image is
# 196 vision tokens, 0.8 MiB of features for Qwen3.5-0.8B in bf16: hundreds of images).
IMAGE_CACHE_BYTES = 256 * 2**20


def _knob(default, doc: str, flag: str | None = None):
    """A config field with its meaning and the `trine serve` flag that sets it (None: no flag)."""
    return field(default=default, metadata={"doc": doc, "flag": flag})


def _check(ok: bool, name: str, value, rule: str) -> None:
    if not ok:
        raise ValueError(f"{name}: {value!r} is not {rule}")


def _positive_int(obj, *names: str) -> None:
    for name in names:
        v = getattr(obj, name)
        _check(isinstance(v, int) and not isinstance(v, bool) and v >= 1, name, v, "an integer >= 1")


def _seconds(obj, name: str, *, zero: bool) -> None:
    v = getattr(obj, name)
    ok = isinstance(v, (int, float)) and not isinstance(v, bool) and (v >= 0 if zero else v > 0)
    _check(ok, name, v, "a number of seconds >= 0" if zero else "a number of seconds > 0")


def _share(obj, name: str) -> None:
    v = getattr(obj, name)
    ok = isinstance(v, (int, float)) and not isinstance(v, bool) and 0 < v <= 1
    _check(ok, name, v, "a share in (0, 1]")


@dataclass(frozen=True)
class SamplerConfig:
    """The sampler's knobs (`Sampler(model, tokenizer, config)`): the KV pool, the step's batch, and
    how prefill shares the engine with decoding and tenants with each other (sampler/scheduler.py)."""

    kv_cache_bytes: int | None = _knob(
        None, "bytes of the paged KV pool; unset: 512 MiB on CPU, half the free memory on a GPU"
    )
    block_size: int = _knob(16, "tokens per KV block: the prefix cache's unit")
    max_batch_tokens: int = _knob(2048, "prompt positions prefilled per engine step")
    max_running: int = _knob(
        64, "sequences decoding at once (a hybrid model preallocates a recurrent-state slot for each)"
    )
    enable_prefix_cache: bool = _knob(True, "serve a prompt's cached KV blocks instead of prefilling them")
    prefill_share: float = _knob(0.5, "share of decode time an old or long prompt's prefill may take")
    prefill_step_seconds: float = _knob(0.25, "target seconds of one prefill chunk while others decode")
    idle_prefill_seconds: float = _knob(1.0, "target seconds of one prefill chunk when nothing decodes")
    min_prefill_tokens: int = _knob(
        MIN_PREFILL_TOKENS, "fewest positions of a prefill chunk while others decode (GEMM efficiency)"
    )
    burst_seconds: float = _knob(
        BURST_SECONDS,
        "one tenant's requests arriving within this of one another prefill as one batch (idle-sized chunks)",
    )
    burst_stall_seconds: float = _knob(
        BURST_STALL_SECONDS,
        "the most such a batch's first sequences wait, undecoded, while its other prompts prefill",
    )
    tenant_share: float = _knob(
        TENANT_SHARE, "share of `max_running` and the KV pool a key holds while another is active"
    )
    fair: bool = _knob(True, "admit waiting requests fairly across keys (off: first come, first served)")
    state_cache_bytes: int | None = _knob(
        None,
        "hybrid models (Qwen3.5): bytes of recurrent-state snapshots the prefix cache keeps, least "
        "recently used evicted first; unset: 512 MiB on CPU, a quarter of the free memory on a GPU",
    )
    state_snapshot_tokens: int = _knob(
        STATE_SNAPSHOT_TOKENS,
        "hybrid models: a prompt's state is snapshotted every this many tokens (a multiple of "
        "`block_size`), so prompts sharing a long prefix share it",
    )
    full_weights_kv_cache_bytes: int | None = _knob(
        None,
        "bytes of the KV pool of each full fine-tuning snapshot being sampled (its own sampler); "
        "unset: a quarter of the base pool's",
    )

    def __post_init__(self):
        for name in ("kv_cache_bytes", "full_weights_kv_cache_bytes"):
            if getattr(self, name) is not None:
                _positive_int(self, name)
        if self.state_cache_bytes is not None:
            v = self.state_cache_bytes
            ok = isinstance(v, int) and not isinstance(v, bool) and v >= 0
            _check(ok, "state_cache_bytes", v, "an integer >= 0")
        _positive_int(self, "state_snapshot_tokens")
        _positive_int(self, "block_size", "max_batch_tokens", "max_running", "min_prefill_tokens")
        _share(self, "prefill_share")
        _share(self, "tenant_share")
        _seconds(self, "prefill_step_seconds", zero=False)
        _seconds(self, "idle_prefill_seconds", zero=False)
        _seconds(self, "burst_seconds", zero=True)
        _seconds(self, "burst_stall_seconds", zero=True)
        _check(
            self.state_snapshot_tokens % self.block_size == 0,
            "state_snapshot_tokens",
            self.state_snapshot_tokens,
            f"a multiple of block_size ({self.block_size})",
        )


@dataclass(frozen=True)
class TrainerConfig:
    """The trainer's knobs (`Trainer(model, base_model=..., config=...)`): how a forward_backward is
    cut into micro-batches and LM-head chunks, and whether shared prefixes are computed once."""

    micro_batch_tokens: int = _knob(4096, "tokens of one training micro-batch (rows are packed up to it)")
    full_micro_batch_tokens: int = _knob(
        1024,
        "tokens of one micro-batch of a full fine-tuning run (its gradients and AdamW state leave "
        "less room for activations)",
    )
    logits_chunk_tokens: int = _knob(1024, "positions whose logits the LM head computes at once")
    prefix_sharing: bool = _knob(
        True,
        "train each token that datums of one run share once (off: every datum computed whole)",
        flag="--train-prefix-sharing/--no-train-prefix-sharing",
    )
    min_shared_tokens: int = _knob(MIN_SHARED_TOKENS, "the shortest shared prefix that is computed once")

    def __post_init__(self):
        _positive_int(
            self, "micro_batch_tokens", "full_micro_batch_tokens", "logits_chunk_tokens", "min_shared_tokens"
        )


@dataclass(frozen=True)
class EngineConfig:
    """One engine (a base model's replica): where and how it computes, and its sampler's and
    trainer's knobs. `EngineConfig()` is what `trine serve` runs with no flags."""

    device: str | None = _knob(
        None, "torch device (`cpu`, `cuda`, `cuda:1`); unset: CUDA if present, else CPU"
    )
    num_threads: int | None = _knob(
        None,
        "CPU threads of the engine (at most; fewer beside busy processes); unset: torch's",
        flag="--threads",
    )
    dtype: str = _knob(
        "auto",
        "model dtype: `auto` (bfloat16 on CUDA; on a CPU bfloat16 only where the model's GEMMs are "
        "measured at least 2x faster in it, else float32; measured once and cached), `float32` or `bfloat16`",
        flag="--dtype",
    )
    batch_invariant: bool = _knob(
        False,
        "batch-invariant kernels: the sampler's logprobs equal the trainer's bit for bit (slower)",
        flag="--batch-invariant",
    )
    gemm: str = _knob(
        "auto",
        "few-row inference GEMM kernel: `auto` (measured at start, per shape and row count), "
        "`packed` (MKL), `onednn` or `linear` (F.linear)",
        flag="--gemm",
    )
    full_ft_memory_bytes: int | None = _knob(
        None,
        "memory full fine-tuning runs may hold together on a replica (their weights, a snapshot, "
        "gradients, fp32 masters, AdamW state); unset: three quarters of the memory free when the "
        "engine starts",
        flag="--full-ft-memory",
    )
    image_cache_bytes: int = _knob(
        IMAGE_CACHE_BYTES,
        "vision-language models: bytes of encoded images (the vision tower's output) kept by content "
        "hash for the sampler and the trainer, least recently used evicted first; 0 keeps none",
    )
    sampler: SamplerConfig = field(default_factory=SamplerConfig, metadata={"doc": "the sampler's knobs"})
    trainer: TrainerConfig = field(default_factory=TrainerConfig, metadata={"doc": "the trainer's knobs"})

    def __post_init__(self):
        if self.device is not None:
            _check(isinstance(self.device, str) and self.device != "", "device", self.device, "a device name")
        for name in ("num_threads", "full_ft_memory_bytes"):
            if getattr(self, name) is not None:
                _positive_int(self, name)
        v = self.image_cache_bytes
        ok = isinstance(v, int) and not isinstance(v, bool) and v >= 0
        _check(ok, "image_cache_bytes", v, "an integer >= 0")
        if self.dtype not in ("auto", *DTYPE_NAMES):
            raise ValueError(f"dtype: {self.dtype!r} is not one of auto, {', '.join(DTYPE_NAMES)}")
        _check(
            isinstance(self.batch_invariant, bool), "batch_invariant", self.batch_invariant, "True or False"
        )
        if self.gemm not in GEMM_NAMES:
            raise ValueError(f"gemm: {self.gemm!r} is not one of {', '.join(GEMM_NAMES)}")
        _check(isinstance(self.sampler, SamplerConfig), "sampler", self.sampler, "a SamplerConfig")
        _check(isinstance(self.trainer, TrainerConfig), "trainer", self.trainer, "a TrainerConfig")
