"""The few-row GEMM kernel chosen by measurement (engine/model/kernels/gemm.py, gemm_choice.py): the
dispatch takes each bucket's choice and stays within fp32 rounding of F.linear, the choice is cached
(a second start times nothing), a forced kernel is used, and the self-check keeps a wrong kernel out.
bf16 engines get their own choice (oneDNN or F.linear, never MKL's fp32-only packed path), within
bf16 rounding of bf16 F.linear, beside an fp32 engine's."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch
import torch.nn.functional as F
from tolerance import assert_bitwise, assert_within_bound, bf16_linear_bound, linear_bound

from trine.engine.config import EngineConfig
from trine.engine.model import invariant
from trine.engine.model.kernels import active, gemm, gemm_choice, onednn, packed
from trine.engine.model.lora import LoRALinear, linear_shapes

pytestmark = pytest.mark.skipif(
    not (packed.available() and onednn.available()), reason="this torch lacks MKL's or oneDNN's packed linear"
)
SHAPES = [(160, 96), (96, 64)]
BF16 = torch.bfloat16
needs_bf16 = pytest.mark.skipif(not onednn.available(BF16), reason="this torch lacks oneDNN's bf16 linear")


@pytest.fixture(autouse=True)
def own_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("TRINE_KERNEL_DIR", str(tmp_path / "kernels"))
    monkeypatch.setattr(packed, "MAX_INFLATION", 1e4)  # MKL pads small weights' copies past the bound


def layer(n_in=96, n_out=160, dtype=torch.float32) -> LoRALinear:
    torch.manual_seed(0)
    return LoRALinear(n_in, n_out, bias=True).requires_grad_(False).to(dtype)


def test_each_row_count_takes_its_buckets_choice_within_rounding_of_f_linear():
    per_bucket = {
        1: "linear",
        8: "onednn",
        32: "packed",
        128: "onednn",
        512: "linear",
        1024: "packed",
        2048: "onednn",
    }
    gemm.set_choice("auto", {(160, 96): per_bucket})
    m, square = layer(), layer(96, 96)
    # the smallest bucket at or above the rows; above the largest, F.linear
    for rows, want in [(1, "linear"), (2, "onednn"), (8, "onednn"), (9, "packed"), (100, "onednn")]:
        x = torch.randn(1, rows, 96)
        with torch.inference_mode():
            assert gemm.path(x, m.weight) == want, rows
            got = m(x)
        # kind 2, a priori: each kernel sums the 97-term dot products (bias included) in an order
        # of its own: within 2 gamma_97 sum|x w| of F.linear's
        assert_within_bound(got, F.linear(x, m.weight, m.bias), linear_bound(x, m.weight, m.bias), want)
    with torch.inference_mode():
        assert gemm.path(torch.randn(1500, 96), m.weight) == "onednn"  # a prefill chunk's bucket
        assert gemm.path(torch.randn(gemm.MAX_ROWS + 1, 96), m.weight) == "linear"
        # not measured: packed up to its own bound (where its packing pays), F.linear above
        assert gemm.path(torch.randn(packed.MAX_ROWS, 96), square.weight) == "packed"
        assert gemm.path(torch.randn(packed.MAX_ROWS + 1, 96), square.weight) == "linear"
        assert gemm.path(torch.randn(4, 96), square.weight) == "packed"  # a shape not measured
    assert gemm.path(torch.randn(4, 96, requires_grad=True), m.weight) == "linear"  # autograd: F.linear


@pytest.mark.parametrize("chosen", ["packed", "onednn"])
def test_a_copy_past_the_budget_takes_the_fastest_copy_free_kernel(monkeypatch, chosen):
    """A large model's LM head: its copy does not fit, so the call takes the copy-free kernel
    measured fastest for its shape and bucket, not F.linear."""
    monkeypatch.setattr(packed, "budget_bytes", lambda: 0)
    gemm.set_choice("auto", {(160, 96): {8: chosen}}, new_copy_free={(160, 96): {8: "transposed"}})
    m, x = layer(), torch.randn(5, 96)
    with torch.inference_mode():
        assert gemm.path(x, m.weight) == chosen
        assert_bitwise(m(x), gemm.transposed(x, m.weight, m.bias))  # kind 1: that kernel itself
    gemm.set_choice("auto", {(160, 96): {8: chosen}})  # no copy-free choice measured: F.linear
    with torch.inference_mode():
        assert_bitwise(m(x), F.linear(x, m.weight, m.bias))


def test_a_candidate_within_the_margin_of_the_default_does_not_move_the_dispatch():
    """Measured on a shared machine, a kernel 2 % faster than the default may be noise: the default
    stays; one 20 % faster is chosen. Above packed's row bound the default is F.linear."""
    near = {"packed": 1.0, "onednn": 0.98, "linear": 1.3}
    assert gemm_choice._winner(near, gemm.default(8)) == "packed"
    assert gemm_choice._winner({**near, "onednn": 0.8}, gemm.default(8)) == "onednn"
    assert gemm.default(packed.MAX_ROWS + 1) == "linear"
    assert gemm_choice._winner({"linear": 1.0, "onednn": 0.97}, gemm.default(packed.MAX_ROWS + 1)) == "linear"
    # the incumbent not timed (packed in a bf16 measurement): the fastest wins
    assert gemm_choice._winner({"onednn": 1.0, "linear": 1.02}, "packed") == "onednn"
    # bf16's incumbent is oneDNN: F.linear must beat it by more than the margin
    assert gemm_choice.incumbent(8, BF16) == "onednn" and gemm_choice.incumbent(8, torch.float32) == "packed"
    assert gemm_choice._winner({"onednn": 1.0, "linear": 0.97}, gemm_choice.incumbent(8, BF16)) == "onednn"


