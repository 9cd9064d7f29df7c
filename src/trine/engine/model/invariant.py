"""Batch-invariant kernels: the model's numerics, so that the sampler and the trainer compute the
same numbers bit for bit.

A token's logprob must not depend on what else is in its batch, on how many of its prompt's
tokens came from the KV cache, on how its keys are laid out in memory, or on which code path (a
decode step, a prefill chunk, the training forward) computed it. CPU BLAS and torch's kernels
pick their blocking, their code path and their threads' split of a reduction from the shapes of a
call, so every reduction here runs in calls whose shapes do not depend on the batch:

- `linear`: rows go through `F.linear` in chunks of exactly `ROW_TILE` rows (the last one zero
  padded). Measured on MKL: a row's result changes with M below 16 rows; with 2 threads the K
  reduction is split between threads for some M and not others; and on its AVX2 path rows are
  computed in blocks of 6, a remainder of 1 to 3 rows in other bits, so a 32-row call gave its last
  two rows other bits than its first. `ROW_TILE` = 24 = 4 x 6 is a multiple of both paths' blocks.
- `attention`: keys are cut in tiles of `KEY_TILE` positions. Scores are matmuls of `ROW_TILE`
  query rows per (sequence, kv head), the rows zero padded; the softmax is two-pass with an exact
  max; each key tile's probabilities times its values is one fixed-shape [ROW_TILE, KEY_TILE] x
  [KEY_TILE, head_dim] matmul, and the tiles' partial sums (and the denominators) are added in
  key order by a sequential `cumsum`. Fully masked tiles add exactly zero, so a query's result is
  the same whatever keys it does not see, how many there are, and where they sit.
- `silu`: x / (1 + exp(-x)); torch's fused SiLU gives a different last bit in its scalar tail
  loop, so an element's value depended on its offset in the tensor.
- `log_probs`: log-softmax, the one normalisation of logits everywhere (torch's `logsumexp` splits
  a single row's reduction between threads; its `log_softmax` does not).

The kernels are opt-in (`enable(True)`; `trine serve --batch-invariant`,
`EngineConfig(batch_invariant=True)`): they cost throughput (docs/numerics.md, "Sampler = trainer,
bit for bit"). Off, the same functions are torch's fused kernels (F.linear, or the GEMM kernel chosen for
few rows: kernels/gemm.py; SDPA, F.silu) and a token's logprob may differ between the sampler and the
trainer in the last bits (about 1e-6 in fp32). The switch is process-wide: every engine in one
process computes the same way.

Invariants (while enabled)
- For a fixed thread count, each output row of these functions depends only on that row's inputs
  (and, for attention, on the keys and values it may attend, in position order).
- Attention needs each query's visible keys in position order along the key axis, tile aligned:
  visible key at position p sits in tile p // KEY_TILE's place among that query's visible tiles,
  at offset p % KEY_TILE. Contiguous positions 0..L (training, prefill, decode) satisfy it; the
  sampler's packed decode layout (kv_layout.py) is built to.
"""

from __future__ import annotations

import functools
import logging
import math
import os

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from .kernels import gemm

ROW_TILE = 24  # rows per GEMM call: >= 16 (MKL's small-M path) and a multiple of its AVX2 6-row block
KEY_TILE = 16  # key positions per attention tile
QUERY_CHUNK = 256  # queries per attention pass: bounds the [queries, keys] score memory
_enabled = False
log = logging.getLogger(__name__)


def enable(on: bool) -> None:
    """Batch-invariant kernels on or off, for every engine in this process. On, once a process: a
    warning where this process's GEMMs break what the kernels rely on (`rows_invariant`)."""
    global _enabled
    _enabled = bool(on)
    if _enabled and not rows_invariant():
        log.warning(
            "--batch-invariant: this process's GEMMs give a row other bits in another place of a "
            "%d-row call (kernel path: ATen %s, MKL_ENABLE_INSTRUCTIONS=%s, MKL_CBWR=%s), so the "
            "sampler's and the trainer's logprobs may differ in their last bits",
            ROW_TILE,
            torch.backends.cpu.get_cpu_capability(),
            os.environ.get("MKL_ENABLE_INSTRUCTIONS", "unset"),
            os.environ.get("MKL_CBWR", "unset"),
        )


