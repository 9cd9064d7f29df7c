"""Gated DeltaNet: the linear-attention layer of Qwen3.5's hybrid stack, with the state it carries.

Math (per value head h; keys and queries L2-normalised, queries scaled by 1/sqrt(Dk)): a state
S [Dk, Dv] is decayed, corrected toward the token's value, then read by its query,

    S_t = a_t S_{t-1} + beta_t k_t (v_t - a_t S_{t-1}^T k_t)^T,    o_t = S_t^T q_t,

with a_t = exp(g_t), g_t = -exp(A_log) * softplus(a_proj + dt_bias) <= 0 and beta_t =
sigmoid(b_proj). q, k and v come out of one projection (`in_proj_qkv`) through a short causal
depthwise conv (kernel `linear_conv_kernel_dim`, then SiLU); the output is a gated RMSNorm of o by
`in_proj_z`, then `out_proj`. Key heads serve `linear_num_value_heads // linear_num_key_heads`
consecutive value heads each.

Two forms of the same rule:
- `chunked_rule` (prefill, training; any length): chunks of `CHUNK` tokens, each a triangular
  solve (the UT transform) and a few matmuls, then one state update per chunk. Its decays below
  e^`LOG_TINY` are 0 (`_decay`): no subnormal floats, a change far below fp64's rounding.
- `recurrent_rule` (decode; everything under batch-invariant kernels): one state update per token.
The layer's forward is the one place that chooses between them.

State (`LinearState`, per layer and sequence): the recurrent state [Hv, Dk, Dv], in the wide dtype
(fp32, or an fp64 model's fp64), and the conv state [conv_dim, K - 1]: the last K - 1 inputs of the
conv (the `in_proj_qkv` outputs before it, in the model dtype), conv_dim = 2 Hk Dk + Hv Dv. A
forward may also return the state at *cuts* (row, t) inside its tokens: what a prefix cache keeps
as snapshots, taken in the same forward (the chunked form ends a chunk at each cut).

Invariants
- Running T tokens from a state S gives, within fp32 rounding, the same outputs and final state
  whichever form runs them and however they are cut into pieces (the state carried from piece to
  piece). A prefix's state is therefore reusable: what the sampler's prefix cache relies on. Chunks
  are counted from a piece's first token (and from each cut): two chunked runs compute the same
  bits only if cut at the same places.
- Padded positions (`real` False; real tokens first in each row, padding after) leave both states
  exactly as they are: their decay is 1 and their update 0, and the conv state is each row's last
  K - 1 real inputs.
- The rule is computed in `invariant.wide_dtype`, so an fp64 model (the tests' rounding reference)
  stays fp64 throughout.
- With batch-invariant kernels (invariant.py) the layer is batch invariant: the recurrent form's
  element-wise steps and index-order sums, a fixed-order conv, exp-based sigmoid and softplus,
  and the projections through `LoRALinear`. A token's output and the state after it are the same
  bits in a decode step, any prefill chunk (from a cached snapshot or not) and the training
  forward, whatever else is in the batch.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from . import invariant
from .invariant import silu
from .kernels import delta_rule
from .lora import AdapterBatch, FusedLinears, LoRALinear

CHUNK = 64  # tokens per chunk of `chunked_rule` (the reference's)
L2_EPS = 1e-6  # the reference's epsilon of the q/k L2 norm
# Decays below e^-30 (9e-14 of what they scale: under the tests' fp64 same-math bound, far under
# fp32's rounding) are taken as 0 in `chunked_rule`: strong decays over a chunk otherwise made
# subnormal floats in its products and their gradients, which x86 CPUs compute in microcode, several
# times slower (a training step's chunk matmuls and triangular solves).
LOG_TINY = -30.0


@dataclass(frozen=True)
class LinearAttentionShape:
    """A Gated DeltaNet layer's dimensions (Qwen3.5's `linear_*` config keys)."""

    num_key_heads: int
    num_value_heads: int
    key_head_dim: int
    value_head_dim: int
    conv_kernel: int = 4

    @property
    def key_dim(self) -> int:
        return self.num_key_heads * self.key_head_dim

    @property
    def value_dim(self) -> int:
        return self.num_value_heads * self.value_head_dim

    @property
    def conv_dim(self) -> int:
        return 2 * self.key_dim + self.value_dim


@dataclass
class LinearState:
    """One Gated DeltaNet layer's state for a batch of sequences (rows).

    conv [B, conv_dim, K - 1]: the last K - 1 conv inputs, model dtype.
    recurrent [B, Hv, Dk, Dv]: the delta rule's state, wide dtype.
    """

    conv: torch.Tensor
    recurrent: torch.Tensor
    snapshots: LinearState | None = None  # a forward's states at its cuts, one row per cut
    donated: bool = False  # the caller gives these tensors up: a forward may write the new state over them

    @classmethod
    def zeros(cls, shape: LinearAttentionShape, batch: int, device=None, dtype=torch.float32) -> LinearState:
        """The state before any token: what a sequence's first forward starts from."""
        conv = torch.zeros(batch, shape.conv_dim, shape.conv_kernel - 1, device=device, dtype=dtype)
        rec = (batch, shape.num_value_heads, shape.key_head_dim, shape.value_head_dim)
        return cls(conv, torch.zeros(rec, device=device, dtype=invariant.wide_dtype(dtype)))

    @classmethod
    def cat(cls, states: list[LinearState]) -> LinearState:
        """Rows of several states as one batch, in order."""
        return cls(torch.cat([s.conv for s in states]), torch.cat([s.recurrent for s in states]))

    def rows(self, index: torch.Tensor | slice) -> LinearState:
        """The state of some rows (a copy for an index tensor, a view for a slice)."""
        return LinearState(self.conv[index], self.recurrent[index])

    def clone(self) -> LinearState:
        """A snapshot: later forwards from `self` do not change it."""
        return LinearState(self.conv.clone(), self.recurrent.clone())

    @property
    def nbytes(self) -> int:
        return self.conv.nbytes + self.recurrent.nbytes


