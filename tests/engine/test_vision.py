"""Qwen3.5 with images against transformers' own (`Qwen3_5ForConditionalGeneration`) on a tiny random
`qwen3_5` checkpoint and real PNG and JPEG files: the vision tower's features and the logits of text +
image rows, alone and batched with a text row (kind 3, tests/tolerance.py: each within MARGIN x our
fp32 rounding of the fp64 twin); multimodal RoPE's positions against `get_rope_index` (exact), and
the text path unchanged by it (kind 1)."""

from __future__ import annotations

import dataclasses
import io

import pytest
import torch
from PIL import Image
from tolerance import Rounding, assert_bitwise, fp64_model
from visionutil import (
    IMAGE_TOKEN,
    PREPROCESSOR,
    VISION_END,
    VISION_START,
    jpeg,
    png,
)

from trine.engine.images import PromptImage, VisionSpec, image_patches, read_image, read_model_input
from trine.engine.model.multimodal import (
    ImageEncoder,
    embed_with_images,
    forward_with_images,
    mrope_positions,
)
from trine.engine.model.qwen3_5 import HybridTransformer, mrope_axes
from trine.engine.model.vision import load_vision_tower
from trine.engine.model.weights import load_model

# 128x96 is 4x3 merged tokens (positions advance by 4), 64x160 is 2x5 (by 5): text after them
# continues below its index (rope delta -8, then -13), which a wrong position rule would show.
IMAGES = {
    "a": (png(96, 128, seed=1), "png"),
    "b": (jpeg(160, 64, seed=2), "jpeg"),
    "c": (png(40, 50, "RGBA"), "png"),
}


@pytest.fixture(scope="module")
def vl_dir(tiny_vl_dir):
    return tiny_vl_dir


