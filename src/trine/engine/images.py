"""Image inputs: bytes as a client sent them -> checked, decoded, counted and placed vision tokens.

Torch-free (Pillow and numpy): the front ends read images at acceptance through `engine/api.py`,
and the engine turns an accepted `ImageInput` into the vision tower's pixel patches with
`image_patches`. Read top to bottom: the model's settings (`VisionSpec`) -> one image (`read_image`)
-> a model input of text and images (`read_model_input`) -> the tower's input (`image_patches`).

What the checkpoint's image processor does (transformers' `Qwen2VLImageProcessorPil`, the parity
reference), step for step: convert to RGB (transparency composited onto white), resize with Pillow
(bicubic) to `smart_resize`'s size (both sides multiples of patch_size x merge_size, the pixel count
within [min_pixels, max_pixels], the aspect ratio kept), rescale to [0, 1] in fp64 and round to fp32,
normalise by the mean and std in fp32, and cut into patches of patch_size^2 pixels, each repeated
temporal_patch_size times (an image is one frame), in the order of the tower's merge blocks. The
image becomes grid (1, h, w) patches and h x w / merge_size^2 vision tokens.

Invariants
- Every error a client's image can cause is a ValueError naming the field (`prompt.chunks[1].data`):
  not base64 (the planes'), not PNG or JPEG, a format that is not what the data is, corrupt or
  truncated data, too many pixels (`limits.MAX_IMAGE_PIXELS`, read from the header before decoding:
  a decompression bomb is refused undecoded), too wide, too many images, an image for a text-only
  model, an `expected_tokens` that is not the real count (both named).
- The content hash is sha256 of the decoded RGB pixels and their size, not of the file: the hash
  names exactly what the vision tower sees, so two images that differ in one pixel never share a
  hash, and one image re-encoded losslessly keeps it. The same picture sent as PNG and as JPEG is
  not the same pixels (JPEG is lossy) and gets two hashes, as it must: its vision tokens differ.
- A model input's placeholder ids (`VisionSpec.image_token_id`) are exactly its images' spans: text
  never holds one (refused), so a position is an image position iff its token is the placeholder.
"""

from __future__ import annotations

import hashlib
import io
import json
import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from PIL import Image, UnidentifiedImageError

from ..limits import MAX_IMAGE_ASPECT_RATIO, MAX_IMAGE_PIXELS, MAX_IMAGES_PER_INPUT
from ..tokens import IGNORE_INDEX

FORMATS = {"png": "PNG", "jpeg": "JPEG"}  # the wire's name -> Pillow's
# Pillow's name of an opened file -> the wire's: MPO is a multi-picture JPEG (phones and cameras write
# them), which Pillow's JPEG reader opens as such; the processor reads its first picture, as trine does
OPENED = {"PNG": "png", "JPEG": "jpeg", "MPO": "jpeg"}
OPENAI_CLIP_MEAN = (0.48145466, 0.4578275, 0.40821073)  # Qwen2VLImageProcessor's defaults
OPENAI_CLIP_STD = (0.26862954, 0.26130258, 0.27577711)


