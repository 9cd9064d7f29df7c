"""Qwen3.5's vision tower: pixel patches -> one feature per vision token, in the language model's width.

Read top to bottom: config -> 2D rotary embedding -> attention -> block -> patch merger -> tower ->
loader. The input is `images.image_patches`' rows (one per patch, in merge-block order, each
3 x temporal_patch_size x patch_size^2 values) and each image's patch grid (t, h, w); the output
has one row per merge block of merge_size^2 patches: the image's vision tokens, in order.

- Patch embedding: a Conv3d whose kernel is its stride, i.e. one linear map of each flattened patch
  (computed as that linear: the same weights, `patch_embed.proj`).
- Position embedding: a learned square table, resampled bilinearly (corners aligned) to each
  image's grid, added to the patch embeddings.
- Blocks: pre-LayerNorm, full (non-causal) attention within each image with 2D RoPE (a patch's row
  rotates the first half of each head's rotary frequencies, its column the second), an MLP.
- Merger: LayerNorm, then each merge block's patches concatenated -> fc1 -> GELU -> fc2.

Invariants
- Module names are Hugging Face's `Qwen3_5VisionModel`'s (`model.visual.*` in a `qwen3_5`
  checkpoint), so `load_vision_tower` loads its weights with `load_state_dict`.
- Frozen, inference only: the loader returns it without gradients, in eval mode. It computes the
  reference's math within rounding; an fp64 tower stays fp64 (its RoPE frequencies stay the fp32
  values, as the text model's do).
- Images never attend to each other: a batch of images gives each image's features alone.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors import safe_open
from torch import nn

from . import invariant

VISUAL = "model.visual."  # a `qwen3_5` checkpoint's vision tower weights
ACTIVATIONS = {"gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"), "gelu": F.gelu}


# ----------------------------------------------------------------------------- config
@dataclass(frozen=True)
class VisionConfig:
    depth: int
    hidden_size: int
    intermediate_size: int
    num_heads: int
    out_hidden_size: int
    num_position_embeddings: int
    patch_size: int = 16
    temporal_patch_size: int = 2
    spatial_merge_size: int = 2
    in_channels: int = 3
    hidden_act: str = "gelu_pytorch_tanh"
    rope_theta: float = 10000.0

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    @property
    def patch_values(self) -> int:
        """Values of one input patch row: channels x temporal_patch_size x patch_size^2."""
        return self.in_channels * self.temporal_patch_size * self.patch_size**2

    @classmethod
    def from_hf(cls, cfg: dict) -> VisionConfig:
        """A `qwen3_5` config.json's `vision_config` (Qwen3_5VisionConfig's defaults where absent)."""
        if cfg.get("hidden_act", "gelu_pytorch_tanh") not in ACTIVATIONS:
            raise ValueError(
                f"vision_config.hidden_act {cfg['hidden_act']!r}: use one of {', '.join(ACTIVATIONS)}"
            )
        rope = cfg.get("rope_parameters") or {}
        return cls(
            depth=cfg.get("depth", 27),
            hidden_size=cfg.get("hidden_size", 1152),
            intermediate_size=cfg.get("intermediate_size", 4304),
            num_heads=cfg.get("num_heads", 16),
            out_hidden_size=cfg.get("out_hidden_size", 3584),
            num_position_embeddings=cfg.get("num_position_embeddings", 2304),
            patch_size=cfg.get("patch_size", 16),
            temporal_patch_size=cfg.get("temporal_patch_size", 2),
            spatial_merge_size=cfg.get("spatial_merge_size", 2),
            in_channels=cfg.get("in_channels", 3),
            hidden_act=cfg.get("hidden_act", "gelu_pytorch_tanh"),
            rope_theta=float(rope.get("rope_theta", 10000.0)),
        )


def block_order(h: int, w: int, merge: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Each patch's (row, column) in an h x w grid, in merge-block order (the processor's patch
    order: merge x merge blocks row by row, each block's patches row by row)."""
    rows = torch.arange(h).view(h // merge, merge, 1, 1).expand(-1, -1, w // merge, merge)
    cols = torch.arange(w).view(1, 1, w // merge, merge).expand(h // merge, merge, -1, -1)
    return rows.transpose(1, 2).reshape(-1), cols.transpose(1, 2).reshape(-1)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


# ----------------------------------------------------------------------------- layers
class PatchEmbed(nn.Module):
    def __init__(self, cfg: VisionConfig):
        super().__init__()
        kernel = (cfg.temporal_patch_size, cfg.patch_size, cfg.patch_size)
        self.proj = nn.Conv3d(cfg.in_channels, cfg.hidden_size, kernel, stride=kernel, bias=True)

    def forward(self, patches: torch.Tensor) -> torch.Tensor:
        w = self.proj.weight
        return F.linear(patches.to(w.dtype), w.reshape(w.shape[0], -1), self.proj.bias)


class VisionAttention(nn.Module):
    def __init__(self, cfg: VisionConfig):
        super().__init__()
        self.num_heads = cfg.num_heads
        self.qkv = nn.Linear(cfg.hidden_size, 3 * cfg.hidden_size, bias=True)
        self.proj = nn.Linear(cfg.hidden_size, cfg.hidden_size, bias=True)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, lengths: list[int]):
        n = x.shape[0]
        q, k, v = self.qkv(x).view(n, 3, self.num_heads, -1).unbind(1)  # [N, H, D] each
        wide = invariant.wide_dtype(x.dtype)
        cos, sin = cos[:, None].to(wide), sin[:, None].to(wide)
        q = (q.to(wide) * cos + rotate_half(q.to(wide)) * sin).to(x.dtype)
        k = (k.to(wide) * cos + rotate_half(k.to(wide)) * sin).to(x.dtype)
        # each image attends within itself, not causally; 4D [1, H, N, D], as torch's fused CPU kernel
        # takes only 4D inputs (3D ones go to its unfused math path, several times slower)
        out = [
            F.scaled_dot_product_attention(
                qi.transpose(0, 1)[None], ki.transpose(0, 1)[None], vi.transpose(0, 1)[None]
            )[0]
            for qi, ki, vi in zip(q.split(lengths), k.split(lengths), v.split(lengths))
        ]
        return self.proj(torch.cat(out, dim=1).transpose(0, 1).reshape(n, -1))


class VisionMLP(nn.Module):
    def __init__(self, cfg: VisionConfig):
        super().__init__()
        self.linear_fc1 = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=True)
        self.linear_fc2 = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=True)
        self.act = ACTIVATIONS[cfg.hidden_act]

    def forward(self, x):
        return self.linear_fc2(self.act(self.linear_fc1(x)))


