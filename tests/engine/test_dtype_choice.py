"""`--dtype auto` on a CPU (engine/model/kernels/dtype_choice.py): bf16 only where the model's GEMMs
are measured at least MIN_SPEEDUP times faster in bf16 (each dtype timed on the fastest of the GEMM
kernels an engine in it would take), the choice cached, a broken bf16 kernel kept out, and the
engine's start line saying what was chosen and why."""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
import types

import pytest
import torch
import torch.nn.functional as F

from trine.engine.model.kernels import dtype_choice, gemm, onednn
from trine.engine.model.lora import linear_shape_counts
from trine.engine.model.weights import auto_dtype, meta_model, read_config

COUNTS = {(160, 96): 3, (96, 64): 3, (512, 96): 1}


@pytest.fixture(autouse=True)
def measured(tmp_path, monkeypatch):
    """Auto measures (the suite pins it to float32 elsewhere), into a cache of this test's own."""
    monkeypatch.setenv("TRINE_KERNEL_DIR", str(tmp_path / "kernels"))
    monkeypatch.delenv(dtype_choice.PIN, raising=False)


def timed_as(monkeypatch, speedup: float) -> None:
    """Every GEMM pair times fp32 at `speedup` x bf16's seconds."""
    monkeypatch.setattr(dtype_choice, "_time_pair", lambda fp32, x, w: (speedup * 1e-3, 1e-3))


@pytest.mark.parametrize(("speedup", "want"), [(2.5, torch.bfloat16), (1.9, torch.float32)])
def test_bf16_only_where_it_is_measured_twice_as_fast(monkeypatch, speedup, want):
    timed_as(monkeypatch, speedup)
    chosen = dtype_choice.choose(COUNTS, torch.device("cpu"))
    assert chosen.dtype == want and chosen.speedup == pytest.approx(speedup)
    assert chosen.reason == f"auto, bf16 GEMMs {speedup:.2f}x fp32's here, bf16 needs 2x"


def test_the_slower_regime_decides(monkeypatch):
    """Decode-sized rows 3x faster but prefill-sized only 1.5x: fp32."""
    monkeypatch.setattr(
        dtype_choice, "_time_pair", lambda fp32, x, w: ((3.0 if x.shape[0] == 16 else 1.5) * 1e-3, 1e-3)
    )
    assert dtype_choice.choose(COUNTS, torch.device("cpu")).dtype == torch.float32


def test_each_dtype_is_timed_on_the_candidates_its_engine_would_take(monkeypatch):
    seen = []

    def record(cands, x, w):
        seen.append({gemm.dtype_name(dt): [c.name for c in cs] for dt, cs in cands.items()})
        return 3e-3, 1e-3

    monkeypatch.setattr(dtype_choice, "_time_pair", record)
    dtype_choice.choose(COUNTS, torch.device("cpu"))
    fp32 = [n for n, c in gemm.CANDIDATES.items() if c.available(torch.float32)]
    bf16 = (
        ["onednn", "transposed", "linear"] if onednn.available(torch.bfloat16) else ["transposed", "linear"]
    )
    assert seen and all(s == {"float32": fp32, "bfloat16": bf16} for s in seen)


def test_each_dtypes_time_is_its_fastest_candidates():
    """A kernel that sleeps 20 ms beside F.linear on 16 x 64 x 96 (microseconds): bf16 takes F.linear's."""
    linear = gemm.CANDIDATES["linear"]
    slow = dataclasses.replace(
        linear, name="slow", run=lambda x, h, b: (time.sleep(0.02), linear.run(x, h, b))[1]
    )
    x, w = torch.randn(16, 64), torch.randn(96, 64)
    fp32_s, bf16_s = dtype_choice._time_pair({torch.float32: [slow], torch.bfloat16: [slow, linear]}, x, w)
    assert fp32_s >= 0.02 > bf16_s


