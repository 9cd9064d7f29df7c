"""A language model's forward with images: what the sampler and the trainer call for a prompt or a
datum that carries `ImageInput`s (engine/api.py; its docstring is the integration contract).

Read top to bottom: positions (multimodal RoPE) -> the encoder and its cache -> embedding
substitution -> the whole forward.

- Positions: text token i of a row sits at (p, p, p); an image starting at position s with a merged
  grid of gh x gw tokens (t = 1) has token (r, c) at (s, s + r, s + c), and the text after it
  continues from s + max(gh, gw). transformers' `Qwen3_5Model.get_rope_index` for each row. A
  sequence's positions after its prompt are its index + `delta` on all three axes.
- Embeddings: the rows of the token embeddings at an image's placeholders are replaced, in order,
  by the tower's features of that image (transformers' `masked_scatter`).
- The encoder's output is cached by content hash (`ImageEncoder`), within a byte budget, least
  recently used first out.

Invariants
- A row without images gets exactly the text model's forward: its positions are the plain ones on
  all three axes, and multimodal RoPE of equal axes is plain RoPE bit for bit (qwen3_5.py).
- An image's features depend only on its pixels: `ImageEncoder` encodes images one at a time, so
  a cached feature is bit for bit what encoding it again gives.
- Embedding substitution is exact (rows copied), whatever window of a row a chunk covers.
"""

from __future__ import annotations

import dataclasses
import time
from collections import OrderedDict
from collections.abc import Sequence

import torch

from ..api import ImageInput, VisionSpec
from ..config import IMAGE_CACHE_BYTES
from ..images import decode_for_tower
from .lora import AdapterBatch
from .vision import VisionTower, has_vision_weights, load_vision_tower


# ----------------------------------------------------------------------------- positions
def mrope_positions(length: int, images: Sequence[ImageInput], merge: int) -> tuple[torch.Tensor, int]:
    """Positions [3, length] (t, h, w) of a row of `length` tokens whose images are `images` (in
    offset order, within the row), and its rope delta: the largest position + 1 - length (0 for
    text). Tokens past the last image are text, so one call serves a prompt and its samples."""
    pos = torch.empty(3, length, dtype=torch.long)
    at = cur = 0
    for im in images:
        pos[:, at : im.offset] = torch.arange(im.offset - at) + cur
        cur += im.offset - at
        t, h, w = im.grid
        gh, gw = h // merge, w // merge
        if t * gh * gw != im.tokens:
            raise ValueError(f"an image of grid {im.grid} is {t * gh * gw} tokens, not {im.tokens}")
        tt, hh, ww = torch.meshgrid(torch.arange(t), torch.arange(gh), torch.arange(gw), indexing="ij")
        pos[:, im.offset : im.offset + im.tokens] = torch.stack([tt, hh, ww]).reshape(3, -1) + cur
        cur += max(gh, gw)
        at = im.offset + im.tokens
    pos[:, at:] = torch.arange(length - at) + cur
    return pos, (int(pos.max()) + 1 - length) if length else 0


def window_positions(images: Sequence[ImageInput], merge: int, start: int, width: int) -> torch.Tensor:
    """Positions [3, width] of a sequence's positions [start, start + width) whose images are
    `images` (all of them: the positions after an image depend on it); past the sequence's end
    (a padded tail) they continue as text."""
    end = max([start + width] + [im.offset + im.tokens for im in images])
    return mrope_positions(end, images, merge)[0][:, start : start + width]


