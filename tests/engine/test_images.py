"""Image inputs (engine/images.py): the tower's input equals transformers' Qwen2VLImageProcessorPil
bit for bit on real PNG and JPEG files (kind 1: the same steps on the same pixels), images are
counted and placed as the model reads them, and every bad image is a ValueError naming its field."""

from __future__ import annotations

import dataclasses
import io
import json
import zlib

import numpy as np
import pytest
from PIL import Image
from visionutil import IMAGE_TOKEN, PREPROCESSOR, TOKEN_IDS, VISION_CONFIG, encoded, jpeg, pixels, png

from trine import limits
from trine.engine.api import ImageInput
from trine.engine.images import (
    ImagesNotServed,
    PromptImage,
    VisionSpec,
    image_patches,
    mask_image_targets,
    placeholders_to_pieces,
    read_image,
    read_model_input,
)


@pytest.fixture(scope="module")
def spec_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("vl")
    (d / "config.json").write_text(
        json.dumps({"model_type": "qwen3_5", "vision_config": VISION_CONFIG, **TOKEN_IDS})
    )
    (d / "preprocessor_config.json").write_text(json.dumps(PREPROCESSOR))
    return d


@pytest.fixture(scope="module")
def spec(spec_dir):
    return dataclasses.replace(VisionSpec.from_dir(spec_dir), served=True)


@pytest.fixture(scope="module")
def reference():
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    return Qwen2VLImageProcessorPil(**PREPROCESSOR)


def palette_png() -> bytes:
    img = Image.fromarray(pixels(21, 30, 1) % 16, "P")
    img.putpalette(list(range(48)) * 16)
    return encoded(img, "PNG", transparency=3)


FILES = {  # name -> (bytes, wire format): odd sizes, both formats, every mode a client sends
    "rgb png 37x53": (png(37, 53), "png"),
    "rgb jpeg 64x48": (jpeg(64, 48), "jpeg"),
    "grayscale jpeg 61x29": (jpeg(61, 29, "L"), "jpeg"),
    "grayscale png 40x41": (png(40, 41, "L"), "png"),
    "rgba png 45x45 (alpha on white)": (png(45, 45, "RGBA"), "png"),
    "palette png with transparency": (palette_png(), "png"),
    "large jpeg 301x170 (scaled down)": (jpeg(301, 170), "jpeg"),
    "tiny png 3x7 (scaled up)": (png(3, 7), "png"),
}


def test_vision_spec_reads_the_checkpoints_processor(spec_dir):
    s = VisionSpec.from_dir(spec_dir)
    assert (s.patch_size, s.merge_size, s.temporal_patch_size) == (16, 2, 2)
    assert (s.min_pixels, s.max_pixels) == (32 * 32 * 2, 32 * 32 * 64) and s.image_mean == (0.5,) * 3
    assert s.image_token_id == IMAGE_TOKEN and not s.served


def test_a_processor_that_contradicts_the_tower_is_refused(tmp_path, spec_dir):
    for f in ("config.json", "preprocessor_config.json"):
        (tmp_path / f).write_text((spec_dir / f).read_text())
    (tmp_path / "preprocessor_config.json").write_text(json.dumps({**PREPROCESSOR, "patch_size": 14}))
    with pytest.raises(ValueError, match="not the vision tower's"):
        VisionSpec.from_dir(tmp_path)
    (tmp_path / "preprocessor_config.json").unlink()  # a language model alone: no vision
    assert VisionSpec.from_dir(tmp_path) is None


@pytest.mark.parametrize("name", FILES)
def test_patches_equal_transformers_processor_bit_for_bit(spec, reference, name):
    data, fmt = FILES[name]
    img = read_image(data, fmt, spec, "image")
    want = reference(Image.open(io.BytesIO(data)), return_tensors="np")
    got = image_patches(img.rgb, spec)
    assert got.dtype == want["pixel_values"].dtype and np.array_equal(got, want["pixel_values"])
    assert [list(img.grid)] == want["image_grid_thw"].tolist()
    assert img.tokens == int(np.prod(img.grid)) // spec.merge_size**2


