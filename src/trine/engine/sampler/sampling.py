"""Token sampling, seeds and logprobs: from logits to the next token of each sequence.

Invariants
- Each sequence draws from its own `torch.Generator`, seeded from (seed, sample index) by
  `sample_seed`, one uniform per sampled token, so a sample does not depend on the rest of the
  batch or on whether its prefix came from the cache. Without a seed the generators are seeded at
  random.
- A temperature below `GREEDY_BELOW_TEMPERATURE` is greedy (argmax), and draws no uniform.
- Token logprobs are log-softmax of the raw logits (temperature 1, before top-k / top-p / min-p):
  the model's own log-probability of the token, which importance-sampling losses compare against.
  Top logprobs and prompt logprobs (prompt_scores.py) are of the same distribution. Under a
  grammar (grammar.py) the logits arrive masked, so logprobs are of the distribution renormalised
  over the tokens the grammar allows: the one the token was drawn from.
- Penalties and biases (`adjusted`, vLLM's semantics) change a row's logits before anything else
  reads them, so its logprobs are of the penalised distribution, the one sampled (at temperature 1).
  They are computed per row from that sequence's own prompt and output only, and a row without
  them is left bit-for-bit as it was: a seeded sample is the same alone and batched.
"""

from __future__ import annotations

import math
import secrets
from collections.abc import Sequence

import torch
import torch.nn.functional as F

from ...limits import SAMPLING_BOUNDS, sampling_bound_error
from ..api import SamplingOptions
from ..model.invariant import log_probs, widened

_MASK64 = 2**64 - 1

TopLogprobs = list[tuple[int, float]]  # (token, logprob), most likely first
History = tuple[Sequence[int], Sequence[int]]  # a sequence's (prompt, generated tokens so far)


def _splitmix64(x: int) -> int:
    x = (x + 0x9E3779B97F4A7C15) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return x ^ (x >> 31)


def sample_seed(seed: int, index: int) -> int:
    """The generator seed of sample `index` of a request seeded with `seed` (stable everywhere)."""
    return _splitmix64(_splitmix64(seed & _MASK64) ^ index) >> 1


def generators(seed: int | None, n: int) -> list[torch.Generator]:
    """One generator per sample of a request; `seed` None draws a random one."""
    seed = seed if seed is not None else secrets.randbits(63)
    return [torch.Generator().manual_seed(sample_seed(seed, j)) for j in range(n)]


def sample(
    logits: torch.Tensor,
    options: list[SamplingOptions],
    gens: list[torch.Generator],
    histories: list[History] | None = None,
) -> tuple[list[int], list[float], list[TopLogprobs | None]]:
    """One token per row of `logits` [B, V] under its row's options: (tokens, their logprobs, each
    row's top-logprobs list, or None where its options ask for none). `histories` (one per row) are
    what penalties count; None: no history (a first token, or rows without penalties)."""
    logits = adjusted(widened(logits), options, histories)
    logp = log_probs(logits)
    greedy = [o.greedy for o in options]
    if all(greedy):
        tok = logits.argmax(-1)
    else:
        x = _filtered(logits, options, greedy)
        u = torch.tensor(
            [float(torch.rand((), generator=g)) if not gr else 0.0 for g, gr in zip(gens, greedy)],
            dtype=torch.float64,
            device=x.device,
        )
        tok = draw(x, u[:, None])[:, 0]
        if any(greedy):
            tok = torch.where(torch.tensor(greedy, device=x.device), logits.argmax(-1), tok)
    lp = logp.gather(1, tok[:, None])[:, 0]
    ks = [o.top_logprobs for o in options]
    tops: list[TopLogprobs | None] = [None] * len(options)
    if any(ks):
        v, i = logp.topk(max(ks), dim=-1)
        v, i = v.tolist(), i.tolist()
        tops = [list(zip(i[b][:k], v[b][:k])) if k else None for b, k in enumerate(ks)]
    return tok.tolist(), lp.tolist(), tops


def adjusted(
    logits: torch.Tensor, options: list[SamplingOptions], histories: list[History] | None = None
) -> torch.Tensor:
    """`logits` [B, V] (float) with each row's logit bias, then its penalties, as vLLM applies them:
    repetition (tokens of the prompt or the output: logit / p where positive, logit * p otherwise),
    then frequency (minus penalty x times generated) and presence (minus penalty if generated).
    Rows whose options adjust nothing are returned untouched (the same tensor when none do)."""
    rows = [b for b, o in enumerate(options) if o.adjusts_logits]
    if not rows:
        return logits
    x, dev, vocab = logits.clone(), logits.device, logits.shape[-1]
    for b in rows:
        o, row = options[b], x[b]
        prompt, out = histories[b] if histories is not None else ((), ())
        if o.logit_bias:
            ids = torch.tensor([t for t, _ in o.logit_bias], device=dev)
            row.index_add_(0, ids, torch.tensor([v for _, v in o.logit_bias], device=dev, dtype=row.dtype))
        counts = torch.bincount(torch.tensor(list(out), dtype=torch.long, device=dev), minlength=vocab)
        if o.repetition_penalty != 1:
            seen = counts > 0
            if len(prompt):
                seen[torch.tensor(list(prompt), dtype=torch.long, device=dev)] = True
            p = o.repetition_penalty
            row.copy_(torch.where(seen, torch.where(row > 0, row / p, row * p), row))
        if o.frequency_penalty:
            row.sub_(o.frequency_penalty * counts.to(row.dtype))
        if o.presence_penalty:
            row.sub_(o.presence_penalty * (counts > 0).to(row.dtype))
    return x