# ----------------------------------------------------------------------------- the encoder
class ImageEncoder:
    """The vision tower behind a cache of its outputs by content hash: `features(images)` gives
    each image's [tokens, hidden] features, encoding only the images the cache lacks (their bytes
    decoded again, engine/images.py). `budget_bytes` bounds the cached features; past it the least
    recently used go first (an image larger than the budget is encoded and not kept)."""

    def __init__(self, tower: VisionTower, spec: VisionSpec, budget_bytes: int = IMAGE_CACHE_BYTES):
        self.tower, self.spec, self.budget = tower, spec, budget_bytes
        self.cache: OrderedDict[str, torch.Tensor] = OrderedDict()
        self.bytes = 0
        self.hits = self.misses = 0
        self.seconds = 0.0  # spent encoding (decoding the files included)

    @torch.no_grad()
    def features(self, images: Sequence[ImageInput]) -> list[torch.Tensor]:
        out = []
        for im in images:
            f = self.cache.get(im.content_hash)
            if f is not None:
                self.cache.move_to_end(im.content_hash)
                self.hits += 1
            else:
                f = self.encode(im)
                self.misses += 1
                self._keep(im.content_hash, f)
            out.append(f)
        return out

    def encode(self, im: ImageInput) -> torch.Tensor:
        start = time.perf_counter()
        patches = torch.from_numpy(decode_for_tower(im.data, im.format, self.spec))
        device = self.tower.pos_embed.weight.device
        out = self.tower(patches.to(device), [im.grid])
        if device.type == "cuda":  # the time is the tower's, not the launch's
            torch.cuda.synchronize(device)
        self.seconds += time.perf_counter() - start
        return out

    @property
    def stats(self) -> dict:
        return dict(
            image_encodes=self.misses,
            image_encoder_hits=self.hits,
            image_encoder_seconds=self.seconds,
            image_cache_bytes=self.bytes,
        )

    def _keep(self, key: str, f: torch.Tensor) -> None:
        size = f.numel() * f.element_size()
        if size > self.budget:
            return
        self.cache[key] = f
        self.bytes += size
        while self.bytes > self.budget:
            _, old = self.cache.popitem(last=False)
            self.bytes -= old.numel() * old.element_size()


# ----------------------------------------------------------------------------- embeddings
def embed_with_images(
    model,
    tokens: torch.Tensor,
    images: Sequence[Sequence[ImageInput]],
    features: Sequence[Sequence[torch.Tensor]],
    starts: Sequence[int] | None = None,
) -> torch.Tensor:
    """Token embeddings [B, T, hidden] of `model` with each image's placeholder rows replaced by
    its features. Row b holds the row's tokens from position `starts[b]` (0: the whole row; a
    prefill chunk: where it begins); an image only partly in the window gives its part."""
    x = model.model.embed_tokens(tokens)
    if not any(images):
        return x
    x = x.clone()
    width = tokens.shape[1]
    for b, (ims, feats) in enumerate(zip(images, features)):
        s = starts[b] if starts is not None else 0
        for im, f in zip(ims, feats):
            lo, hi = max(im.offset, s), min(im.offset + im.tokens, s + width)
            if lo < hi:
                x[b, lo - s : hi - s] = f[lo - im.offset : hi - im.offset].to(x.dtype)
    return x


def load_image_encoder(path, model, budget_bytes: int = IMAGE_CACHE_BYTES) -> ImageEncoder | None:
    """The engine's encoder of the checkpoint at `path`, whose language model is `model`: its vision
    tower in the model's device and dtype, its spec marked served. None when the engine serves no
    images: a text model, a language model without multimodal RoPE (only Qwen3.5's has it), or a
    directory without the tower's weights (a full fine-tuning run's own)."""
    from .qwen3_5 import HybridTransformer

    spec = VisionSpec.from_dir(path)
    if spec is None or not isinstance(model, HybridTransformer) or not has_vision_weights(path):
        return None
    tower = load_vision_tower(path, model.device, model.dtype)
    return ImageEncoder(tower, dataclasses.replace(spec, served=True), budget_bytes)


def image_inputs(
    model,
    encoder: ImageEncoder,
    tokens: torch.Tensor,
    images: Sequence[Sequence[ImageInput]],
    starts: Sequence[int] | None = None,
) -> dict:
    """A forward's `positions` [3, B, T] and `embeds` [B, T, hidden] for right-padded rows `tokens`:
    row b holds positions starts[b].. (default 0) of a sequence whose images are `images[b]` (the
    training forward, a shared-prefix segment); only the images the window meets are encoded."""
    B, T = tokens.shape
    starts = [0] * B if starts is None else starts
    merge = encoder.spec.merge_size
    positions = torch.stack([window_positions(ims, merge, s, T) for ims, s in zip(images, starts)], 1)
    inside = [[im for im in ims if im.overlaps(s, s + T)] for ims, s in zip(images, starts)]
    embeds = embed_with_images(model, tokens, inside, [encoder.features(ims) for ims in inside], starts)
    return dict(positions=positions.to(tokens.device), embeds=embeds)


def forward_with_images(
    model,
    encoder: ImageEncoder,
    tokens: torch.Tensor,
    images: Sequence[Sequence[ImageInput]],
    pad_mask: torch.Tensor | None = None,
    adapters: AdapterBatch | None = None,
) -> torch.Tensor:
    """Logits [B, T, vocab] of right-padded rows `tokens` (pad_mask: True = real) whose images are
    `images[b]`: a whole-prompt forward, each row from the zero state."""
    return model(tokens, adapters=adapters, pad_mask=pad_mask, **image_inputs(model, encoder, tokens, images))
