"""The sampler's prompts with images (`SampleRequest.images`; engine/images.py's `ImageInput` is the
contract): their positions, their embeddings in a prefill chunk, their decode positions.

- Positions: a prompt's multimodal RoPE positions (`mrope_positions`, transformers' `get_rope_index`)
  and its rope delta are computed once, when it is queued (`Request.mrope`, `Request.rope_delta`).
  A prefill chunk that holds an image row runs on [3, B, T] positions: that row's own, each text
  row's equal on the three axes (plain RoPE, bit for bit). A decode step rotates each sequence's
  token by its index + its request's delta on all three axes: equal axes again, so decode positions
  stay [B, 1].
- Embeddings: a chunk's image rows get their token embeddings with each image's features at its
  placeholders (`embed_with_images`; a chunk that cuts through an image takes its part). Features
  come from the engine's `ImageEncoder` (cached by content hash within its budget) and the request
  holds those it has used until its prompt is done, so a prompt encodes each image at most once
  however its chunks fall, and not at all when the prefix cache serves the image's KV.

Invariants
- Requests without images pay nothing per step: a chunk without an image row and every decode step
  while no request with images is live (`live`) take the text path unchanged.
- A request's prefix-cache keys never contain placeholder ids (`Request.key`): what a cached block
  holds is named by the images' content hashes and offsets, so it is served only to the same image
  at the same place.
"""

from __future__ import annotations

import torch

from ..images import image_positions
from ..model.multimodal import ImageEncoder, embed_with_images, mrope_positions
from .sequence import Request, Sequence


class ImagePrefill:
    """The image side of one sampler: `model`'s embeddings and the engine's `encoder`."""

    def __init__(self, model, encoder: ImageEncoder):
        self.model = model
        self.encoder = encoder
        self.merge = encoder.spec.merge_size
        self.live = 0  # queued or running requests with images

    def queued(self, r: Request) -> None:
        """A request joins the sampler: its positions, if it has images."""
        if r.images:
            r.mrope, r.rope_delta = mrope_positions(len(r.prompt), r.images, self.merge)
            self.live += 1

    def finished(self, r: Request) -> None:
        """A request leaves the sampler (its result is taken, or it was cancelled)."""
        if r.images:
            self.live -= 1
            r.features.clear()

    def prompt_done(self, r: Request) -> None:
        r.features.clear()  # its images' KV is computed: their features are the encoder cache's now

    def chunk_inputs(
        self, rows: list[tuple[Request, int]], tokens: torch.Tensor, positions: torch.Tensor
    ) -> dict:
        """The forward's `positions` and `embeds` for a prefill chunk whose rows are `rows`
        (tokens and positions [B, T] from `KVLayout.prefill`); {} when no row has images."""
        if not self.live or not any(r.images for r, _ in rows):
            return {}
        B, T = tokens.shape
        mrope = positions.expand(3, B, T).clone()
        images, features, starts = [], [], []
        for i, (r, take) in enumerate(rows):
            start = r.prefilled
            starts.append(start)
            ims = [im for im in r.images if im.overlaps(start, start + take)]
            images.append(ims)
            features.append(self._features(r, ims))
            if r.images:  # a padded tail (past `take`) goes on as text: its outputs are dropped
                mrope[:, i, :take] = r.mrope[:, start : start + take].to(mrope.device)
                mrope[:, i, take:] += r.rope_delta
        return dict(positions=mrope, embeds=embed_with_images(self.model, tokens, images, features, starts))

    def _features(self, r: Request, images) -> list[torch.Tensor]:
        missing = [im for im in images if im.content_hash not in r.features]
        for im, f in zip(missing, self.encoder.features(missing)):
            r.features[im.content_hash] = f
        return [r.features[im.content_hash] for im in images]

    def decode_positions(self, seqs: list[Sequence], positions: torch.Tensor) -> torch.Tensor:
        """Decode positions [B, 1]: each sequence's index + its request's rope delta."""
        if not self.live:
            return positions
        deltas = [s.request.rope_delta for s in seqs]
        if not any(deltas):
            return positions
        return positions + torch.tensor(deltas, device=positions.device)[:, None]


def meter_images(r: Request) -> None:
    """The request's image tokens among its prompt tokens prefilled so far, cached or computed."""
    if r.images:
        cached = image_positions(r.images, 0, r.cached)
        r.usage.cached_image_tokens = cached
        r.usage.image_tokens = image_positions(r.images, 0, r.prefilled) - cached
