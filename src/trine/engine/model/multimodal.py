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

from collections import OrderedDict
from collections.abc import Sequence

import torch

from ..api import ImageInput, VisionSpec
from ..images import decode_for_tower
from .lora import AdapterBatch
from .vision import VisionTower


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


def batch_positions(images: Sequence[Sequence[ImageInput]], merge: int, width: int) -> torch.Tensor:
    """Positions [3, B, width] of right-padded rows (a padded tail continues as text)."""
    return torch.stack([mrope_positions(width, ims, merge)[0] for ims in images], dim=1)


# ----------------------------------------------------------------------------- the encoder
class ImageEncoder:
    """The vision tower behind a cache of its outputs by content hash: `features(images)` gives
    each image's [tokens, hidden] features, encoding only the images the cache lacks (their bytes
    decoded again, engine/images.py). `budget_bytes` bounds the cached features; past it the least
    recently used go first (an image larger than the budget is encoded and not kept)."""

    def __init__(self, tower: VisionTower, spec: VisionSpec, budget_bytes: int = 256 << 20):
        self.tower, self.spec, self.budget = tower, spec, budget_bytes
        self.cache: OrderedDict[str, torch.Tensor] = OrderedDict()
        self.bytes = 0
        self.hits = self.misses = 0

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
        patches = torch.from_numpy(decode_for_tower(im.data, im.format, self.spec))
        return self.tower(patches.to(self.tower.pos_embed.weight.device), [im.grid])

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


def forward_with_images(
    model,
    encoder: ImageEncoder,
    tokens: torch.Tensor,
    images: Sequence[Sequence[ImageInput]],
    pad_mask: torch.Tensor | None = None,
    adapters: AdapterBatch | None = None,
) -> torch.Tensor:
    """Logits [B, T, vocab] of right-padded rows `tokens` (pad_mask: True = real) whose images are
    `images[b]`: the training forward and a whole-prompt prefill, each row from the zero state."""
    feats = [encoder.features(ims) for ims in images]
    embeds = embed_with_images(model, tokens, images, feats)
    positions = batch_positions(images, encoder.spec.merge_size, tokens.shape[1])
    return model(tokens, positions.to(tokens.device), adapters, pad_mask, embeds=embeds)
