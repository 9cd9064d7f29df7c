"""The embedded default model (real SmolLM2 weights): slow tier, `make test-slow`."""

import pytest
import torch

from trine.engine.model.default_model import ensure_default_model
from trine.engine.model.tokenizer import Tokenizer
from trine.engine.model.weights import load_model

pytestmark = pytest.mark.slow


def test_default_model_converts_once_and_answers():
    path = ensure_default_model()
    assert (path / "model.safetensors").is_file() and (path / "chat_template.jinja").is_file()
    assert ensure_default_model() == path  # second call: no conversion
    model, tok = load_model(path), Tokenizer(path)
    ids = tok.encode("The capital of France is")
    with torch.no_grad():
        for _ in range(3):
            ids.append(int(model(torch.tensor([ids]))[0, -1].argmax()))
    assert "Paris" in tok.decode(ids)
