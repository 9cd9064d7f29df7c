"""What a sample request asks about its own prompt, computed in the prefill that serves it: prompt
logprobs and their top-k, `prompt_alt_tokens_k` draws, and the logprobs of chosen target ids.

Entry i of the prompt logprobs is log p(prompt[i] | prompt[:i]), read from the hidden state of
position i - 1 (entry 0 is None: nothing precedes it). Row i of the draws and of the targets is
about prompt entry i + 1 (Tinker's `[len(prompt) - 1, k]` layout).

Invariants
- Every value is of the model's raw distribution (log-softmax at temperature 1), like token
  logprobs (sampling.py); draws are taken at the request's temperature (no top-k / top-p), with
  replacement, from a generator of their own, so they never change the request's samples.
- Entries at an image's positions (`SampleRequest.images`) are None, with their top-k: an image
  token is not a prediction of the text model.
- `first_scored(req)` is the first prompt entry anything is computed for. The prefix cache may serve
  every position before the one that predicts it (`cacheable`); entries before it are None (rows:
  empty). `prompt_logprobs_last_n` moves it for prompt logprobs and their top-k only; draws and
  targets keep theirs.
- Cached scores (`SampleRequest.reuse_prompt_scores`, the OpenAI plane's). A prompt block keyed in
  the prefix cache may carry the scores its computing request found for it (`BlockScores`: its
  entries' logprobs and top-k, and the hidden state of its last position, which predicts the next
  block's first entry). A request that reuses scores and asks for nothing but prompt logprobs and
  their top-k is served the KV of the longest cached prefix whose blocks carry scores with at least
  its top-k (`serves_scores`): those entries come from the cache, and the first entry it computes
  is read from the last served block's hidden state. The cache key is the weights and every token up
  to the block's end, all that entry i depends on; so a served entry is the value a fresh prefill
  computes, bit for bit under `--batch-invariant`.
"""

from __future__ import annotations

import secrets
from dataclasses import dataclass, field
from typing import Callable

import torch

from ..api import SampleRequest
from ..model.invariant import log_probs, widened
from .sampling import TopLogprobs, draw, sample_seed

LOGITS_CHUNK = 256  # prompt positions per lm_head call
_DRAWS_INDEX = 1 << 63  # the draws' generator: sample_seed(seed, index) with an index no sample has


def scores_prompt(req: SampleRequest) -> bool:
    """Whether the request computes anything at prompt positions (then prefill runs `extend`)."""
    return bool(
        req.prompt_logprobs
        or req.topk_prompt_logprobs
        or not req.generate
        or req.prompt_alt_tokens_k
        or req.target_prompt_ids
    )


def logprobs_from(req: SampleRequest) -> int:
    """The first entry of the prompt logprobs (and their top-k) that the request gets scored."""
    n = len(req.prompt)
    return n - req.prompt_logprobs_last_n if req.prompt_logprobs_last_n else 1


def first_scored(req: SampleRequest) -> int:
    """The first prompt entry anything is computed for; len(prompt) when only sampling (the last
    position's hidden state then gives the first sampled token)."""
    n = len(req.prompt)
    first = n
    if req.prompt_logprobs or req.topk_prompt_logprobs or not req.generate:
        first = min(first, logprobs_from(req))
    if req.prompt_alt_tokens_k:
        first = 1
    if req.target_prompt_ids:
        first = min(first, next((i + 1 for i, ids in enumerate(req.target_prompt_ids) if ids), n))
    return max(first, 1)


def cacheable(req: SampleRequest) -> int:
    """Prompt tokens whose KV the prefix cache may serve: those before the first position whose
    hidden state the request reads (0 when it scores its whole prompt), or, for a request that
    reuses cached scores, every full block of its prompt but the last token (as when sampling;
    `serves_scores` then keeps the blocks whose scores it can be served)."""
    if reads_cached_scores(req):
        return len(req.prompt) - 1
    return first_scored(req) - 1


def reads_cached_scores(req: SampleRequest) -> bool:
    """Whether the prefix cache may serve `req` the prompt scores of its blocks: it opted in and
    asks for nothing those do not hold (no draws, no target ids)."""
    return req.reuse_prompt_scores and not req.prompt_alt_tokens_k and not req.target_prompt_ids