class VisionBlock(nn.Module):
    def __init__(self, cfg: VisionConfig):
        super().__init__()
        self.norm1 = nn.LayerNorm(cfg.hidden_size, eps=1e-6)
        self.norm2 = nn.LayerNorm(cfg.hidden_size, eps=1e-6)
        self.attn = VisionAttention(cfg)
        self.mlp = VisionMLP(cfg)

    def forward(self, x, cos, sin, lengths):
        x = x + self.attn(self.norm1(x), cos, sin, lengths)
        return x + self.mlp(self.norm2(x))


class PatchMerger(nn.Module):
    def __init__(self, cfg: VisionConfig):
        super().__init__()
        self.merged = cfg.hidden_size * cfg.spatial_merge_size**2
        self.norm = nn.LayerNorm(cfg.hidden_size, eps=1e-6)
        self.linear_fc1 = nn.Linear(self.merged, self.merged)
        self.linear_fc2 = nn.Linear(self.merged, cfg.out_hidden_size)

    def forward(self, x):
        return self.linear_fc2(F.gelu(self.linear_fc1(self.norm(x).view(-1, self.merged))))


# ----------------------------------------------------------------------------- the tower
class VisionTower(nn.Module):
    """`forward(patches, grids)`: patch rows of every image, concatenated, and each image's grid
    (t, h, w) -> [sum of t*h*w / merge^2, out_hidden_size] features, image after image."""

    def __init__(self, cfg: VisionConfig):
        super().__init__()
        self.cfg = cfg
        self.patch_embed = PatchEmbed(cfg)
        self.pos_embed = nn.Embedding(cfg.num_position_embeddings, cfg.hidden_size)
        self.blocks = nn.ModuleList(VisionBlock(cfg) for _ in range(cfg.depth))
        self.merger = PatchMerger(cfg)
        self.side = int(cfg.num_position_embeddings**0.5)
        self.register_buffer("inv_freq", vision_inv_freq(cfg), persistent=False)

    @property
    def dtype(self) -> torch.dtype:
        return self.pos_embed.weight.dtype

    def forward(self, patches: torch.Tensor, grids: list[tuple[int, int, int]]) -> torch.Tensor:
        x = self.patch_embed(patches)
        x = x + torch.cat([self._positions(t, h, w) for t, h, w in grids]).to(x.dtype)
        cos, sin = self._rotary(grids)
        lengths = [h * w for t, h, w in grids for _ in range(t)]  # each frame attends within itself
        for block in self.blocks:
            x = block(x, cos, sin, lengths)
        return self.merger(x)

    def _positions(self, t: int, h: int, w: int) -> torch.Tensor:
        """The learned position table resampled to an h x w grid, in merge-block order, per frame."""
        table = self.pos_embed.weight.view(self.side, self.side, -1).permute(2, 0, 1)[None]
        grid = F.interpolate(table, size=(h, w), mode="bilinear", align_corners=True)[0]
        rows, cols = block_order(h, w, self.cfg.spatial_merge_size)
        return grid[:, rows, cols].t().repeat(t, 1)

    def _rotary(self, grids) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sin [patches, head_dim]: a patch's row angles, then its column angles, twice."""
        merge = self.cfg.spatial_merge_size
        pos = torch.cat([torch.stack(block_order(h, w, merge), -1).repeat(t, 1) for t, h, w in grids])
        wide = invariant.wide_dtype(self.dtype)
        angles = (pos.to(self.inv_freq.device, wide)[..., None] * self.inv_freq.to(wide)).flatten(1)
        angles = torch.cat((angles, angles), dim=-1)
        return angles.cos(), angles.sin()