# ----------------------------------------------------------------------------- the rule, two forms
Cuts = list[tuple[int, int]]  # (row, t): the state after row's first t tokens of the call, 0 < t <= T


def _prepare(q, k, v, g, beta):
    """[B, T, H*, D] inputs -> [B, Hv, T, D] in the wide dtype, q/k L2-normalised, q scaled."""
    wide = invariant.wide_dtype(q.dtype)
    groups = v.shape[2] // q.shape[2]
    if groups > 1:  # each key head serves `groups` consecutive value heads
        q, k = q.repeat_interleave(groups, dim=2), k.repeat_interleave(groups, dim=2)
    q, k, v, g, beta = (x.transpose(1, 2).to(wide).contiguous() for x in (q, k, v, g, beta))
    q = q * torch.rsqrt((q * q).sum(-1, keepdim=True) + L2_EPS)
    k = k * torch.rsqrt((k * k).sum(-1, keepdim=True) + L2_EPS)
    return q * q.shape[-1] ** -0.5, k, v, g, beta


def _step(s, q, k, v, decay, beta, in_place: bool = False):
    """One token of the rule: s [B, H, Dk, Dv]; q, k [B, H, Dk]; v [B, H, Dv]; decay, beta [B, H]
    -> (o [B, H, Dv], the new state). `in_place`: s is the caller's to give up (the sampler's
    pool rows), so the new state is written over it and no copy of the state is made."""
    if invariant.enabled() or torch.is_grad_enabled():
        # batch invariant (element-wise products, sums over Dk in index order, whatever the
        # batch), and differentiable
        s = s * decay[..., None, None]
        delta = (v - (s * k[..., None]).sum(-2)) * beta[..., None]
        s = s + k[..., None] * delta[..., None, :]
        return (s * q[..., None]).sum(-2), s
    if delta_rule.suits(s):  # the same math in C: one read and one write of S
        s = s if in_place else s.clone()
        return delta_rule.step_(s, q, k, v, decay, beta), s
    # One read of S gives k^T S and q^T S; then S' = decay S + k delta^T (two passes, in place on
    # a state of our own) and o = q^T S' = decay q^T S + (q . k) delta: three passes over S in all.
    kq = torch.stack([k, q], -2) @ s  # [B, H, 2, Dv]
    d = decay[..., None]
    delta = (v - d * kq[..., 0, :]) * beta[..., None]
    o = d * kq[..., 1, :] + (q * k).sum(-1, keepdim=True) * delta
    s = s.mul_(decay[..., None, None]) if in_place else s * decay[..., None, None]
    dk, dv = s.shape[-2:]
    s.view(-1, dk, dv).baddbmm_(k.reshape(-1, dk, 1), delta.reshape(-1, 1, dv))
    return o, s


