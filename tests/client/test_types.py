"""The public types: construction, conversion and validation, and field parity with PyTRIO's."""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest
import torch

import trine as trio
from trine.types import ImageChunk, ModelInput, TensorData, Usage


def test_importing_trine_loads_neither_torch_nor_the_engine():
    code = "import sys, trine; print('torch' in sys.modules, 'trine.engine' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.split() == ["False", "False"]


def test_model_input_ints_roundtrip_and_length():
    mi = ModelInput.from_ints([5, 6, 7])
    assert mi.to_ints() == [5, 6, 7] and mi.tolist() == [5, 6, 7]
    assert len(mi) == mi.length == 3 and not mi.has_images and not mi.is_empty
    grown = mi.append_int(8).append(trio.EncodedTextChunk(tokens=[9]))
    assert grown.to_ints() == [5, 6, 7, 8, 9] and mi.to_ints() == [5, 6, 7]
    assert ModelInput.empty().is_empty and ModelInput.from_ints([]).is_empty


def test_model_input_with_images():
    img = ImageChunk(data=b"\x89PNG", format="png", expected_tokens=4)
    mi = ModelInput(chunks=[trio.EncodedTextChunk(tokens=[1, 2]), img])
    assert len(mi) == 6 and mi.has_images
    with pytest.raises(ValueError, match="image"):
        mi.to_ints()
    with pytest.raises(ValueError, match="expected_tokens"):
        len(ModelInput(chunks=[ImageChunk(data=b"x", format="jpeg")]))
    # base64 strings are accepted, and JSON carries base64
    b64 = ImageChunk(data="iVBO", format="png")
    assert b64.data == b"\x89PN" and '"iVBO"' in b64.model_dump_json()
    with pytest.raises(ValueError, match="base64"):
        ImageChunk(data="not base64!", format="png")
    with pytest.raises(ValueError):
        ImageChunk(data=b"x", format="gif")


@pytest.mark.parametrize(
    "value, dtype, shape",
    [
        ([1, 2, 3], "int64", [3]),
        ([0.5, 1.0], "float32", [2]),
        ([[1, 2], [3, 4]], "int64", [2, 2]),
        (np.arange(6, dtype=np.int32).reshape(2, 3), "int64", [2, 3]),
        (np.ones(3, dtype=np.float64), "float32", [3]),
        (torch.tensor([[1.5], [2.5]], dtype=torch.bfloat16), "float32", [2, 1]),
        (torch.tensor([7, 8]), "int64", [2]),
    ],
)
def test_tensor_data_from_lists_numpy_and_torch(value, dtype, shape):
    t = TensorData.model_validate(value)
    assert (t.dtype, t.shape) == (dtype, shape)
    assert t.to_numpy().shape == tuple(shape)
    assert list(t.to_torch().shape) == shape
    assert t.tolist() == list(t.data) and len(t) == int(np.prod(shape))


def test_tensor_data_validation():
    with pytest.raises(ValueError, match="do not fit shape"):
        TensorData(data=[1, 2, 3], dtype="int64", shape=[2, 2])
    with pytest.raises(ValueError, match="non-integer"):
        TensorData(data=[1.5], dtype="int64")
    with pytest.raises(ValueError, match="numbers"):
        TensorData.model_validate(["a", "b"])
    with pytest.raises(ValueError):
        TensorData(data=[1.0], dtype="float16")
    assert TensorData(data=[3], dtype="float32").data == [3.0]


def test_datum_coerces_loss_inputs():
    d = trio.Datum(
        model_input=ModelInput.from_ints([1, 2]),
        loss_fn_inputs={
            "target_tokens": [2, 3],
            "weights": np.array([0.0, 1.0]),
            "advantages": torch.tensor([0.5, 0.5]),
        },
    )
    assert d.loss_fn_inputs["target_tokens"].dtype == "int64"
    assert d.loss_fn_inputs["weights"].dtype == "float32"
    assert d.loss_fn_inputs["advantages"].data == [0.5, 0.5]
    with pytest.raises(ValueError):
        trio.Datum(model_input=ModelInput.from_ints([1]), loss_fn_inputs={}, extra_field=1)


