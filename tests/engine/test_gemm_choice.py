"""The few-row GEMM kernel chosen by measurement (engine/model/kernels/gemm.py, gemm_choice.py): the
dispatch takes each bucket's choice and stays within fp32 rounding of F.linear, the choice is cached
(a second start times nothing), a forced kernel is used, and the self-check keeps a wrong kernel out."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch
import torch.nn.functional as F
from tolerance import assert_bitwise, assert_within_bound, linear_bound

from trine.engine.config import EngineConfig
from trine.engine.model.kernels import active, gemm, gemm_choice, onednn, packed
from trine.engine.model.lora import LoRALinear, linear_shapes

pytestmark = pytest.mark.skipif(
    not (packed.available() and onednn.available()), reason="this torch lacks MKL's or oneDNN's packed linear"
)
SHAPES = [(160, 96), (96, 64)]


@pytest.fixture(autouse=True)
def own_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("TRINE_KERNEL_DIR", str(tmp_path / "kernels"))
    monkeypatch.setattr(packed, "MAX_INFLATION", 1e4)  # MKL pads small weights' copies past the bound


def layer(n_in=96, n_out=160) -> LoRALinear:
    torch.manual_seed(0)
    return LoRALinear(n_in, n_out, bias=True).requires_grad_(False)


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


def test_the_choice_is_measured_once_then_read_from_the_cache():
    before = gemm_choice.timings
    first = gemm_choice.choose(SHAPES)
    measured = gemm_choice.timings - before
    assert measured == len(SHAPES) * len(gemm.BUCKETS) * 3 * gemm_choice.TIMED  # every pair, every kernel
    assert first.startswith("auto(") and sum(map(int, first[5:-1].replace(",", "").split()[1::2])) == len(
        SHAPES
    ) * len(gemm.BUCKETS)
    chosen = dict(gemm.choice)
    gemm.set_choice("auto", {})
    assert gemm_choice.choose(SHAPES) == first  # a second start: read, nothing timed
    assert gemm_choice.timings - before == measured and gemm.choice == chosen
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


@pytest.mark.parametrize("forced", ["packed", "onednn", "linear"])
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
    assert active.active(torch.device("cpu"), torch.bfloat16, SHAPES, "onednn")["gemm"] == "F.linear"


def test_the_config_field_names_itself_when_wrong():
    from trine.cli.serve import serve
    from trine.engine.config import GEMM_NAMES

    # the torch-free config and the CLI spell the dispatch's modes
    flag = next(p for p in serve.params if p.name == "gemm")
    assert GEMM_NAMES == gemm.MODES == tuple(flag.type.choices)
    assert EngineConfig().gemm == "auto"
    with pytest.raises(ValueError, match="^gemm: 'fast' is not one of auto, packed, onednn, linear"):
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