def _steps(s, q, k, v, decay, beta, at: dict, taken, in_place: bool = False):
    """`_step` over tokens [0, T) of the [B, H, T, D] inputs; after token t, the state of each
    (cut index, row) in at[t + 1] goes to taken[cut index]. -> (o [B, H, T, Dv], final state)."""
    outs = []
    for t in range(q.shape[2]):
        o, s = _step(s, q[:, :, t], k[:, :, t], v[:, :, t], decay[:, :, t], beta[:, :, t], in_place)
        outs.append(o)
        for i, b in at.get(t + 1, ()):
            taken[i] = s[b]
    return torch.stack(outs, 2), s


def recurrent_rule(q, k, v, g, beta, state: torch.Tensor, cuts: Cuts | None = None, in_place: bool = False):
    """The gated delta rule one token at a time. q, k [B, T, Hk, Dk]; v [B, T, Hv, Dv]; g, beta
    [B, T, Hv]; state [B, Hv, Dk, Dv] -> (o [B, T, Hv, Dv] in v's dtype, the final state, the state
    at each of `cuts` [len(cuts), Hv, Dk, Dv] or None). `in_place`: `state` (in the wide dtype) may
    be overwritten by the new state, which is then returned in it. With gradients on, the tokens run in
    checkpointed pieces of `CHUNK` (backward recomputes a piece from its first state), so the
    graph keeps a state per piece, not per token."""
    dtype = v.dtype
    q, k, v, g, beta = _prepare(q, k, v, g, beta)
    s = state.to(q.dtype)
    T = q.shape[2]
    if T == 0:
        return v.transpose(1, 2).to(dtype), s, None
    decay = g.exp()
    taken = None if not cuts else s.new_empty(len(cuts), *s.shape[1:])
    at: dict[int, list[tuple[int, int]]] = {}
    for i, (b, t) in enumerate(cuts or ()):
        at.setdefault(t, []).append((i, b))
    grad = torch.is_grad_enabled() and any(x.requires_grad for x in (q, k, v, decay, beta, s))
    if not grad:
        o, s = _steps(s, q, k, v, decay, beta, at, taken, in_place)
    else:  # cuts are for inference (a prefix cache's snapshots): none with gradients
        outs = []
        for a in range(0, T, CHUNK):
            piece = [x[:, :, a : a + CHUNK] for x in (q, k, v, decay, beta)]
            o, s = checkpoint(_steps, s, *piece, {}, None, use_reentrant=False)
            outs.append(o)
        o = torch.cat(outs, 2)
    return o.transpose(1, 2).to(dtype), s, taken


