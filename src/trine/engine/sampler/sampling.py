"""Token sampling, seeds and logprobs: from logits to the next token of each sequence.

Invariants
- Each sequence draws from its own `torch.Generator`, seeded from (seed, sample index) by
  `sample_seed`, one uniform per sampled token, so a sample does not depend on the rest of the
  batch or on whether its prefix came from the cache. Without a seed the generators are seeded at
  random.
- A temperature below `GREEDY_BELOW_TEMPERATURE` is greedy (argmax), and draws no uniform.
- Token logprobs are log-softmax of the raw logits (temperature 1, before top-k / top-p): the
  model's own log-probability of the token, which importance-sampling losses compare against.
  Top logprobs and prompt logprobs (prompt_scores.py) are of the same distribution. Under a
  grammar (grammar.py) the logits arrive masked, so logprobs are of the distribution renormalised
  over the tokens the grammar allows: the one the token was drawn from.
"""

from __future__ import annotations

import math
import secrets

import torch

from ..api import SamplingOptions
from ..model.invariant import log_probs

_MASK64 = 2**64 - 1

TopLogprobs = list[tuple[int, float]]  # (token, logprob), most likely first


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
    logits: torch.Tensor, options: list[SamplingOptions], gens: list[torch.Generator]
) -> tuple[list[int], list[float], list[TopLogprobs | None]]:
    """One token per row of `logits` [B, V] under its row's options: (tokens, their logprobs, each
    row's top-logprobs list, or None where its options ask for none)."""
    logits = logits.float()
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


def _filtered(logits: torch.Tensor, options: list[SamplingOptions], greedy: list[bool]) -> torch.Tensor:
    """Logits divided by each row's temperature, -inf outside its top-k and top-p."""
    temps = [1.0 if g else o.temperature for o, g in zip(options, greedy)]
    x = (
        logits
        if all(t == 1.0 for t in temps)
        else logits / torch.tensor(temps, device=logits.device)[:, None]
    )
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


def draw(x: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """Tokens drawn from softmax(x) of each row of `x` [B, V] by inverse CDF, one per uniform of
    `u` [B, m] (float64 in [0, 1)): [B, m]."""
    cdf = x.softmax(-1).double().cumsum(-1)
    tok = torch.searchsorted(cdf, u * cdf[:, -1:], right=True)
    return tok.clamp(max=x.shape[-1] - 1)


def check_sampling_options(options: SamplingOptions, vocab_size: int) -> None:
    """ValueError naming the field when a sampling option is out of range."""
    if not (math.isfinite(options.temperature) and options.temperature >= 0):
        raise ValueError(f"temperature: must be a finite number >= 0, got {options.temperature}")
    if not (0 < options.top_p <= 1):
        raise ValueError(f"top_p: must be in (0, 1], got {options.top_p}")
    if options.top_k < -1:
        raise ValueError(f"top_k: must be -1 (off) or >= 1, got {options.top_k}")
    if not 0 <= options.top_logprobs <= vocab_size:
        raise ValueError(f"top_logprobs: must be in [0, {vocab_size}], got {options.top_logprobs}")