def vision_inv_freq(cfg: VisionConfig) -> torch.Tensor:
    """RoPE frequencies of each spatial axis: a quarter of the head's dims each (fp32, as HF's)."""
    dim = cfg.head_dim // 2
    return 1.0 / (cfg.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.float) / dim))


# ----------------------------------------------------------------------------- loading
def read_vision_config(path: str | Path) -> VisionConfig | None:
    """The vision tower's config of the checkpoint at `path`; None for a text model."""
    cfg = json.loads((Path(path) / "config.json").read_text())
    vision = cfg.get("vision_config")
    return VisionConfig.from_hf(vision) if vision else None


def has_vision_weights(path: str | Path) -> bool:
    """Whether the checkpoint at `path` holds vision tower weights (`model.visual.*`): a full
    fine-tuning run's weights directory keeps the config but holds the language model only."""
    for f in sorted(Path(path).glob("*.safetensors")):
        with safe_open(str(f), "pt") as st:
            if any(k.startswith(VISUAL) for k in st.keys()):
                return True
    return False


def load_vision_tower(
    path: str | Path, device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32
) -> VisionTower | None:
    """The frozen vision tower of the `qwen3_5` checkpoint at `path` (its `model.visual.*`
    weights); None for a text model. The language model loads apart (weights.load_model)."""
    path = Path(path)
    cfg = read_vision_config(path)
    if cfg is None:
        return None
    state = {}
    for f in sorted(path.glob("*.safetensors")):
        with safe_open(str(f), "pt") as st:
            for k in st.keys():
                if k.startswith(VISUAL):
                    state[k[len(VISUAL) :]] = st.get_tensor(k)
    if not state:
        raise ValueError(f"{path}: config.json has a vision_config but no {VISUAL}* weights")
    with torch.device("meta"):
        tower = VisionTower(cfg)
    tower = tower.to_empty(device=device)
    missing, unexpected = tower.load_state_dict(state, strict=False)
    if missing or unexpected:
        raise ValueError(
            f"{path}: vision weights do not match the vision_config: missing {missing[:5]}, "
            f"unexpected {unexpected[:5]}"
        )
    tower = tower.to(dtype)
    tower.inv_freq = vision_inv_freq(cfg).to(device)  # a non-persistent buffer: rebuilt, kept fp32
    return tower.requires_grad_(False).eval()