def _filtered(logits: torch.Tensor, options: list[SamplingOptions], greedy: list[bool]) -> torch.Tensor:
    """Logits divided by each row's temperature, -inf below its min-p and outside its top-k and
    top-p."""
    temps = [1.0 if g else o.temperature for o, g in zip(options, greedy)]
    x = (
        logits
        if all(t == 1.0 for t in temps)
        else logits / torch.tensor(temps, device=logits.device)[:, None]
    )
    if any(o.min_p > 0 for o in options):  # p / p_max >= min_p, in logits: x - x_max >= log(min_p)
        log_min_p = torch.tensor([o.min_p for o in options], device=x.device).log()[:, None]
        x = x.masked_fill(x < x.max(-1, keepdim=True).values + log_min_p, -math.inf)
    ks = [o.top_k if o.top_k > 0 else 0 for o in options]
    if any(ks):
        kmax = min(max(ks), x.shape[-1])
        top = x.topk(kmax, dim=-1).values
        idx = torch.tensor([min(k, kmax) - 1 if k else kmax - 1 for k in ks], device=x.device)
        thr = top.gather(1, idx[:, None])
        thr = torch.where(torch.tensor(ks, device=x.device)[:, None] > 0, thr, -math.inf)
        x = x.masked_fill(x < thr, -math.inf)
    if any(o.top_p < 1 for o in options):
        top_p = torch.tensor([o.top_p if o.top_p < 1 else math.inf for o in options], device=x.device)[
            :, None
        ]
        sx, si = x.sort(dim=-1, descending=True)
        sp = sx.softmax(-1)
        drop = (sp.cumsum(-1) - sp) > top_p  # keep the smallest prefix reaching top_p
        x = x.masked_fill(torch.zeros_like(drop).scatter(1, si, drop), -math.inf)
    return x


CDF_BLOCK = 256  # vocabulary entries per block of the two-level inverse CDF


def draw(x: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """Tokens drawn from softmax(x) of each row of `x` [B, V] by inverse CDF, one per uniform of
    `u` [B, m] (float64 in [0, 1)): [B, m]. Never a token of probability 0.

    The CDF is searched in two levels, the blocks' cumulative sums and then one block's: a
    cumulative sum runs element after element, and over the whole vocabulary (49152 doubles a row)
    it was the sampler's slowest op."""
    p = x.softmax(-1)
    B, V = p.shape
    if V % CDF_BLOCK:
        p = F.pad(p, (0, CDF_BLOCK - V % CDF_BLOCK))
    blocks = p.view(B, -1, CDF_BLOCK)  # sums in float64 of the float32 probabilities
    ends = blocks.sum(-1, dtype=torch.float64).cumsum(-1)  # [B, nb]: the CDF at each block's end
    target = u * ends[:, -1:]
    b = torch.searchsorted(ends, target, right=True).clamp(max=ends.shape[1] - 1)  # [B, m]
    before = torch.where(b > 0, ends.gather(1, (b - 1).clamp(min=0)), 0.0)
    inner = blocks.gather(1, b[..., None].expand(-1, -1, CDF_BLOCK)).double()  # [B, m, CDF_BLOCK]
    j = torch.searchsorted(inner.cumsum(-1), (target - before)[..., None], right=True)[..., 0]
    # rounding may put the target past the block's own sum: take its last token of probability > 0
    last = (inner > 0).long().mul(torch.arange(1, CDF_BLOCK + 1, device=p.device)).argmax(-1)
    return b * CDF_BLOCK + torch.minimum(j, last)


def check_sampling_options(options: SamplingOptions, vocab_size: int) -> None:
    """ValueError naming the field when a sampling option is out of range (limits.SAMPLING_BOUNDS)."""
    if not 0 <= options.top_logprobs <= vocab_size:
        raise ValueError(f"top_logprobs: must be in [0, {vocab_size}], got {options.top_logprobs}")
    for name in SAMPLING_BOUNDS:
        if (error := sampling_bound_error(name, getattr(options, name))) is not None:
            raise ValueError(f"{name}: {error}")
    ids = [t for t, _ in options.logit_bias]
    if len(set(ids)) != len(ids) or any(not 0 <= t < vocab_size for t in ids):
        raise ValueError(f"logit_bias: token ids must be distinct and in [0, {vocab_size})")
    if any(not math.isfinite(v) for _, v in options.logit_bias):
        raise ValueError("logit_bias: biases must be finite numbers")