def test_the_content_hash_names_the_pixels_not_the_file(spec):
    rgb = Image.fromarray(pixels(40, 50))
    a = read_image(encoded(rgb, "PNG", compress_level=1), "png", spec)
    b = read_image(encoded(rgb, "PNG", compress_level=9), "png", spec)  # other bytes, same pixels
    assert a.content_hash == b.content_hash
    as_jpeg = read_image(encoded(rgb, "JPEG"), "jpeg", spec)  # lossy: other pixels
    assert as_jpeg.content_hash != a.content_hash
    one_pixel = pixels(40, 50)
    one_pixel[7, 9, 1] ^= 1
    assert read_image(encoded(Image.fromarray(one_pixel), "PNG"), "png", spec).content_hash != a.content_hash


def test_a_model_input_places_each_images_tokens(spec):
    a, b = png(70, 45), jpeg(33, 100, seed=1)
    tokens, images = read_model_input(
        [[5, 6], PromptImage(a, "png", None, "c[1]"), [7], PromptImage(b, "jpeg", 3, "c[3]"), [8]],
        spec,
        "m",
        "prompt",
    )
    first, second = images
    assert isinstance(first, ImageInput) and (first.offset, second.offset) == (2, 3 + first.tokens)
    assert second.tokens == 3 and second.data == b and second.format == "jpeg"
    assert tokens == [5, 6] + [IMAGE_TOKEN] * first.tokens + [7] + [IMAGE_TOKEN] * 3 + [8]
    assert read_model_input([[1, 2], [3]], None, "m", "prompt") == ([1, 2, 3], ())  # text: as it was
    assert first.overlaps(3, 4) and not first.overlaps(0, 2) and not first.overlaps(2 + first.tokens, 99)


def test_valid_images_for_an_engine_without_images_are_refused_last(spec):
    off = dataclasses.replace(spec, served=False)
    with pytest.raises(
        ImagesNotServed, match=r"c\[0\]: the images are valid, but tiny does not serve images"
    ):
        read_model_input([PromptImage(png(40, 40), "png", None, "c[0]")], off, "tiny", "prompt")
    with pytest.raises(ValueError, match="expected_tokens") as e:  # bad input is named first
        read_model_input([PromptImage(png(40, 40), "png", 99, "c[0]")], off, "tiny", "prompt")
    assert not isinstance(e.value, ImagesNotServed)


