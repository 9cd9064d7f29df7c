"""Tiny vision-language checkpoints and real image files for the image tests.

    build_tiny_qwen3_5_vl_dir(path)   # a random `qwen3_5` checkpoint: text + vision
    add_vision_processor(model_dir)   # a servable text model (conftest: tiny_vision_frontend_dir)
    png(h, w), jpeg(h, w, mode="L")   # image files of random pixels

The second is for the front ends' tests: a tiny Llama (servable today) whose directory also holds
a `qwen3_5` processor (preprocessor_config.json, vision token ids, a chat template that places
images), so the planes read and check images against a real `VisionSpec` while its engine serves
text only (`VisionSpec.served` is False: a valid image is refused as not served yet).
"""

from __future__ import annotations

import io
import json
import shutil
from pathlib import Path

import numpy as np
import torch
from PIL import Image

# tests/fixtures' SmolLM2 tokenizer (conftest.TOKENIZER_DIR: not imported, as tests/server has a conftest too)
TOKENIZER_DIR = Path(__file__).parent / "fixtures" / "smollm2-tokenizer"
IMAGE_TOKEN, VISION_START, VISION_END = 49152, 49153, 49154  # added tokens past SmolLM2's vocabulary
VOCAB = 49216
# patch 16, merge 2: an image is a multiple of 32 x 32 pixels, between 2 and 64 merge blocks
PREPROCESSOR = {
    "patch_size": 16,
    "merge_size": 2,
    "temporal_patch_size": 2,
    "size": {"shortest_edge": 32 * 32 * 2, "longest_edge": 32 * 32 * 64},
    "image_mean": [0.5, 0.5, 0.5],
    "image_std": [0.5, 0.5, 0.5],
}
VISION_CONFIG = {
    "depth": 2,
    "hidden_size": 64,
    "intermediate_size": 96,
    "num_heads": 4,
    "num_position_embeddings": 36,
    "patch_size": 16,
    "temporal_patch_size": 2,
    "spatial_merge_size": 2,
}
TOKEN_IDS = {
    "image_token_id": IMAGE_TOKEN,
    "vision_start_token_id": VISION_START,
    "vision_end_token_id": VISION_END,
}
# Qwen3.5's way of placing an image part in a chat (ChatML around it)
CHAT_TEMPLATE = (
    "{%- for m in messages -%}<|im_start|>{{ m.role }}\n"
    "{%- if m.content is string %}{{ m.content }}{% else %}{% for p in m.content %}"
    "{% if p.type == 'image' %}<|vision_start|><|image_pad|><|vision_end|>{% else %}{{ p.text }}{% endif %}"
    "{% endfor %}{% endif %}<|im_end|>\n{% endfor -%}"
    "{%- if add_generation_prompt %}<|im_start|>assistant\n{% endif -%}"
)


def _vision_tokenizer(out: Path, tokenizer_dir: Path) -> None:
    """SmolLM2's tokenizer (from `tokenizer_dir`) with Qwen's three vision tokens added (ids
    49152-49154), its config, the chat template and the image processor's settings, in `out`."""
    from tokenizers import AddedToken, Tokenizer

    tok = Tokenizer.from_file(str(tokenizer_dir / "tokenizer.json"))
    names = ("<|image_pad|>", "<|vision_start|>", "<|vision_end|>")
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in names])
    assert [tok.token_to_id(t) for t in names] == [IMAGE_TOKEN, VISION_START, VISION_END]
    tok.save(str(out / "tokenizer.json"))
    if tokenizer_dir != out:
        shutil.copy(tokenizer_dir / "tokenizer_config.json", out / "tokenizer_config.json")
    (out / "chat_template.jinja").write_text(CHAT_TEMPLATE)
    (out / "preprocessor_config.json").write_text(json.dumps(PREPROCESSOR))


def build_tiny_qwen3_5_vl_dir(out: Path, seed: int = 0) -> Path:
    """A random `qwen3_5` checkpoint saved by transformers: the tiny hybrid text model of
    test_qwen3_5.py (layers: linear, linear, full, linear, full) and a 2-block vision tower."""
    import transformers as tf

    text = dict(
        vocab_size=VOCAB,
        hidden_size=96,
        intermediate_size=256,
        num_hidden_layers=5,
        layer_types=["linear_attention"] * 2 + ["full_attention", "linear_attention", "full_attention"],
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        linear_num_key_heads=2,
        linear_num_value_heads=4,
        linear_key_head_dim=16,
        linear_value_head_dim=24,
        max_position_embeddings=4096,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=2,
    )
    cfg = tf.Qwen3_5Config(
        text_config=text, vision_config={**VISION_CONFIG, "out_hidden_size": 96}, **TOKEN_IDS
    )
    torch.manual_seed(seed)
    model = tf.Qwen3_5ForConditionalGeneration(cfg)
    with torch.no_grad():  # non-trivial norms (1 + w, LayerNorm weights) so their loading is tested
        for name, p in model.named_parameters():
            if "norm" in name:
                p.add_(0.1 * torch.randn_like(p))
    model.save_pretrained(out)
    _vision_tokenizer(out, TOKENIZER_DIR)
    return out


def add_vision_processor(out: Path) -> Path:
    """A tiny text model's checkpoint (vocabulary >= VOCAB, SmolLM2's tokenizer) with a qwen3_5
    processor beside it: vision token ids and a vision_config in config.json, the tokens added."""
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["vocab_size"] >= VOCAB
    cfg.update(TOKEN_IDS, vision_config=VISION_CONFIG)
    (out / "config.json").write_text(json.dumps(cfg))
    _vision_tokenizer(out, out)
    return out


# ----------------------------------------------------------------------------- image files
def pixels(h: int, w: int, channels: int = 3, seed: int = 0) -> np.ndarray:
    shape = (h, w) if channels == 1 else (h, w, channels)
    return np.random.default_rng(seed).integers(0, 256, shape, dtype=np.uint8)


def encoded(image: Image.Image, fmt: str, **kw) -> bytes:
    buf = io.BytesIO()
    image.save(buf, format=fmt, **kw)
    return buf.getvalue()


def png(h: int, w: int, mode: str = "RGB", seed: int = 0) -> bytes:
    return encoded(Image.fromarray(pixels(h, w, len(mode), seed), mode), "PNG")


def jpeg(h: int, w: int, mode: str = "RGB", seed: int = 0) -> bytes:
    return encoded(Image.fromarray(pixels(h, w, len(mode), seed), mode), "JPEG", quality=85)