# ----------------------------------------------------------------------------- the model's settings
@dataclass(frozen=True)
class VisionSpec:
    """How one model reads images: its checkpoint's image processor settings
    (preprocessor_config.json) and its placeholder token ids (config.json). `served`: whether the
    engine's sampler and trainer take images (until they do, a valid image is refused by name)."""

    patch_size: int
    merge_size: int
    temporal_patch_size: int
    min_pixels: int
    max_pixels: int
    image_mean: tuple[float, ...]
    image_std: tuple[float, ...]
    image_token_id: int
    vision_start_token_id: int
    vision_end_token_id: int
    rescale_factor: float = 1 / 255
    resample: int = 3  # Pillow's BICUBIC
    served: bool = False

    @property
    def factor(self) -> int:
        """Both sides of a resized image are multiples of this (one merge block of patches)."""
        return self.patch_size * self.merge_size

    @classmethod
    def from_dir(cls, path: str | Path) -> VisionSpec | None:
        """The spec of the checkpoint at `path`, None for a text model or a directory without a
        preprocessor_config.json (its language model alone is served). ValueError when the
        processor's settings contradict the vision tower's or ask for what trine does not do."""
        path = Path(path)
        cfg = json.loads((path / "config.json").read_text())
        vision = cfg.get("vision_config")
        pre_file = path / "preprocessor_config.json"
        if not vision or not pre_file.is_file():
            return None
        pre = json.loads(pre_file.read_text())
        for flag in ("do_resize", "do_rescale", "do_normalize", "do_convert_rgb"):
            if pre.get(flag, True) is not True:
                raise ValueError(
                    f"{pre_file}: {flag} {pre[flag]!r} is not supported (the processor's default)"
                )
        size = dict(pre.get("size") or {"shortest_edge": 56 * 56, "longest_edge": 28 * 28 * 1280})
        spec = cls(
            patch_size=int(pre.get("patch_size", 14)),
            merge_size=int(pre.get("merge_size", 2)),
            temporal_patch_size=int(pre.get("temporal_patch_size", 2)),
            min_pixels=int(pre.get("min_pixels") or size["shortest_edge"]),
            max_pixels=int(pre.get("max_pixels") or size["longest_edge"]),
            image_mean=tuple(float(x) for x in pre.get("image_mean", OPENAI_CLIP_MEAN)),
            image_std=tuple(float(x) for x in pre.get("image_std", OPENAI_CLIP_STD)),
            image_token_id=int(cfg["image_token_id"]),
            vision_start_token_id=int(cfg["vision_start_token_id"]),
            vision_end_token_id=int(cfg["vision_end_token_id"]),
            rescale_factor=float(pre.get("rescale_factor", 1 / 255)),
            resample=int(pre.get("resample", 3)),
        )
        tower = (vision.get("patch_size", 16), vision.get("spatial_merge_size", 2))
        tower += (vision.get("temporal_patch_size", 2),)
        if (spec.patch_size, spec.merge_size, spec.temporal_patch_size) != tower:
            raise ValueError(
                f"{pre_file}: patch_size, merge_size, temporal_patch_size "
                f"{(spec.patch_size, spec.merge_size, spec.temporal_patch_size)} are not the vision "
                f"tower's {tower} (config.json's vision_config)"
            )
        return spec


def smart_resize(height: int, width: int, spec: VisionSpec) -> tuple[int, int]:
    """The size the processor resizes an image to (transformers' `smart_resize`, the same float
    arithmetic): multiples of `spec.factor`, within [min_pixels, max_pixels], the aspect kept."""
    factor = spec.factor
    h_bar = round(height / factor) * factor
    w_bar = round(width / factor) * factor
    if h_bar * w_bar > spec.max_pixels:
        beta = math.sqrt((height * width) / spec.max_pixels)
        h_bar = max(factor, math.floor(height / beta / factor) * factor)
        w_bar = max(factor, math.floor(width / beta / factor) * factor)
    elif h_bar * w_bar < spec.min_pixels:
        beta = math.sqrt(spec.min_pixels / (height * width))
        h_bar = math.ceil(height * beta / factor) * factor
        w_bar = math.ceil(width * beta / factor) * factor
    return h_bar, w_bar


# ----------------------------------------------------------------------------- one image
@dataclass(frozen=True)
class ReadImage:
    """A checked, decoded image: its RGB pixels [H, W, 3] uint8, content hash, patch grid
    (1, h, w) and vision token count."""

    rgb: np.ndarray
    content_hash: str
    grid: tuple[int, int, int]
    tokens: int