def test_the_choice_is_measured_once_then_read_from_the_cache():
    before = gemm_choice.timings
    first = gemm_choice.choose(SHAPES)
    measured = gemm_choice.timings - before
    assert measured == len(SHAPES) * len(gemm.BUCKETS) * 4 * gemm_choice.TIMED  # every pair, every kernel
    assert first.startswith("auto(") and sum(map(int, first[5:-1].replace(",", "").split()[1::2])) == len(
        SHAPES
    ) * len(gemm.BUCKETS)
    chosen, free = dict(gemm.choice), dict(gemm.copy_free)
    assert all(set(per.values()) <= {"transposed", "linear"} for per in free["float32"].values())
    gemm.set_choice("auto", {})
    assert gemm_choice.choose(SHAPES) == first  # a second start: read, nothing timed
    assert gemm_choice.timings - before == measured and gemm.choice == chosen and gemm.copy_free == free
    (path,) = gemm_choice.cache_path(gemm_choice.cache_key(SHAPES, list(gemm.CANDIDATES))).parent.glob(
        "gemm-choice-*.json"
    )
    key = json.loads(path.read_text())["key"]
    assert key["cpu"] and key["torch"] == torch.__version__ and key["threads"] == torch.get_num_threads()
    gemm_choice.choose(SHAPES[:1])  # other shapes: another key, measured
    assert gemm_choice.timings - before > measured


def test_a_kernel_off_f_linear_beyond_rounding_is_never_chosen(monkeypatch):
    good = gemm.CANDIDATES["onednn"]
    wrong = dataclasses.replace(good, run=lambda x, h, b: good.run(x, h, b) * (1 + 1e-3))
    monkeypatch.setitem(gemm.CANDIDATES, "onednn", wrong)
    chosen, times = gemm_choice.measure(SHAPES, ["packed", "onednn", "linear"])
    assert all(t["onednn"] is None for per in times.values() for t in per.values())
    assert all(name != "onednn" for per in chosen.values() for name in per.values())


@pytest.mark.parametrize("forced", ["packed", "onednn", "transposed", "linear"])
def test_a_forced_kernel_is_used_and_nothing_is_measured(forced):
    before = gemm_choice.timings
    kernels = active.active(torch.device("cpu"), torch.float32, SHAPES, forced)
    assert kernels["gemm"] == forced and gemm_choice.timings == before
    m = layer()
    x = torch.randn(16, 96)
    with torch.inference_mode():
        assert gemm.path(x, m.weight) == forced
        got = m(x)
    want = F.linear(x, m.weight, m.bias)
    if forced == "linear":
        assert_bitwise(got, want)  # kind 1: F.linear itself
    else:  # kind 2: another kernel's order, within 2 gamma_97 sum|x w|
        assert_within_bound(got, want, linear_bound(x, m.weight, m.bias), forced)