def _segmented(T: int, rows: int, cuts: Cuts, chunk: int, device):
    """The chunked rule's layout when each cut must end a chunk: every row's positions [0, T) in
    segments at its cuts, each segment starting a new chunk (identity padding between). Returns
    (where each position goes [rows, T], the padded length, after which chunk each cut's state is)."""
    by_row: list[list[tuple[int, int]]] = [[] for _ in range(rows)]
    for i, (b, t) in enumerate(cuts):
        by_row[b].append((t, i))
    where, width, ends = [], 0, [0] * len(cuts)
    for row in by_row:
        parts, at, prev = [], 0, 0
        for t, i in sorted(row) + [(T, -1)]:
            parts.append(torch.arange(at, at + t - prev))
            at += -(-(t - prev) // chunk) * chunk
            if i >= 0:
                ends[i] = at // chunk - 1
            prev = t
        where.append(torch.cat(parts))
        width = max(width, at)
    return torch.stack(where).to(device), max(width, chunk), ends


def chunked_rule(
    q,
    k,
    v,
    g,
    beta,
    state: torch.Tensor,
    chunk: int = CHUNK,
    cuts: Cuts | None = None,
    in_place: bool = False,
):
    """`recurrent_rule`'s result, by chunks of `chunk` tokens: within a chunk the rule's updates are
    one unit-lower-triangular system (the UT transform of DeltaNet), solved once; the state is read
    and updated once per chunk. Same arguments and result as `recurrent_rule` (it never writes
    `state`, whatever `in_place`). A cut ends a chunk
    (the tokens after it start the next one; identity padding fills the gap), so the state there is
    one the chunk loop computes anyway."""
    dtype = v.dtype
    q, k, v, g, beta = _prepare(q, k, v, g, beta)
    B, H, T, dk = k.shape
    ends = []
    if cuts:
        where, width, ends = _segmented(T, B, cuts, chunk, q.device)
        q, k, v, g, beta = (_spread(x, where, width) for x in (q, k, v, g, beta))
    else:
        pad = (-T) % chunk  # padded tokens: no decay (g 0), no update (k, v, beta 0)
        q, k, v = (F.pad(x, (0, 0, 0, pad)) for x in (q, k, v))
        g, beta = F.pad(g, (0, pad)), F.pad(beta, (0, pad))
    n = q.shape[2] // chunk
    k_beta, v_beta = k * beta[..., None], v * beta[..., None]
    q, k, k_beta, v_beta = (x.view(B, H, n, chunk, x.shape[-1]) for x in (q, k, k_beta, v_beta))
    cum = g.view(B, H, n, chunk).cumsum(-1)  # log of the decay from the chunk's start to each token
    upper = torch.ones(chunk, chunk, dtype=torch.bool, device=q.device).triu(1)
    pair = _decay((cum[..., :, None] - cum[..., None, :]).masked_fill(upper, float("-inf")))
    kk = k_beta @ k.transpose(-1, -2)
    system = kk * pair  # unit lower triangular once solved with I
    intra = (q @ k.transpose(-1, -2)) * pair
    values = torch.linalg.solve_triangular(system, v_beta, upper=False, unitriangular=True)
    # solve(system, k_beta * e^cum) = e^cum * solve(system without its decays, k_beta): the decays
    # cancel between the rows, and the solve then never meets the tiny products of two of them
    from_start = _decay(cum)[..., None]
    k_decayed = from_start * torch.linalg.solve_triangular(kk, k_beta, upper=False, unitriangular=True)
    q = q * from_start
    k = k * _decay(cum[..., -1:] - cum)[..., None]
    chunk_decay = _decay(cum[..., -1])[..., None, None]
    s = state.to(q.dtype)
    taken = None if not cuts else s.new_empty(len(cuts), *s.shape[1:])
    at: dict[int, list[tuple[int, int]]] = {}
    for i, e in enumerate(ends):
        at.setdefault(e, []).append((i, cuts[i][0]))
    outs = []
    for i in range(n):
        v_new = values[:, :, i] - k_decayed[:, :, i] @ s
        outs.append(q[:, :, i] @ s + intra[:, :, i] @ v_new)
        s = s * chunk_decay[:, :, i] + k[:, :, i].transpose(-1, -2) @ v_new
        for c, b in at.get(i, ()):
            taken[c] = s[b]
    o = torch.cat(outs, 2) if outs else v
    o = o.gather(2, where[:, None, :, None].expand(B, H, T, o.shape[-1])) if cuts else o[:, :, :T]
    return o.transpose(1, 2).to(dtype), s, taken


def _decay(log_decay: torch.Tensor) -> torch.Tensor:
    """exp(log_decay), 0 below e^LOG_TINY (never subnormal); its gradient 0 there too."""
    keep = log_decay >= LOG_TINY
    return torch.where(keep, log_decay.clamp(min=LOG_TINY).exp(), 0.0)


def _spread(x: torch.Tensor, where: torch.Tensor, width: int) -> torch.Tensor:
    """x [B, H, T, ...] placed at positions `where` [B, T] of a zero [B, H, width, ...]."""
    B, H, T = x.shape[:3]
    out = x.new_zeros(B, H, width, *x.shape[3:])
    index = where[:, None, :].expand(B, H, T)
    if x.dim() == 4:
        index = index[..., None].expand_as(x)
    return out.scatter_(2, index, x)


# ----------------------------------------------------------------------------- the conv
def causal_conv(
    x: torch.Tensor,
    weight: torch.Tensor,
    conv: torch.Tensor,
    lengths: torch.Tensor | None,
    cuts: Cuts | None = None,
):
    """The causal depthwise conv, then SiLU. x [B, T, C]; weight [C, 1, K]; conv [B, C, K - 1] the
    inputs before x -> (out [B, T, C], the new conv state: each row's last K - 1 inputs up to its
    `lengths` real tokens, all T when None; the conv state at each cut [len(cuts), C, K - 1] or
    None). Batch-invariant kernels on, or one token (a decode step, where F.conv1d's depthwise
    path costs more than the K products): the K products summed in a fixed order (F.conv1d's
    algorithm, and so its bits, may follow the shape)."""
    B, T, C = x.shape
    full = torch.cat([conv.to(x.dtype), x.transpose(1, 2)], -1)  # [B, C, K - 1 + T]
    w = weight.to(x.dtype)
    if invariant.enabled() or T == 1:
        K = w.shape[-1]
        out = full[:, :, :T] * w[:, :, 0]
        for i in range(1, K):
            out = out + full[:, :, i : i + T] * w[:, :, i]
    else:
        out = F.conv1d(full, w, groups=C)
    # SiLU in the [B, T, C] layout its consumers read: over the conv's [B, C, T] one, its backward met
    # the gradient transposed, a strided elementwise loop about 10x slower than a contiguous one
    out = silu(out.transpose(1, 2).contiguous())
    keep = conv.shape[-1]
    span = torch.arange(keep, device=x.device)
    if lengths is None:
        state = full[:, :, full.shape[-1] - keep :]
    else:  # row b's inputs [lengths[b], lengths[b] + K - 1) of `full`
        at = lengths[:, None] + span
        state = full.gather(2, at[:, None, :].expand(B, C, keep))
    taken = None
    if cuts:  # the state after row b's first t tokens: inputs [t, t + K - 1) of `full`
        rows = torch.tensor([b for b, _ in cuts], device=x.device)[:, None, None]
        at = (torch.tensor([t for _, t in cuts], device=x.device)[:, None] + span)[:, None, :]
        taken = full[rows, torch.arange(C, device=x.device)[None, :, None], at]  # [cuts, C, K - 1]
    return out, state.contiguous(), taken


# ----------------------------------------------------------------------------- the layer
class GatedRMSNorm(nn.Module):
    """RMSNorm of each head's output, scaled by `weight`, times SiLU of the gate (Qwen3.5's order:
    normalise in the wide dtype, round, scale, then gate in the wide dtype)."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        h = invariant.widened(x)
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        h = self.weight * h.to(dtype)
        return (h * silu(invariant.widened(gate))).to(dtype)


class GatedDeltaNet(nn.Module):
    """The layer (`model.layers.N.linear_attn`): hidden [B, T, hidden] -> [B, T, hidden], from and
    to a `LinearState`. Module and parameter names are Hugging Face's (LoRA targets `in_proj_qkv`,
    `in_proj_z`, `in_proj_b`, `in_proj_a`, `out_proj`: PEFT's); the four input projections are one
    GEMM (`FusedLinears`)."""

    def __init__(self, hidden_size: int, shape: LinearAttentionShape, eps: float):
        super().__init__()
        self.shape = shape
        hv = shape.num_value_heads
        self.in_proj_qkv = LoRALinear(hidden_size, shape.conv_dim, bias=False)
        self.in_proj_z = LoRALinear(hidden_size, shape.value_dim, bias=False)
        self.in_proj_b = LoRALinear(hidden_size, hv, bias=False)
        self.in_proj_a = LoRALinear(hidden_size, hv, bias=False)
        self.conv1d = nn.Conv1d(
            shape.conv_dim, shape.conv_dim, shape.conv_kernel, groups=shape.conv_dim, bias=False
        )
        self.dt_bias = nn.Parameter(torch.ones(hv))
        self.A_log = nn.Parameter(torch.zeros(hv))
        self.norm = GatedRMSNorm(shape.value_head_dim, eps)
        self.out_proj = LoRALinear(shape.value_dim, hidden_size, bias=False)
        self.in_proj = FusedLinears("in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a")

    def forward(
        self,
        x: torch.Tensor,
        adapters: AdapterBatch | None,
        real: torch.Tensor | None = None,
        state: LinearState | None = None,
        cuts: Cuts | None = None,
    ) -> tuple[torch.Tensor, LinearState]:
        """x [B, T, hidden]; `real` [B, T] bool (None: every position real); `state` the rows'
        state before x (None: zeros); `cuts` (row, t): where to take the state after row's first t
        tokens (a prefix cache's snapshots) -> (output, the state after each row's real tokens,
        with the cuts' states as its `snapshots`).

        The one place the rule's form is chosen: batch-invariant kernels on, `recurrent_rule`
        (every token the same operations, whatever the batch, the tokens' chunking or cached
        prefix: a decode step, a prefill chunk and the training forward compute the same bits);
        else one token per row runs `recurrent_rule` (or, fp32 on CPU with every row real, all of
        it after the input projections in C: `delta_rule.layer_step`), more run `chunked_rule`."""
        B, T, _ = x.shape
        sh = self.shape
        if state is None:
            state = LinearState.zeros(sh, B, x.device, x.dtype)
        if real is not None:
            x = x * real[..., None].to(x.dtype)  # the reference zeroes padded inputs
        qkv, z, b, a = self.in_proj(self, x, adapters)
        if T == 1 and real is None and not cuts and delta_rule.layer_suits(x, state, self):
            o, conv, recurrent = delta_rule.layer_step(self, qkv, z, b, a, state, L2_EPS)
            return self.out_proj(o, adapters), LinearState(conv, recurrent)
        lengths = None if real is None else real.sum(1)
        qkv, conv, conv_at = causal_conv(qkv, self.conv1d.weight, state.conv, lengths, cuts)
        q, k, v = qkv.split([sh.key_dim, sh.key_dim, sh.value_dim], -1)
        q = q.reshape(B, T, sh.num_key_heads, sh.key_head_dim)
        k = k.reshape(B, T, sh.num_key_heads, sh.key_head_dim)
        v = v.reshape(B, T, sh.num_value_heads, sh.value_head_dim)
        wide = invariant.wide_dtype(x.dtype)
        beta = invariant.sigmoid(invariant.widened(b))
        g = -self.A_log.to(wide).exp() * invariant.softplus(a.to(wide) + self.dt_bias.to(wide))
        if real is not None:  # padded positions: decay 1, no update
            beta, g = beta * real[..., None], g * real[..., None]
        rule = recurrent_rule if T == 1 or invariant.enabled() else chunked_rule
        o, recurrent, recurrent_at = rule(
            q, k, v, g, beta, state.recurrent, cuts=cuts, in_place=state.donated
        )
        o = self.norm(o, z.reshape(B, T, sh.num_value_heads, sh.value_head_dim))
        out = self.out_proj(o.reshape(B, T, sh.value_dim), adapters)
        snapshots = None if not cuts else LinearState(conv_at, recurrent_at)
        return out, LinearState(conv, recurrent, snapshots)
