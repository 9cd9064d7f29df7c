"""When a sampled sequence stops, and its final text.

A sequence stops on the first of: a stop token (EOS unless `stop_at_eos` is off, or one of
`stop_token_ids`), a stop string completed by the newest token, or `max_tokens` tokens.

Invariants
- The returned tokens include the token that stopped the sequence; the text excludes a stop token
  and is cut before the earliest stop string in it.
- Stop strings are found on the decoded text, so a stop string spanning token boundaries is found.
  Each token decodes only a window of recent tokens (wide enough for the longest stop string);
  the whole text is decoded once, when a stop string is seen, to cut it.
"""

from __future__ import annotations

from dataclasses import dataclass

from ...limits import check_stops
from ..api import SamplingOptions
from ..model.tokenizer import Tokenizer


@dataclass(frozen=True)
class Stops:
    token_ids: frozenset[int]  # the request's stop tokens, plus EOS when it stops at EOS
    strings: tuple[str, ...]
    max_tokens: int

    @classmethod
    def of(cls, options: SamplingOptions, eos_ids: frozenset[int]) -> "Stops":
        ids = frozenset(options.stop_token_ids) | (eos_ids if options.stop_at_eos else frozenset())
        return cls(ids, tuple(options.stop_strings), options.max_tokens)

    def check(self, out: list[int], tokenizer: Tokenizer) -> tuple[str | None, str | None]:
        """After the newest token of `out`: (stop reason or None, the text when a stop string cut
        it, else None)."""
        if out[-1] in self.token_ids:
            return "stop", None
        if self.strings:
            text = self._cut_at_stop_string(out, tokenizer)
            if text is not None:
                return "stop", text
        if len(out) >= self.max_tokens:
            return "length", None
        return None, None

    def _cut_at_stop_string(self, out: list[int], tokenizer: Tokenizer) -> str | None:
        window = 2 * max(len(x) for x in self.strings) + 8
        if not any(x in tokenizer.decode(out[-window:]) for x in self.strings):
            return None
        text = tokenizer.decode(out)
        hits = [i for i in (text.find(x) for x in self.strings) if i >= 0]
        return text[: min(hits)] if hits else None


def final_text(out: list[int], stop_reason: str | None, tokenizer: Tokenizer) -> str:
    """The text of a sequence that did not stop on a stop string: without a stop token."""
    return tokenizer.decode(out[:-1] if stop_reason == "stop" else out)


def check_stop_options(options: SamplingOptions, vocab_size: int) -> None:
    """ValueError naming the field when a stop list is malformed or too long."""
    if any(not isinstance(t, int) or not 0 <= t < vocab_size for t in options.stop_token_ids):
        raise ValueError(f"stop_token_ids: must be ints in [0, {vocab_size})")
    if any(not isinstance(s, str) or not s for s in options.stop_strings):
        raise ValueError("stop_strings: must be non-empty strings")
    check_stops(options.stop_strings, options.stop_token_ids)