def test_the_start_line_names_the_gemm_path():
    kernels = active.active(torch.device("cpu"), torch.float32, SHAPES, "auto")
    line = active.startup_line(kernels, torch.device("cpu"), torch.float32)
    assert f" gemm={gemm.summary()} " in line and gemm.summary().startswith("auto(")
    # a CPU bf16 engine takes oneDNN where it serves bf16 (measured in auto: below); a GPU engine no candidate
    forced = active.active(torch.device("cpu"), BF16, SHAPES, "onednn")["gemm"]
    assert forced == ("onednn" if onednn.available(BF16) else "linear")
    assert active.active(torch.device("cuda"), BF16, SHAPES, "onednn")["gemm"] == "F.linear"


def test_the_config_field_names_itself_when_wrong():
    from trine.cli.serve import serve
    from trine.engine.config import GEMM_NAMES

    # the torch-free config and the CLI spell the dispatch's modes
    flag = next(p for p in serve.params if p.name == "gemm")
    assert GEMM_NAMES == gemm.MODES == tuple(flag.type.choices)
    assert EngineConfig().gemm == "auto"
    names = "auto, packed, onednn, transposed, linear"
    with pytest.raises(ValueError, match=f"^gemm: 'fast' is not one of {names}"):
        EngineConfig(gemm="fast")


def test_the_model_shapes_are_its_fused_and_plain_linears(tiny_model_dir):
    from trine.engine.model.weights import load_model

    model = load_model(tiny_model_dir, "cpu")
    cfg = model.cfg
    h, q, kv, inter = (
        cfg.hidden_size,
        cfg.num_heads * cfg.head_dim,
        cfg.num_kv_heads * cfg.head_dim,
        cfg.intermediate_size,
    )
    shapes = set(linear_shapes(model))
    assert {(q + 2 * kv, h), (q, h), (h, q), (2 * inter, h), (h, inter), (cfg.vocab_size, h)} <= shapes


def counted(summary: str) -> dict[str, int]:
    """`auto(onednn 9, linear 5)` -> {"onednn": 9, "linear": 5}."""
    words = summary.removeprefix("auto(").removesuffix(")").replace(",", "").split()
    return dict(zip(words[::2], map(int, words[1::2])))


@needs_bf16
def test_a_bf16_engines_choice_is_measured_cached_and_kept_beside_fp32s():
    before = gemm_choice.timings
    kernels = active.active(torch.device("cpu"), BF16, SHAPES, "auto")
    measured = gemm_choice.timings - before
    # every pair, the three bf16 candidates (packed serves fp32 only)
    assert measured == len(SHAPES) * len(gemm.BUCKETS) * 3 * gemm_choice.TIMED
    bf16 = dict(gemm.choice["bfloat16"])
    assert kernels["gemm"] == gemm.summary(BF16)
    assert set(counted(kernels["gemm"])) <= {"onednn", "transposed", "linear"}
    assert sum(counted(kernels["gemm"]).values()) == len(SHAPES) * len(gemm.BUCKETS)
    assert all(name != "packed" for per in bf16.values() for name in per.values())
    line = active.startup_line(kernels, torch.device("cpu"), BF16)
    assert f" gemm={gemm.summary(BF16)} " in line and "dtype=bfloat16" in line

    gemm.reset()
    assert gemm_choice.choose(SHAPES, "auto", BF16) == kernels["gemm"]  # a second start: read
    assert gemm_choice.timings - before == measured and gemm.choice["bfloat16"] == bf16
    bf16_key = gemm_choice.cache_key(sorted(SHAPES), ["onednn", "transposed", "linear"], BF16)
    fp32_key = gemm_choice.cache_key(sorted(SHAPES), list(gemm.CANDIDATES))
    assert bf16_key["dtype"] == "bfloat16" and "dtype" not in fp32_key  # fp32's caches stay valid
    saved = json.loads(gemm_choice.cache_path(bf16_key).read_text())
    assert saved["key"] == bf16_key

    # an fp32 engine in the same process: its own measurement and choice, the bf16 one kept
    fp32_summary = gemm_choice.choose(SHAPES, "auto")
    assert gemm_choice.timings - before == measured + len(SHAPES) * len(gemm.BUCKETS) * 4 * gemm_choice.TIMED
    assert gemm.choice["bfloat16"] == bf16 and gemm.summary(BF16) == kernels["gemm"]
    assert gemm.summary() == fp32_summary and gemm.choice["float32"] != {}
    gemm_choice.choose(SHAPES, "linear", BF16)  # forcing bf16 leaves fp32's auto alone
    assert gemm.summary() == fp32_summary and gemm.summary(BF16) == "linear"