@dataclass(frozen=True)
class BlockScores:
    """The prompt scores of one cached full block b of `block_size` tokens: entries b*bs..(b+1)*bs-1
    (entry 0 of block 0 is None), their top-`k` (None when k is 0) and the hidden state [H] of the
    block's last position."""

    logprobs: tuple[float | None, ...]
    topk: tuple[TopLogprobs | None, ...] | None
    k: int
    last_hidden: torch.Tensor


def serves_scores(req: SampleRequest, j: int, scores: BlockScores | None, block_size: int) -> bool:
    """Whether cached block j, carrying `scores`, may be served to `req` (which reads cached scores):
    a block whose last position predicts no scored entry needs none; a later one needs scores with at
    least the request's top-k."""
    if (j + 1) * block_size < first_scored(req):
        return True
    return scores is not None and scores.k >= req.topk_prompt_logprobs


@dataclass
class PromptScores:
    """A request's prompt scores so far, extended chunk by chunk as prefill computes positions."""

    logprobs: list[float | None] = field(default_factory=list)  # per entry
    topk: list[TopLogprobs | None] = field(default_factory=list)  # per entry
    alt_tokens: list[list[int]] = field(default_factory=list)  # per row
    alt_logprobs: list[list[float]] = field(default_factory=list)
    targets: list[list[float]] = field(default_factory=list)  # per row, one per target id
    gen: torch.Generator | None = None  # the draws'

    @classmethod
    def cached(cls, req: SampleRequest, blocks: list[BlockScores | None], block_size: int) -> "PromptScores":
        """The scores of the entries served from the cache with `blocks` (entries 0..len * bs - 1;
        None where a block carries none, which `serves_scores` allows only where nothing is read)."""
        k, out = req.topk_prompt_logprobs, cls()
        for b in blocks:
            if b is None:
                out.logprobs += [None] * block_size
                out.topk += [None] * block_size
            else:
                out.logprobs += b.logprobs
                out.topk += [t and t[:k] for t in b.topk] if k else [None] * block_size
        return out

    def block(
        self, b: int, block_size: int, req: SampleRequest, last_hidden: torch.Tensor
    ) -> BlockScores | None:
        """What block b holds of these scores, to keep with its KV: None unless every entry it holds
        was computed (entry 0 has none), with the top-k the request asked for."""
        lo, hi, k = b * block_size, (b + 1) * block_size, req.topk_prompt_logprobs
        first = max(lo, 1)
        if len(self.logprobs) < hi or None in self.logprobs[first:hi] or (k and None in self.topk[first:hi]):
            return None
        tops = tuple(self.topk[lo:hi]) if k else None
        return BlockScores(tuple(self.logprobs[lo:hi]), tops, k, last_hidden.detach().clone())

    @classmethod
    def of(cls, req: SampleRequest, start: int) -> "PromptScores":
        """Empty scores for a request whose first computed position is `start` (the ones before it
        came from the prefix cache: `start <= cacheable(req)`, so nothing is asked of them)."""
        gen = None
        if req.prompt_alt_tokens_k:
            seed = req.options.seed if req.options.seed is not None else secrets.randbits(63)
            gen = torch.Generator().manual_seed(sample_seed(seed, _DRAWS_INDEX))
        rows = [[] for _ in range(start)] if req.target_prompt_ids else []
        return cls([None] * (start + 1), [None] * (start + 1), targets=rows, gen=gen)

    def extend(
        self,
        req: SampleRequest,
        logits_of: Callable[[torch.Tensor], torch.Tensor],
        hidden: torch.Tensor,
        start: int,
    ) -> None:
        """Add the scores of the positions whose hidden states [1, T, H] start at `start`: entries
        start + 1 on (this object holds entries 0..start). `logits_of` maps hidden states to logits."""
        prompt, k, alt_k = req.prompt, req.topk_prompt_logprobs, req.prompt_alt_tokens_k
        stop = min(start + hidden.shape[1], len(prompt) - 1)  # the last position predicts no prompt token
        first = min(max(start, first_scored(req) - 1), stop)
        skipped = first - start  # positions before the first scored one: nothing computed
        self.logprobs += [None] * skipped
        self.topk += [None] * skipped
        self.targets += [[] for _ in range(skipped)] if req.target_prompt_ids else []
        for a in range(first, stop, LOGITS_CHUNK):
            b = min(a + LOGITS_CHUNK, stop)
            logits = widened(logits_of(hidden[:, a - start : b - start])[0])
            logp = log_probs(logits)
            nxt = torch.tensor(prompt[a + 1 : b + 1], device=logp.device)
            self.logprobs += logp.gather(1, nxt[:, None])[:, 0].tolist()
            if k:
                v, i = logp.topk(min(k, logp.shape[-1]), dim=-1)
                self.topk += [list(zip(ii, vv)) for ii, vv in zip(i.tolist(), v.tolist())]
            else:
                self.topk += [None] * (b - a)
            if alt_k:
                toks = self._draws(logits, req, alt_k)
                self.alt_tokens += toks.tolist()
                self.alt_logprobs += logp.gather(1, toks).tolist()
            if req.target_prompt_ids:
                self.targets += _gather_rows(logp, req.target_prompt_ids[a:b])

    def _draws(self, logits: torch.Tensor, req: SampleRequest, k: int) -> torch.Tensor:
        """k independent draws per row at the request's temperature (argmax when greedy): [rows, k]."""
        if req.options.greedy:
            return logits.argmax(-1, keepdim=True).expand(-1, k)
        u = torch.rand((logits.shape[0], k), generator=self.gen, dtype=torch.float64).to(logits.device)
        return draw(logits / req.options.temperature, u)

    def answer(self, req: SampleRequest) -> dict:
        """The SampleResult fields of these scores, as the request asked for them."""
        cut = logprobs_from(req)  # entries before it stay None even where draws or targets computed them
        lps = [None] * min(cut, len(self.logprobs)) + self.logprobs[cut:]
        tops = [None] * min(cut, len(self.topk)) + self.topk[cut:]
        for im in req.images:  # an image token is no text prediction: no logprob
            span = range(im.offset, min(im.offset + im.tokens, len(lps)))
            lps[span.start : span.stop] = [None] * len(span)
            tops[span.start : span.stop] = [None] * len(span)
        wants_lps = req.prompt_logprobs or not req.generate
        return dict(
            prompt_logprobs=lps if wants_lps else None,
            topk_prompt_logprobs=tops if req.topk_prompt_logprobs else None,
            prompt_alt_tokens=self.alt_tokens if req.prompt_alt_tokens_k else None,
            prompt_alt_logprobs=self.alt_logprobs if req.prompt_alt_tokens_k else None,
            target_prompt_logprobs=self.targets if req.target_prompt_ids else None,
        )


