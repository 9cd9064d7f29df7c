"""Prefix-cache diagnostics: spot sampling prompts built in ways that defeat the prefix cache.

The cache hits only on an exact token-level prefix. The seed names three practices that make it hit;
each has a detector here that fires when a prompt breaks it:

- "retokenized_history": the prompt's decoded text continues an earlier prompt + completion (up to
  whitespace), but its tokens diverge from those real tokens before their end: the history was
  rebuilt from text, so the tokenizer merged a reply's tokens differently or a reply's whitespace
  was trimmed. tokens_lost = real tokens after the divergence.
  Only earlier requests whose own prompt the new one repeats (to within RETOKENIZE_SLACK tokens) are
  decoded and compared, which keeps the check cheap when prompts are unrelated.
- "varying_head": the prompt shares a short head with an earlier prompt, diverges right after it, and
  then a much longer run of identical tokens follows (varying content placed before fixed content).
  tokens_lost = length of that identical run, which had to be prefilled again.
- "split_group": the prompt equals an earlier one-sample prompt token for token: one request with
  num_samples=N prefills it once. tokens_lost = the prompt tokens this request computed again;
  diverge_position = the prompt's length (the prompts never diverge).

At most one diagnostic per request (the first pattern in that order that fires). History is bounded:
the last `history` prompts per (api key, run), for the `max_runs` most recently active runs.
Thread-safe: the service may call `observe` from the engine's callback threads.
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict, deque
from dataclasses import dataclass, field
from typing import Callable

from ..prefixes import common_prefix
from .events import CacheDiagnostic

KGRAM = 8  # tokens that anchor a search for shared content after a divergence
RETOKENIZE_SLACK = 16  # re-tokenizing may merge this far back into the earlier prompt's tail


@dataclass
class _Seen:
    """One earlier request: its prompt and each completion's full real token sequence (prompt + completion),
    whose decoded texts (without whitespace) are filled in the first time a later prompt needs them."""

    prompt: list[int]
    reals: list[list[int]]
    single: bool  # sent with num_samples == 1
    texts: list[str | None] = field(default_factory=list)

    def text(self, i: int, decode: Callable[[list[int]], str]) -> str:
        if not self.texts:
            self.texts = [None] * len(self.reals)
        if self.texts[i] is None:
            self.texts[i] = _squash(decode(self.reals[i]))
        return self.texts[i]


class PrefixDiagnostics:
    def __init__(
        self, *, history: int = 16, max_runs: int = 1024, min_shared: int = 32, variation_window: int = 64
    ):
        """min_shared: the identical run after a varying head must be at least this long (and longer than
        twice everything before it) to count; variation_window: how far past the divergence to look for it."""
        self.history, self.max_runs = history, max_runs
        self.min_shared, self.window = min_shared, variation_window
        self._runs: OrderedDict[tuple[str, str], deque[_Seen]] = OrderedDict()
        self._lock = threading.Lock()

    def observe(
        self,
        api_key_id: str,
        session_id: str,
        run_id: str,
        base_model: str,
        request_id: str,
        prompt_tokens: list[int],
        cached_tokens: int,
        completion_tokens_list: list[list[int]],
        decode: Callable[[list[int]], str],
    ) -> list[CacheDiagnostic]:
        """Check one finished sampling request against this run's recent history, then remember it."""
        prompt = list(prompt_tokens)
        with self._lock:
            hist = self._runs.get((api_key_id, run_id))
            past = list(hist) if hist else []
        found = (
            self._retokenized(prompt, past, decode)
            or self._varying_head(prompt, cached_tokens, past)
            or self._split_group(prompt, cached_tokens, completion_tokens_list, past)
        )
        seen = _Seen(
            prompt,
            [prompt + list(c) for c in completion_tokens_list],
            single=len(completion_tokens_list) == 1,
        )
        with self._lock:
            hist = self._runs.pop((api_key_id, run_id), None) or deque(maxlen=self.history)
            hist.appendleft(seen)
            self._runs[(api_key_id, run_id)] = hist  # most recently active last
            while len(self._runs) > self.max_runs:
                self._runs.popitem(last=False)
        if found is None:
            return []
        pattern, pos, lost = found
        return [
            CacheDiagnostic(
                time=time.time(),
                api_key_id=api_key_id,
                session_id=session_id,
                run_id=run_id,
                base_model=base_model,
                pattern=pattern,
                diverge_position=pos,
                tokens_lost=lost,
                request_id=request_id,
            )
        ]

    def _retokenized(self, prompt, past, decode):
        text = None
        for s in past:  # most recent first: the latest request this prompt continues decides
            if common_prefix(prompt, s.prompt) < len(s.prompt) - RETOKENIZE_SLACK:
                continue  # not a continuation of this request: its own prompt is not even there
            if any(_extends(prompt, real) for real in s.reals):
                return None  # appended to real tokens: the cache-friendly way
            for i, real in enumerate(s.reals):
                if len(prompt) < 0.9 * len(real):
                    continue  # too short to hold that text: re-tokenizing merges only a few tokens
                real_text = s.text(i, decode)
                if not real_text:
                    continue
                if text is None:
                    text = _squash(decode(prompt))
                if text.startswith(real_text):
                    d = common_prefix(prompt, real)
                    return "retokenized_history", d, len(real) - d
        return None

    def _varying_head(self, prompt, cached, past):
        best = None
        for s in past:
            d = common_prefix(prompt, s.prompt)
            if d >= len(prompt) or d >= len(s.prompt) or cached > d:
                continue
            j, run = _shared_run(prompt, s.prompt, d, self.window)
            if run >= self.min_shared and run >= 2 * j and (best is None or run > best[2]):
                best = ("varying_head", d, run)
        return best

    def _split_group(self, prompt, cached, completions, past):
        if len(completions) != 1 or len(prompt) - cached <= 0:
            return None
        if any(s.single and s.prompt == prompt for s in past):
            return "split_group", len(prompt), len(prompt) - cached
        return None


def _squash(text: str) -> str:
    """The text without whitespace: a reply whose surrounding whitespace the client trimmed still
    reads as the same history."""
    return "".join(text.split())


def _extends(a: list[int], b: list[int]) -> bool:
    """a starts with b (checks the last token first: cheap when they differ)."""
    return len(a) >= len(b) and (not b or a[len(b) - 1] == b[-1]) and a[: len(b)] == b


def _shared_run(a: list[int], b: list[int], d: int, window: int) -> tuple[int, int]:
    """The longest run of identical tokens a[j:j+n] == b[j2:j2+n] starting within `window` tokens after the
    divergence d in both; returns (j, n), j being where it starts in `a`."""
    index: dict[tuple[int, ...], list[int]] = {}
    for j2 in range(d, min(len(b) - KGRAM, d + window) + 1):
        index.setdefault(tuple(b[j2 : j2 + KGRAM]), []).append(j2)
    best, covered = (0, 0), {}  # covered: diagonal j2 - j -> end of the run already measured on it
    for j in range(d, min(len(a) - KGRAM, d + window) + 1):
        for j2 in index.get(tuple(a[j : j + KGRAM]), ()):
            if covered.get(j2 - j, -1) > j:
                continue  # inside a run already measured: a shorter suffix of it
            n = KGRAM
            while j + n < len(a) and j2 + n < len(b) and a[j + n] == b[j2 + n]:
                n += 1
            covered[j2 - j] = j + n
            if n > best[1]:
                best = (j, n)
    return best