def truncated_png() -> bytes:
    data = png(64, 64)
    return data[: len(data) // 2]


def bomb_png(side: int) -> bytes:
    """A valid PNG of side x side black pixels: a few hundred bytes that decode to side^2 pixels."""
    import struct

    def chunk(kind: bytes, body: bytes) -> bytes:
        return struct.pack(">I", len(body)) + kind + body + struct.pack(">I", zlib.crc32(kind + body))

    rows = zlib.compress(b"\0" * (side + 1) * side, 9)  # 8-bit grayscale rows, filter byte 0
    head = struct.pack(">IIBBBBB", side, side, 8, 0, 0, 0, 0)
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", head) + chunk(b"IDAT", rows) + chunk(b"IEND", b"")


BAD = [  # (data, format, field named, words)
    (b"not an image at all", "png", "img.data", "not a PNG or JPEG image"),
    (b"", "png", "img.data", "is empty"),
    (truncated_png(), "png", "img.data", "corrupt or truncated PNG"),
    (jpeg(40, 40)[:-200], "jpeg", "img.data", "corrupt or truncated JPEG"),
    (jpeg(40, 40), "png", "img.format", "is 'png' but the data is a JPEG image"),
    (png(40, 40), "jpeg", "img.format", "is 'jpeg' but the data is a PNG image"),
    (encoded(Image.fromarray(pixels(20, 20)), "GIF"), "png", "img.data", "not a PNG or JPEG"),
    (png(40, 40), "webp", "img.format", "use one of png, jpeg"),
    (bomb_png(4097), "png", "img.data", f"images are at most {limits.MAX_IMAGE_PIXELS} pixels"),
    (bomb_png(20000), "png", "img.data", f"images are at most {limits.MAX_IMAGE_PIXELS} pixels"),
    (png(1, 201), "png", "img.data", "aspect ratio is above 200"),
]


@pytest.mark.parametrize("data,fmt,field,words", BAD, ids=[b[3] for b in BAD])
def test_bad_images_are_named(spec, data, fmt, field, words):
    with pytest.raises(ValueError) as e:
        read_image(data, fmt, spec, "img")
    assert str(e.value).startswith(field) and words in str(e.value), str(e.value)


def test_a_bomb_is_refused_from_its_header_before_decoding(spec, monkeypatch):
    decoded = []
    monkeypatch.setattr(Image.Image, "load", lambda self: decoded.append(1))
    with pytest.raises(ValueError, match="pixels"):
        read_image(bomb_png(8000), "png", spec, "img")
    assert decoded == []


def test_bad_model_inputs_are_named(spec):
    one = png(40, 40)
    with pytest.raises(ValueError, match=r"^c\[1\]: tiny is a text-only model"):
        read_model_input([[1], PromptImage(one, "png", None, "c[1]")], None, "tiny", "prompt")
    many = [PromptImage(one, "png", None, f"c[{i}]") for i in range(limits.MAX_IMAGES_PER_INPUT + 1)]
    with pytest.raises(
        ValueError, match=rf"^prompt: {len(many)} images; at most {limits.MAX_IMAGES_PER_INPUT}"
    ):
        read_model_input(many, spec, "tiny", "prompt")
    with pytest.raises(ValueError, match=r"^c\[0\].expected_tokens is 5, but this 40x40 image is 4 vision"):
        read_model_input([PromptImage(one, "png", 5, "c[0]")], spec, "tiny", "prompt")
    with pytest.raises(ValueError, match=r"^prompt: a text chunk holds the image placeholder id"):
        read_model_input([[1, IMAGE_TOKEN], PromptImage(one, "png", None, "c[1]")], spec, "tiny", "prompt")
    with pytest.raises(ValueError, match=r"^prompt: a text chunk holds the image placeholder id"):
        read_model_input([[1, IMAGE_TOKEN, 5]], spec, "tiny", "prompt")  # text alone: the same
    assert read_model_input([[1, IMAGE_TOKEN]], None, "m", "prompt") == (
        [1, IMAGE_TOKEN],
        (),
    )  # a text model's id


def multi_picture_jpeg() -> bytes:
    """An MPO file (what phones and stereo cameras write): a JPEG whose first picture is the image."""
    first, second = Image.fromarray(pixels(40, 56)), Image.fromarray(pixels(40, 56, seed=1))
    return encoded(first, "MPO", save_all=True, append_images=[second])


def test_a_multi_picture_jpeg_is_read_as_a_jpeg(spec):
    """Pillow opens an MPO as format "MPO": it is a JPEG (its first picture), and claimed as a PNG it
    is refused naming the format, like any JPEG."""
    data = multi_picture_jpeg()
    img = read_image(data, "jpeg", spec, "img")
    single = read_image(encoded(Image.open(io.BytesIO(data)).convert("RGB"), "PNG"), "png", spec)
    assert img.content_hash == single.content_hash and img.tokens == 2  # the first picture's pixels
    with pytest.raises(ValueError, match=r"^img.format is 'png' but the data is a JPEG image"):
        read_image(data, "png", spec, "img")


def test_a_rendered_chat_splits_at_its_placeholders(spec):
    a, b = PromptImage(b"a", "png", None, "m[0]"), PromptImage(b"b", "png", None, "m[1]")
    assert placeholders_to_pieces([1, IMAGE_TOKEN, 2, IMAGE_TOKEN], [a, b], spec) == [[1], a, [2], b, []]
    with pytest.raises(ValueError, match="placed 1 image placeholders for 2 images"):
        placeholders_to_pieces([1, IMAGE_TOKEN, 2], [a, b], spec)


def test_targets_that_predict_an_image_are_ignored():
    im = ImageInput("h", offset=2, tokens=3, grid=(1, 2, 6), data=b"", format="png")
    # tokens: t t I I I t t ; position i predicts token i + 1: positions 1, 2, 3 predict image tokens
    assert mask_image_targets([10, 11, 12, 13, 14, 15, 16], [im]) == [10, -100, -100, -100, 14, 15, 16]
    at_start = dataclasses.replace(im, offset=0)
    assert mask_image_targets([1, 2, 3, 4], [at_start]) == [-100, -100, 3, 4]