@needs_bf16
def test_each_dtype_takes_its_own_choice_and_bf16_stays_within_bf16_rounding():
    bf16_choice = {1: "onednn", 8: "linear", 32: "onednn", 128: "linear", 512: "onednn", 1024: "linear"}
    gemm.set_choice("auto", {(160, 96): {b: "packed" for b in gemm.BUCKETS}})
    gemm.set_choice("auto", {(160, 96): {**bf16_choice, 2048: "onednn"}}, BF16)
    m32, m16 = layer(), layer(dtype=BF16)
    for rows, want in [(1, "onednn"), (5, "linear"), (9, "onednn"), (100, "linear"), (300, "onednn")]:
        x = torch.randn(rows, 96).to(BF16)
        with torch.inference_mode():
            assert gemm.path(x, m16.weight) == want, rows
            assert gemm.path(x.float(), m32.weight) == "packed", rows  # fp32's own choice
            got = m16(x)
        ref = F.linear(x, m16.weight, m16.bias)
        assert got.dtype == BF16
        # kind 2, a priori: two fp32 accumulations of the same bf16 products, each rounded to bf16
        assert_within_bound(got, ref, bf16_linear_bound(x, m16.weight, m16.bias, ref), want)
    with torch.inference_mode():
        square = layer(96, 96, BF16)
        assert gemm.path(torch.randn(4, 96).to(BF16), square.weight) == "linear"  # not measured: F.linear
        assert gemm.path(torch.randn(4, 96).to(BF16), m32.weight) == "linear"  # dtypes differ
    assert gemm.path(torch.randn(4, 96, requires_grad=True).to(BF16), m16.weight) == "linear"  # autograd


@needs_bf16
def test_bf16_never_takes_packed_and_a_forced_packed_is_f_linear():
    gemm.set_choice("auto", {(160, 96): {b: "packed" for b in gemm.BUCKETS}}, BF16)  # a stale choice
    m = layer(dtype=BF16)
    x = torch.randn(16, 96).to(BF16)
    with torch.inference_mode():
        assert gemm.path(x, m.weight) == "linear"
    assert not gemm.CANDIDATES["packed"].available(BF16) and not packed.applies(x, m.weight)
    chosen, times = gemm_choice.measure(SHAPES[:1], ["onednn", "linear"], BF16)
    assert all(set(t) == {"onednn", "linear"} for per in times.values() for t in per.values())
    before = gemm_choice.timings
    kernels = active.active(torch.device("cpu"), BF16, SHAPES, "packed")
    assert kernels["gemm"] == "linear" and gemm_choice.timings == before  # forced: nothing measured
    with torch.inference_mode():
        assert gemm.path(x, m.weight) == "linear"
        got = m(x)
    assert_bitwise(got, F.linear(x, m.weight, m.bias))  # kind 1: F.linear itself


@needs_bf16
def test_a_bf16_kernel_off_beyond_bf16_rounding_is_never_chosen(monkeypatch):
    """5 % off (bf16 rounding is 2^-8 of a value, 0.4 %): failed, every pair."""
    good = gemm.CANDIDATES["onednn"]
    wrong = dataclasses.replace(good, run=lambda x, h, b: good.run(x, h, b) * 1.05)
    monkeypatch.setitem(gemm.CANDIDATES, "onednn", wrong)
    chosen, times = gemm_choice.measure(SHAPES, ["onednn", "linear"], BF16)
    assert all(t["onednn"] is None for per in times.values() for t in per.values())
    assert all(name == "linear" for per in chosen.values() for name in per.values())


@needs_bf16
def test_training_and_batch_invariance_never_take_a_bf16_candidate(monkeypatch):
    """The forward of a trainer (autograd) and the batch-invariant kernels keep F.linear in bf16."""
    gemm.set_choice("onednn", {}, BF16)

    def refuse(*args):
        raise AssertionError("oneDNN took a call it must not")

    monkeypatch.setattr(onednn, "linear", refuse)
    m = layer(dtype=BF16)
    x = torch.randn(8, 96).to(BF16)
    m(x.clone().requires_grad_(True)).sum().backward()  # training: x needs a gradient
    m.weight.requires_grad_(True)
    m(x).sum().backward()  # full fine-tuning: the weight needs one
    m.weight.requires_grad_(False)
    invariant.enable(True)
    try:
        with torch.inference_mode():
            m(x)  # batch-invariant: its own row-tiled GEMMs
    finally:
        invariant.enable(False)
    with torch.inference_mode(), pytest.raises(AssertionError, match="oneDNN took"):
        m(x)  # the same call, inference and variant kernels: oneDNN's