def test_measured_once_then_read_from_the_cache():
    before = dtype_choice.timings
    first = dtype_choice.choose(COUNTS, torch.device("cpu"))
    measured = dtype_choice.timings - before
    assert measured > 0 and first.speedup > 0
    again = dtype_choice.choose(COUNTS, torch.device("cpu"))
    assert again == first and dtype_choice.timings - before == measured  # nothing timed
    dtype_choice.choose({(160, 96): 3}, torch.device("cpu"))  # other shapes: measured
    assert dtype_choice.timings - before > measured


def test_a_bf16_kernel_off_beyond_its_rounding_is_never_chosen(monkeypatch):
    """A bf16 GEMM 5 % off fp32's (bf16 rounding is 2^-8 a factor) is not timed: auto is fp32."""
    wrong = types.SimpleNamespace(
        linear=lambda x, w, b=None: F.linear(x, w, b) * (1.05 if x.dtype == torch.bfloat16 else 1.0)
    )
    monkeypatch.setattr(dtype_choice, "F", wrong)
    before = dtype_choice.timings
    chosen = dtype_choice.choose(COUNTS, torch.device("cpu"))
    assert chosen.dtype == torch.float32 and chosen.speedup == 0.0
    assert dtype_choice.timings == before


def test_cuda_is_bf16_and_a_pin_is_kept_without_measuring(monkeypatch):
    before = dtype_choice.timings
    assert dtype_choice.choose(COUNTS, torch.device("cuda")).dtype == torch.bfloat16
    monkeypatch.setenv(dtype_choice.PIN, "bfloat16")
    pinned = dtype_choice.choose(COUNTS, torch.device("cpu"))
    assert pinned.dtype == torch.bfloat16 and pinned.reason == "auto, TRINE_AUTO_DTYPE=bfloat16"
    monkeypatch.setenv(dtype_choice.PIN, "fp16")
    with pytest.raises(ValueError, match="^TRINE_AUTO_DTYPE: 'fp16' is not one of float32, bfloat16"):
        dtype_choice.choose(COUNTS, torch.device("cpu"))
    assert dtype_choice.timings == before


def test_a_model_is_weighed_by_its_forwards_gemms(tiny_model_dir, monkeypatch):
    """Each shape counts once per layer that runs it; the LM head once."""
    cfg = read_config(tiny_model_dir)
    counts = linear_shape_counts(meta_model(cfg))
    h, inter = cfg.hidden_size, cfg.intermediate_size
    assert counts[(cfg.vocab_size, h)] == 1
    assert counts[(2 * inter, h)] == counts[(h, inter)] == cfg.num_layers
    timed_as(monkeypatch, 2.0)
    assert auto_dtype(tiny_model_dir, torch.device("cpu")).dtype == torch.bfloat16


@pytest.mark.parametrize(
    ("dtype", "note"), [("auto", "auto, bf16 GEMMs 3.00x fp32's here, bf16 needs 2x"), ("float32", "forced")]
)
def test_the_engine_starts_in_the_dtype_chosen_and_says_how(tiny_model_dir, monkeypatch, caplog, dtype, note):
    from trine.engine.config import EngineConfig, SamplerConfig
    from trine.engine.runtime.worker import EngineWorker

    timed_as(monkeypatch, 3.0)
    caplog.set_level(logging.INFO, logger="trine.worker")

    async def main():
        loop = asyncio.get_running_loop()
        config = EngineConfig(
            device="cpu", num_threads=1, dtype=dtype, sampler=SamplerConfig(kv_cache_bytes=8 << 20)
        )
        w = EngineWorker("tiny", tiny_model_dir, config)
        await loop.run_in_executor(None, w.start, loop)
        await loop.run_in_executor(None, w.stop)
        return w.model.dtype

    want = torch.bfloat16 if dtype == "auto" else torch.float32
    assert asyncio.run(main()) == want
    (line,) = [
        r.getMessage() for r in caplog.records if r.name == "trine.worker" and "kernels " in r.getMessage()
    ]
    assert f"dtype={str(want).removeprefix('torch.')} ({note}) threads=1" in line