def read_image(data: bytes, fmt: str, spec: VisionSpec, field: str = "image") -> ReadImage:
    """Decode and check one image (the module's invariants name every refusal), as `spec`'s model
    reads it."""
    if fmt not in FORMATS:
        raise ValueError(f"{field}.format {fmt!r}: use one of {', '.join(FORMATS)}")
    if not data:
        raise ValueError(f"{field}.data is empty: send the image file's bytes")
    try:
        image = Image.open(io.BytesIO(data), formats=tuple(FORMATS.values()))
    except Image.DecompressionBombError:  # beyond Pillow's own bound, which ours is below
        raise ValueError(
            f"{field}.data declares more than {MAX_IMAGE_PIXELS} pixels (a decompression bomb?); "
            f"images are at most {MAX_IMAGE_PIXELS} pixels (width x height)"
        ) from None
    except (UnidentifiedImageError, OSError, ValueError, SyntaxError):
        raise ValueError(
            f"{field}.data ({len(data)} bytes) is not a PNG or JPEG image, or its header is corrupt"
        ) from None
    with image:
        real = OPENED.get(image.format)
        if real is None:
            raise ValueError(f"{field}.data is a {image.format} image, not a PNG or JPEG")
        if real != fmt:
            raise ValueError(f"{field}.format is {fmt!r} but the data is a {real.upper()} image")
        width, height = image.size
        if width * height > MAX_IMAGE_PIXELS:
            raise ValueError(
                f"{field}.data is {width}x{height} = {width * height} pixels; images are at most "
                f"{MAX_IMAGE_PIXELS} pixels (width x height): send a smaller image"
            )
        if max(width, height) > MAX_IMAGE_ASPECT_RATIO * min(width, height):
            raise ValueError(
                f"{field}.data is {width}x{height}: its aspect ratio is above "
                f"{MAX_IMAGE_ASPECT_RATIO}, which the model's image processor refuses"
            )
        try:
            rgb = _rgb(image)
        except (OSError, ValueError, SyntaxError, EOFError) as e:  # Pillow's words for a broken file
            raise ValueError(
                f"{field}.data: corrupt or truncated {real.upper()} data ({type(e).__name__}: {e})"
            ) from None
    h, w = smart_resize(height, width, spec)
    grid = (1, h // spec.patch_size, w // spec.patch_size)
    digest = hashlib.sha256(f"rgb8 {width}x{height}:".encode() + rgb.tobytes()).hexdigest()
    return ReadImage(rgb, digest, grid, h * w // (spec.patch_size * spec.merge_size) ** 2)


def _rgb(image: Image.Image) -> np.ndarray:
    """Decoded pixels as the processor converts them: transparency composited onto white."""
    image.load()
    if "A" in image.getbands() or image.info.get("transparency") is not None:
        rgba = image.convert("RGBA")
        white = Image.new("RGBA", rgba.size, (255, 255, 255, 255))
        return np.asarray(Image.alpha_composite(white, rgba).convert("RGB"))
    return np.asarray(image.convert("RGB"))


# ----------------------------------------------------------------------------- a model input
@dataclass(frozen=True)
class ImageInput:
    """One image of a prompt or a training datum (a boundary type: engine/api.py exports it), read
    and checked at acceptance (`read_model_input`): the model input's tokens hold `tokens` copies of the
    model's placeholder id (`VisionSpec.image_token_id`) at [offset, offset + tokens), and nowhere
    else. `data` is the image file as the client sent it (`format` png or jpeg): the engine decodes
    it again into the tower's patches (`decode_for_tower`) only when its encoder cache misses.
    `grid` is the tower's patch grid (1, h, w); `tokens` = h * w / merge_size^2.

    How a request carries images: `SampleRequest.images` and `TrainDatum.images`, in offset order,
    non-overlapping; () / None for text. The prompt's length, context checks and metering count the
    placeholder positions like any token (an image token is a prefill token). What the sampler and
    trainer do with them (the integration contract; docs/guides/vision.md):
    - Embeddings: the placeholder rows of the token embeddings are replaced, in order, by the vision
      tower's features of the images (model/multimodal.py, `embed_with_images`).
    - Positions: 3D multimodal RoPE (`multimodal.mrope_positions`): text continues after an image from
      its largest position + 1, so a sequence's positions after its prompt are index + `rope_delta`
      on all three axes (`delta` is 0 for text); a decode step of such a sequence uses that offset.
    - Prefix cache: a KV block (and a recurrent-state snapshot) whose tokens overlap an image span is
      keyed by the image's `content_hash` and offset besides its token ids, so two different images
      never share an entry; blocks after an image are chained to it like any block.
    - Encoder cache: the tower's output is cached by `content_hash` within a memory budget, so a
      group or a chat's next turn encodes an image once.
    - Training: the tower is frozen; targets that predict an image position are ignored
      (`mask_image_targets`, applied by the front ends), so the loss falls on text targets only.
      Shared-prefix training compares datums' images (hash and offset) besides their tokens: two
      datums whose placeholders are equal share a prefix only if their images are the same.
    - Prompt logprobs at positions that predict an image token are None (not a text prediction).
    """

    content_hash: str  # sha256 of the decoded RGB pixels and size (engine/images.py says why)
    offset: int  # the first placeholder position in the model input's tokens
    tokens: int  # placeholder positions: the image's vision tokens
    grid: tuple[int, int, int]  # the tower's patch grid (t, h, w)
    data: bytes
    format: str  # "png" or "jpeg"

    def overlaps(self, start: int, end: int) -> bool:
        """Whether the image's span meets token positions [start, end) (a KV block, a chunk)."""
        return self.offset < end and start < self.offset + self.tokens


@dataclass(frozen=True)
class PromptImage:
    """An image as a client sent it, before it is read: its bytes, the format it claims, the token
    count it expects (None: not given) and the field that names it in errors."""

    data: bytes
    format: str
    expected_tokens: int | None = None
    field: str = "image"


class ImagesNotServed(ValueError):
    """Images that are valid for the model, whose engine does not run images yet (a 400
    `not_supported`, named apart from bad input). `field` names the first image."""

    def __init__(self, field: str, message: str):
        super().__init__(message)
        self.field = field


def read_model_input(pieces, spec: VisionSpec | None, model: str, field: str):
    """A model input's tokens and images from its pieces in order (lists of token ids, and
    `PromptImage`s): each image becomes its vision token count of placeholder ids. Returns
    (tokens, tuple of `ImageInput`). ValueError naming the field for every refusal (the module's
    invariants); `ImagesNotServed` last, once everything else holds."""
    images = [p for p in pieces if isinstance(p, PromptImage)]
    if spec is not None and any(
        spec.image_token_id in p for p in pieces if not isinstance(p, PromptImage)
    ):  # with or without images: a placeholder is an image's, never text's
        raise ValueError(
            f"{field}: a text chunk holds the image placeholder id {spec.image_token_id}; "
            "send each image as an image chunk (its placeholders are the server's)"
        )
    if not images:
        return [t for p in pieces for t in p], ()
    if spec is None:
        raise ValueError(
            f"{images[0].field}: {model} is a text-only model; images need a vision-language "
            "model (a qwen3_5 checkpoint with its vision tower)"
        )
    if len(images) > MAX_IMAGES_PER_INPUT:
        raise ValueError(f"{field}: {len(images)} images; at most {MAX_IMAGES_PER_INPUT} are allowed")
    tokens: list[int] = []
    out = []
    for p in pieces:
        if not isinstance(p, PromptImage):
            tokens += p
            continue
        img = read_image(p.data, p.format, spec, p.field)
        if p.expected_tokens is not None and p.expected_tokens != img.tokens:
            h, w = img.rgb.shape[:2]
            raise ValueError(
                f"{p.field}.expected_tokens is {p.expected_tokens}, but this {w}x{h} image is "
                f"{img.tokens} vision tokens for {model}: send expected_tokens {img.tokens} (or none)"
            )
        out.append(ImageInput(img.content_hash, len(tokens), img.tokens, img.grid, p.data, p.format))
        tokens += [spec.image_token_id] * img.tokens
    if not spec.served:
        raise ImagesNotServed(
            images[0].field,
            f"{images[0].field}: the images are valid, but {model} does not serve images yet (its "
            "sampler and trainer take text only); send text-only inputs",
        )
    return tokens, tuple(out)


def placeholders_to_pieces(tokens: list[int], images: list[PromptImage], spec: VisionSpec | None):
    """A rendered prompt with one placeholder id per image (a chat template's `<|image_pad|>`) as
    pieces for `read_model_input`, each placeholder replaced by its image in order. ValueError
    when the template placed another number of placeholders than there are images."""
    if spec is None or not images:
        return [tokens, *images]
    at = [i for i, t in enumerate(tokens) if t == spec.image_token_id]
    if len(at) != len(images):
        raise ValueError(
            f"{images[0].field}: the chat template placed {len(at)} image placeholders for "
            f"{len(images)} images; the text must not hold the image placeholder token"
        )
    pieces, start = [], 0
    for i, image in zip(at, images):
        pieces += [tokens[start:i], image]
        start = i + 1
    return pieces + [tokens[start:]]


def keyed_tokens(tokens: list, images) -> list:
    """`tokens` as the prefix cache and shared-prefix training compare them: an image's positions
    hold (content hash, index within the image) instead of the placeholder id, so two sequences are
    equal at a position only where they hold the same image at the same offset (placeholders of
    different images are not). `tokens` itself, not a copy, when there are no images."""
    if not images:
        return tokens
    out = list(tokens)
    for im in images:
        out[im.offset : im.offset + im.tokens] = [(im.content_hash, i) for i in range(im.tokens)]
    return out


def image_positions(images, start: int, end: int) -> int:
    """How many of positions [start, end) are image positions."""
    return sum(max(0, min(end, im.offset + im.tokens) - max(start, im.offset)) for im in images)


def check_placement(tokens: list[int], images, spec: VisionSpec | None, model: str, field: str) -> None:
    """ValueError unless `images` are placed as `read_model_input` places them: in offset order,
    each span within `tokens` and all placeholder ids (`spec.image_token_id`), none elsewhere, each
    span its grid's token count; and `spec` is a model that takes images (the engine's check of
    what the front ends built)."""
    if not images:
        return
    if spec is None:
        raise ValueError(f"{field}: {model} does not take images (a text-only model)")
    at, merge = 0, spec.merge_size**2
    for i, im in enumerate(images):
        t, h, w = im.grid
        if im.offset < at or im.offset + im.tokens > len(tokens) or im.tokens != t * h * w // merge:
            raise ValueError(
                f"{field}.images[{i}]: its span [{im.offset}, {im.offset + im.tokens}) of grid "
                f"{im.grid} is not placed in order within the {len(tokens)} tokens"
            )
        at = im.offset + im.tokens
    placeholders = [i for i, t in enumerate(tokens) if t == spec.image_token_id]
    spans = [p for im in images for p in range(im.offset, im.offset + im.tokens)]
    if placeholders != spans:
        raise ValueError(
            f"{field}: the image placeholder id {spec.image_token_id} must be exactly at the images' "
            "positions (build inputs with read_model_input)"
        )


def mask_image_targets(targets: list[int], images) -> list[int]:
    """Pre-shifted targets with every position that predicts an image position ignored
    (IGNORE_INDEX): the loss falls on text targets only (the tower is not trained to be predicted)."""
    out = list(targets)
    for im in images:
        for i in range(max(im.offset - 1, 0), min(im.offset + im.tokens - 1, len(out))):
            out[i] = IGNORE_INDEX
    return out


# ----------------------------------------------------------------------------- the tower's input
def image_patches(rgb: np.ndarray, spec: VisionSpec) -> np.ndarray:
    """The vision tower's input for one decoded image (`ReadImage.rgb`): [h * w patches,
    3 * temporal_patch_size * patch_size^2] fp32, the processor's values bit for bit."""
    height, width = rgb.shape[:2]
    h, w = smart_resize(height, width, spec)
    resized = np.asarray(Image.fromarray(rgb).resize((w, h), resample=spec.resample))
    x = (resized.astype(np.float64) * spec.rescale_factor).astype(np.float32)  # the processor's order
    mean, std = np.array(spec.image_mean, np.float32), np.array(spec.image_std, np.float32)
    x = ((x - mean) / std).transpose(2, 0, 1)  # [C, H, W]
    p, m, t = spec.patch_size, spec.merge_size, spec.temporal_patch_size
    gh, gw = h // p, w // p
    x = x.reshape(3, gh // m, m, p, gw // m, m, p).transpose(1, 4, 2, 5, 0, 3, 6)
    x = np.broadcast_to(x[:, :, :, :, :, None], (*x.shape[:5], t, p, p))
    return np.ascontiguousarray(x.reshape(gh * gw, 3 * t * p * p))


def decode_for_tower(data: bytes, fmt: str, spec: VisionSpec) -> np.ndarray:
    """`image_patches` of an accepted image's bytes (`ImageInput.data`): the engine decodes it again
    on an encoder-cache miss (the boundary carries the compressed file, not its pixels)."""
    return image_patches(read_image(data, fmt, spec).rgb, spec)