def test_sampling_params_defaults_validation_and_wire():
    p = trio.SamplingParams()
    assert (p.max_tokens, p.seed, p.stop, p.temperature, p.top_k, p.top_p) == (None, None, None, 1, -1, 1)
    assert trio.SamplingParams(max_tokens=4, stop="\n").to_wire() == {
        "max_tokens": 4,
        "temperature": 1,
        "top_k": -1,
        "top_p": 1,
        "stop": ["\n"],
    }
    assert trio.SamplingParams(max_tokens=4, stop=[2, 3], seed=7).to_wire()["stop_token_ids"] == [2, 3]
    assert trio.SamplingParams(max_tokens=4, stop=["a", "b"]).to_wire()["stop"] == ["a", "b"]
    for bad, field in [
        ({"max_tokens": 0}, "max_tokens"),
        ({"temperature": -1}, "temperature"),
        ({"top_k": 0}, "top_k"),
        ({"top_p": 0}, "top_p"),
        ({"top_p": 1.5}, "top_p"),
    ]:
        with pytest.raises(ValueError, match=field):
            trio.SamplingParams(**bad)


def test_adam_params_defaults_and_validation():
    a = trio.AdamParams()
    assert (a.learning_rate, a.beta1, a.beta2, a.eps, a.weight_decay, a.grad_clip_norm) == (
        1e-4,
        0.9,
        0.95,
        1e-12,
        0,
        0,
    )
    with pytest.raises(ValueError, match="learning_rate"):
        trio.AdamParams(learning_rate=-1)
    with pytest.raises(ValueError, match="beta2"):
        trio.AdamParams(beta2=1.0)
    with pytest.raises(ValueError, match="learning_rate"):
        trio.AdamParams(learning_rate=float("nan"))


def test_lora_config_validation():
    assert trio.LoraConfig().rank == 32
    with pytest.raises(ValueError, match=r"rank must be in \[4, 64\]"):
        trio.LoraConfig(rank=2)
    with pytest.raises(ValueError, match="at least one"):
        trio.LoraConfig(train_mlp=False, train_attn=False, train_unembed=False)


def test_usage_sums_by_phase_and_reads_the_wire():
    a = Usage.from_wire(
        {"input_tokens": 9, "prompt_tokens": 10, "prefill_tokens": 4, "cached_tokens": 6, "sample_tokens": 5}
    )
    b = Usage.from_wire({"train_tokens": 12, "loss_tokens": 3, "cost": 0.5})
    total = a + b
    assert (
        total.prompt_tokens,
        total.prefill_tokens,
        total.cached_tokens,
        total.sample_tokens,
        total.train_tokens,
        total.loss_tokens,
    ) == (10, 4, 6, 5, 12, 3)
    assert a.cost is None and b.cost == 0.5 and total.cost is None
    assert (b + b).cost == 1.0
    assert (total - a) == b.model_copy(update={"cost": None}) and (b + b - b) == b


def test_prompt_logprobs_is_a_list_with_usage():
    lp = trio.types.PromptLogprobs([None, -1.0], usage=Usage(prompt_tokens=2, prefill_tokens=2))
    assert lp == [None, -1.0] and lp.usage.prefill_tokens == 2


def test_same_type_names_and_fields_as_pytrio():
    pt = pytest.importorskip("pytrio.types")
    for name in dir(pt):
        theirs = getattr(pt, name)
        if not hasattr(theirs, "model_fields"):
            continue
        ours = getattr(trio.types, name)
        assert set(theirs.model_fields) <= set(ours.model_fields), name
        for field, info in theirs.model_fields.items():
            if not info.is_required():
                assert ours.model_fields[field].get_default(call_default_factory=True) == info.get_default(
                    call_default_factory=True
                ), (name, field)