def _gather_rows(logp: torch.Tensor, rows: list[list[int]]) -> list[list[float]]:
    """logp[r, ids] for each row's own (possibly empty) list of ids."""
    width = max((len(ids) for ids in rows), default=0)
    if not width:
        return [[] for _ in rows]
    idx = torch.tensor([ids + [0] * (width - len(ids)) for ids in rows], device=logp.device)
    got = logp.gather(1, idx).tolist()
    return [g[: len(ids)] for g, ids in zip(got, rows)]


def check_prompt_scores(req: SampleRequest, vocab_size: int, max_width: int) -> None:
    """ValueError naming the field when a prompt-score option is out of range."""
    n = len(req.prompt)
    last_n = req.prompt_logprobs_last_n
    if last_n is not None:
        if not (req.prompt_logprobs or req.topk_prompt_logprobs or not req.generate):
            raise ValueError("prompt_logprobs_last_n: applies to prompt logprobs; ask for them too")
        if not 1 <= last_n <= n - 1:
            raise ValueError(
                f"prompt_logprobs_last_n: must be from 1 to len(prompt) - 1 = {n - 1}, got {last_n}"
            )
    if not 0 <= req.prompt_alt_tokens_k <= max_width:
        raise ValueError(f"prompt_alt_tokens_k: must be in [0, {max_width}], got {req.prompt_alt_tokens_k}")
    ids = req.target_prompt_ids
    if ids is not None:
        if len(ids) != n - 1:
            raise ValueError(f"target_prompt_logprobs: needs len(prompt) - 1 = {n - 1} rows, got {len(ids)}")
        if not any(ids):
            raise ValueError("target_prompt_logprobs: names no token id; give at least one")
        if max(len(r) for r in ids) > max_width:
            raise ValueError(f"target_prompt_logprobs: at most {max_width} ids per row")
        if any(not 0 <= t < vocab_size for r in ids for t in r):
            raise ValueError(f"target_prompt_logprobs: token ids must be in [0, {vocab_size}) (-1: none)")