@functools.cache
def rows_invariant() -> bool:
    """Whether this process's GEMMs keep what the kernels rely on: a row's bits in a ROW_TILE-row
    call do not depend on its place there, so `linear` gives a row the same bits in any batch and
    `attention` gives a sequence's last queries the bits they have in the whole sequence's call
    (what a cached prefix or a decode step does). A probe of a few ms, once a process; call it
    enabled. (A tile of 32 rows failed it on MKL's AVX2 path, which computes rows in blocks of 6.)"""
    g = torch.Generator().manual_seed(0)
    x, w = torch.randn(ROW_TILE, 96, generator=g), torch.randn(80, 96, generator=g)
    whole = linear(x, w)
    if not all(torch.equal(linear(x.roll(s, 0), w).roll(-s, 0), whole) for s in (1, 5, ROW_TILE - 2)):
        return False
    q = torch.randn(1, 4, 17, 24, generator=g)
    k, v = torch.randn(1, 2, 17, 24, generator=g), torch.randn(1, 2, 17, 24, generator=g)
    whole = attention(q, k, v, causal=True)
    for t in (1, 4, 8):
        mask = torch.ones(t, 17, dtype=torch.bool).tril(17 - t)[None, None]
        if not torch.equal(attention(q[:, :, 17 - t :], k, v, mask=mask), whole[:, :, 17 - t :]):
            return False
    return True


def linear(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, owner: object = None
) -> torch.Tensor:
    """F.linear whose output rows do not depend on how many other rows the call holds. Off, a
    module's (`owner`'s) base weight multiplies few rows through the GEMM kernel chosen for it
    (kernels/gemm.py: MKL's packed weights, oneDNN's or F.linear)."""
    if not _enabled:
        if owner is not None:
            return gemm.linear(owner, x, weight, bias)
        return F.linear(x, weight, bias)
    k = x.shape[-1]
    rows = x.reshape(-1, k)
    m = rows.shape[0]
    if m == 0:
        return F.linear(x, weight, bias)
    pad = (-m) % ROW_TILE
    if pad:
        rows = torch.cat([rows, rows.new_zeros(pad, k)])
    chunks = [F.linear(c, weight, bias) for c in rows.split(ROW_TILE)]
    out = chunks[0] if len(chunks) == 1 else torch.cat(chunks)
    return (out[:m] if pad else out).view(*x.shape[:-1], -1)


def silu(x: torch.Tensor) -> torch.Tensor:
    return x / (1 + torch.exp(-x)) if _enabled else F.silu(x)


def sigmoid(x: torch.Tensor) -> torch.Tensor:
    """torch.sigmoid; enabled, 1 / (1 + exp(-x)): torch's sigmoid, like its SiLU, rounds the
    elements of its scalar tail loop otherwise, so an element's bits followed its offset."""
    return 1 / (1 + torch.exp(-x)) if _enabled else torch.sigmoid(x)


def softplus(x: torch.Tensor) -> torch.Tensor:
    """F.softplus (threshold 20); enabled, from exp and log1p (vectorised to the last element, as
    `sigmoid`). The clamp keeps exp finite, so the gradient of the branch not taken is 0, not NaN."""
    if not _enabled:
        return F.softplus(x)
    return torch.where(x > 20, x, torch.log1p(torch.exp(x.clamp(max=20))))


def enabled() -> bool:
    return _enabled


def wide_dtype(dtype: torch.dtype) -> torch.dtype:
    """fp32, or `dtype` where that is wider: bf16 math that must not round is done in fp32, and an
    fp64 model (the tests' reference for fp32 rounding) stays fp64 throughout."""
    return torch.promote_types(dtype, torch.float32)


def widened(x: torch.Tensor) -> torch.Tensor:
    """`x` in `wide_dtype(x.dtype)`."""
    return x.to(wide_dtype(x.dtype))