@pytest.fixture(scope="module")
def hf_vl(vl_dir):
    from transformers import Qwen3_5ForConditionalGeneration

    return Qwen3_5ForConditionalGeneration.from_pretrained(vl_dir, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def spec(vl_dir):
    return dataclasses.replace(VisionSpec.from_dir(vl_dir), served=True)


@pytest.fixture(scope="module")
def ours(vl_dir, spec):
    """(model, encoder) in fp32 and their fp64 twins: the same weights, the same RoPE frequencies."""
    pair32 = load_model(vl_dir, "cpu"), ImageEncoder(load_vision_tower(vl_dir), spec)
    pair64 = fp64_model(vl_dir), ImageEncoder(load_vision_tower(vl_dir, dtype=torch.float64), spec)
    return pair32, pair64


def hf_pixels(names):
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    proc = Qwen2VLImageProcessorPil(**PREPROCESSOR)
    out = proc([Image.open(io.BytesIO(IMAGES[n][0])) for n in names], return_tensors="pt")
    return out["pixel_values"], out["image_grid_thw"]


def prompt(spec, *names):
    """A chat-like row: text, then each image between its vision start and end tokens, then text."""
    pieces = [[1, 5, 6]]
    for i, n in enumerate(names):
        pieces += [[VISION_START], PromptImage(*IMAGES[n]), [VISION_END, 7 + i, 8]]
    return read_model_input(pieces + [[9, 10, 11]], spec, "tiny", "prompt")


def test_the_tower_matches_transformers(vl_dir, hf_vl, ours):
    (_, enc32), (_, enc64) = ours
    pixels, grids = hf_pixels(["a", "b", "c"])
    with torch.no_grad():
        want = hf_vl.model.visual(pixels, grid_thw=grids).pooler_output
        got32 = enc32.tower(pixels, grids.tolist())
        got64 = enc64.tower(pixels, grids.tolist())
    assert got32.shape == want.shape == (12 + 10 + grids[2].prod() // 4, 96)
    Rounding(got32, got64).assert_within(want)


def test_images_are_encoded_alone_and_cached_by_content(spec, ours):
    (_, enc), (_, enc64) = ours
    _, images = prompt(spec, "a", "b")
    enc.cache.clear(), setattr(enc, "bytes", 0)
    hits, misses = enc.hits, enc.misses
    first = enc.features(images)
    assert (enc.misses - misses, enc.hits - hits) == (2, 0)
    again = enc.features(images[::-1])
    assert (enc.misses - misses, enc.hits - hits) == (2, 2) and again[0] is first[1]
    # one image's features are its own encoding's: a batch of images gives each the same values
    with torch.no_grad():
        together = enc.tower(*batch_input(spec, images))
    Rounding(torch.cat(first), torch.cat(enc64.features(images))).assert_within(together)
    small = ImageEncoder(enc.tower, spec, budget_bytes=first[0].numel() * 4)  # room for image a only
    small.features(images)
    assert list(small.cache) == [images[1].content_hash] and small.bytes == first[1].numel() * 4


def batch_input(spec, images):
    patches = [image_patches(read_image(im.data, im.format, spec).rgb, spec) for im in images]
    return torch.cat([torch.from_numpy(p) for p in patches]), [im.grid for im in images]


def test_positions_equal_get_rope_index(spec, hf_vl):
    rows = [prompt(spec, "a", "b"), prompt(spec, "c"), prompt(spec)]
    width = max(len(t) for t, _ in rows)
    tokens = torch.tensor([t + [0] * (width - len(t)) for t, _ in rows])
    mask = torch.tensor([[i < len(t) for i in range(width)] for t, _ in rows])
    _, grids = hf_pixels(["a", "b", "c"])
    want, want_delta = hf_vl.model.get_rope_index(
        tokens, (tokens == IMAGE_TOKEN).int(), grids, attention_mask=mask.long()
    )
    for b, (t, images) in enumerate(rows):
        got, delta = mrope_positions(len(t), images, spec.merge_size)
        assert torch.equal(got, want[:, b, : len(t)]) and delta == int(want_delta[b])
    assert mrope_positions(len(rows[0][0]), rows[0][1], 2)[1] == -13  # text after images sits lower


def test_plain_positions_are_multimodal_ropes_equal_axes(vl_dir):
    """The text path: [3, B, T] positions with three equal axes give [B, T]'s logits bit for bit."""
    model = load_model(vl_dir, "cpu")
    assert isinstance(model, HybridTransformer) and model.cfg.mrope_section == (11, 11, 10)
    assert mrope_axes(model.cfg).tolist() == [0, 1, 2, 0]  # rotary_dim 8: four frequencies
    tokens = torch.randint(0, 49000, (2, 23), generator=torch.Generator().manual_seed(0))
    positions = torch.arange(23).expand(2, -1)
    with torch.no_grad():
        assert_bitwise(model(tokens, positions.expand(3, -1, -1)), model(tokens, positions))


def hf_logits(hf_vl, rows, names):
    width = max(len(t) for t, _ in rows)
    tokens = torch.tensor([t + [0] * (width - len(t)) for t, _ in rows])
    mask = torch.tensor([[i < len(t) for i in range(width)] for t, _ in rows])
    pixels, grids = hf_pixels(names)
    with torch.no_grad():
        out = hf_vl(
            input_ids=tokens,
            attention_mask=mask.long(),
            pixel_values=pixels,
            image_grid_thw=grids,
            mm_token_type_ids=(tokens == IMAGE_TOKEN).int(),
        )
    return tokens, mask, out.logits


@pytest.mark.parametrize("batched", [False, True], ids=["alone", "batched with a text row"])
def test_logits_with_images_match_transformers(spec, hf_vl, ours, batched):
    rows = [prompt(spec, "a", "b")]
    if batched:
        rows.append((list(range(100, 130)), ()))  # a text row, longer: the image row is padded
    tokens, mask, want = hf_logits(hf_vl, rows, ["a", "b"])
    images = [im for _, im in rows]
    (m32, e32), (m64, e64) = ours
    with torch.no_grad():
        got32 = forward_with_images(m32, e32, tokens, images, mask)
        got64 = forward_with_images(m64, e64, tokens, images, mask)
    Rounding(got32[mask], got64[mask]).assert_within(want[mask])
    if batched:  # the text row is the text model's forward (kind 1: the same computation)
        with torch.no_grad():
            alone = m32(tokens[1:], pad_mask=mask[1:])
        Rounding(alone[mask[1:]], got64[1:][mask[1:]]).assert_within(got32[1:][mask[1:]])


def test_a_chunks_embeddings_are_its_window_of_the_rows(spec, ours):
    (model, enc), _ = ours
    tokens, images = prompt(spec, "a", "b")
    row = torch.tensor([tokens])
    feats = [enc.features(images)]
    with torch.no_grad():
        whole = embed_with_images(model, row, [images], feats)
        for start, end in ((0, 6), (6, 17), (17, len(tokens))):  # cuts through both images
            part = embed_with_images(model, row[:, start:end], [images], feats, starts=[start])
            assert_bitwise(part, whole[:, start:end])
        replaced = row[0] == IMAGE_TOKEN
        assert_bitwise(whole[0, replaced], torch.cat(feats[0]))
