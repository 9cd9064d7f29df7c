"""Constrained decoding: a request's grammar (`SamplingOptions.grammar`) limits each of its samples
to the tokens that keep the generated text inside the grammar's language.

The grammar is plain data in llguidance's format (what `llguidance.LLMatcher.grammar_from_lark` /
`grammar_from_json_schema` return; the service builds it, see service/grammars.py); the matching
itself is llguidance's, on the tokenizer the sampler owns.

Invariants
- The tokenizer's token table is built once per sampler, on the first constrained request; a
  request's grammar is compiled once, when it is added (a bad grammar is a ValueError naming
  `grammar`), and each of its samples advances its own copy by every token it samples.
- Tokens the grammar forbids get logit -inf before sampling, so a constrained sample's logprobs
  and top logprobs are of the masked distribution (renormalised over the allowed tokens): the
  distribution its token was drawn from.
- A complete grammar allows only the end-of-sequence tokens, so a constrained sample ends with EOS
  (or at max_tokens, or a stop string) like any other: constrained requests must stop at EOS.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np
import torch

from ..model.tokenizer import Tokenizer

if TYPE_CHECKING:
    import llguidance

    from .sequence import Sequence


class Grammars:
    """Compiles the grammars of one sampler's requests and masks its constrained rows."""

    def __init__(self, tokenizer: Tokenizer, vocab_size: int, eos_ids: frozenset[int]):
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.eos_ids = sorted(eos_ids)
        self._table: "llguidance.LLTokenizer | None" = None
        self._executor: "llguidance.LLExecutor | None" = None

    def compile(self, grammar: str) -> "llguidance.LLMatcher":
        """The matcher of `grammar` at its start. ValueError naming `grammar` if it does not compile."""
        import llguidance

        m = llguidance.LLMatcher(self._tokens(), grammar, log_level=0)
        if m.is_error():
            raise ValueError(f"grammar: {m.get_error()}")
        return m

    def mask(self, seqs: list["Sequence"], logits: torch.Tensor) -> torch.Tensor:
        """`logits` [B, V] (row i is seqs[i]'s) with -inf on every token a constrained row's
        grammar forbids; unconstrained rows are unchanged. A row left with no token (its matcher
        broke, e.g. on a parser limit) allows only EOS, so it ends instead of sampling from nothing."""
        rows = [i for i, s in enumerate(seqs) if s.matcher is not None]
        if not rows:
            return logits
        from llguidance.numpy import fill_next_token_bitmask_par

        # one bit per token (bit t % 32 of little-endian word t // 32); unconstrained rows allow all
        bitmask = np.full((len(seqs), (self._tokens().vocab_size + 31) // 32), -1, dtype=np.int32)
        bitmask[rows] = 0
        live = [(seqs[i].matcher, i) for i in rows if not seqs[i].matcher.is_error()]
        if live:
            fill_next_token_bitmask_par(self._exec(), live, bitmask)
        vocab = logits.shape[-1]
        bits = np.unpackbits(bitmask.view(np.uint8), axis=1, bitorder="little")[:, :vocab]
        stuck = ~bits.any(axis=1)
        if stuck.any():
            bits[np.ix_(stuck, [t for t in self.eos_ids if t < vocab])] = 1
        allowed = torch.from_numpy(bits).to(logits.device, dtype=torch.bool)
        return logits.masked_fill(~allowed, float("-inf"))

    @staticmethod
    def advance(seq: "Sequence", token: int) -> None:
        """Feed the sampled `token` to the sequence's matcher (no-op when unconstrained)."""
        if seq.matcher is not None and not seq.matcher.is_error():
            seq.matcher.consume_token(token)

    def _tokens(self) -> "llguidance.LLTokenizer":
        if self._table is None:
            import llguidance

            self._table = llguidance.LLTokenizer(
                self.tokenizer.to_json(),
                n_vocab=max(self.vocab_size, self.tokenizer.vocab_size),
                eos_token=self.eos_ids,
            )
        return self._table

    def _exec(self) -> "llguidance.LLExecutor":
        if self._executor is None:
            import llguidance

            self._executor = llguidance.LLExecutor()
        return self._executor