def log_probs(logits: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """Log-softmax over the last dim, in fp32 (`widened`): every logprob the engine reports is read
    from this. `out` (the result's dtype, logits' shape) receives it in place of a new tensor."""
    return torch.log_softmax(widened(logits), dim=-1, out=out)


def attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None = None, causal: bool = False
) -> torch.Tensor:
    """q [N, H, T, D], k/v [N, KVH, L, D] -> [N, H, T, D]; scale 1/sqrt(D), grouped-query heads.

    `mask` [N, 1, T, L] bool (True: may attend; every query must see at least one key); without
    one, `causal` lets query t see keys 0..t (T == L), else every query sees every key. With
    gradients on, the attention is recomputed in backward rather than storing its [T, L] tensors.
    Computed in fp32 (`wide_dtype`) whatever the inputs' dtype (as flash attention accumulates),
    returned in it.
    Not enabled: torch's SDPA, the fused kernel of every device. On CPU, bf16 inputs outside
    inference mode (the trainer's forwards, with or without gradients, so its `forward` and
    `forward_backward` agree bit for bit) run it in fp32 and round the result: CPU flash
    attention's bf16 backward is several times slower than its fp32 one (docs/numerics.md).
    """
    if not _enabled:
        dtype = q.dtype
        if dtype == torch.bfloat16 and q.device.type == "cpu" and not torch.is_inference_mode_enabled():
            q, k, v = q.float(), k.float(), v.float()
        out = F.scaled_dot_product_attention(
            q, k, v, attn_mask=mask, is_causal=causal and mask is None, enable_gqa=k.shape[1] != q.shape[1]
        )
        return out.to(dtype)
    dtype = q.dtype
    q, k, v = widened(q), widened(k), widened(v)
    N, H, T, D = q.shape
    L = k.shape[2]
    if mask is None:
        mask = torch.ones(T, L, dtype=torch.bool, device=q.device)
        mask = (mask.tril() if causal else mask)[None, None]
    pad = (-L) % KEY_TILE
    if pad:
        k, v = F.pad(k, (0, 0, 0, pad)), F.pad(v, (0, 0, 0, pad))
        mask = F.pad(mask, (0, pad), value=False)
    k, v = k.contiguous(), v.contiguous()
    outs = []
    for a in range(0, T, QUERY_CHUNK):
        m = mask[:, :, a : a + QUERY_CHUNK]
        seen = m.reshape(-1, m.shape[-1]).any(0).nonzero()
        keys = -(-(int(seen.max()) + 1) // KEY_TILE) * KEY_TILE  # the tiles any query here sees
        args = (q[:, :, a : a + QUERY_CHUNK], k[:, :, :keys], v[:, :, :keys], m[..., :keys])
        if torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad):
            outs.append(checkpoint(_attend, *args, use_reentrant=False))
        else:
            outs.append(_attend(*args))
    return (outs[0] if len(outs) == 1 else torch.cat(outs, 2)).to(dtype)


def _attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """One pass of `attention` over a chunk of queries; L a multiple of KEY_TILE."""
    N, H, T, D = q.shape
    kvh, L = k.shape[1], k.shape[2]
    g = H // kvh
    rows = q.reshape(N, kvh, g * T, D)  # a kv head's queries: (group member, position)
    s = _row_tiled(rows, k.transpose(-1, -2)[:, :, None]).mul_(1 / math.sqrt(D)).view(N, kvh, g, T, L)
    s = s.masked_fill(~mask[:, :, None], -math.inf)
    p = torch.exp(s - s.amax(-1, keepdim=True)).view(N, kvh, g * T, L // KEY_TILE, KEY_TILE)
    denom = p.sum(-1).cumsum(-1)[..., -1:]  # [N, kvh, rows, 1]: tile sums added in key order
    parts = _row_tiled(p.transpose(2, 3), v.view(N, kvh, L // KEY_TILE, 1, KEY_TILE, D))
    out = parts.cumsum(2)[:, :, -1] / denom  # [N, kvh, rows, D]
    return out.view(N, H, T, D)


def _row_tiled(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """a [..., M, K] @ b [..., 1, K, N] -> [..., M, N] as GEMMs of exactly ROW_TILE rows of `a` (zero
    padded), `b` broadcast over the tiles: each row's bits then do not depend on M or its place."""
    m, kk = a.shape[-2], a.shape[-1]
    pad = (-m) % ROW_TILE
    if pad:
        a = F.pad(a, (0, 0, 0, pad))
    out = torch.matmul(a.reshape(*a.shape[:-2], (m + pad) // ROW_TILE, ROW_TILE, kk), b)
    out = out.view(*a.shape[:-2], m + pad, out.shape[-1])
    return out[..., :m, :] if pad else out
