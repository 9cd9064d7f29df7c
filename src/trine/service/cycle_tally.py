"""Running totals of one replica's clock cycles, for the operator's `/metrics`: how many ran, how
long each took and how many training tokens each computed, as cumulative histograms.

Invariants
- Totals only grow (a Prometheus counter's contract); a restart of the server starts them at 0.
- `buckets` are upper bounds in increasing order; `counts[i]` is how many observations were
  <= `buckets[i]` (cumulative, as Prometheus histograms are); `count` includes those above the
  last bound (the `+Inf` bucket).
"""

from __future__ import annotations

from bisect import bisect_left
from dataclasses import dataclass, field

# a cycle takes from a few milliseconds (an optim step alone) to minutes (a large batch on a CPU)
SECONDS_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0)
TOKENS_BUCKETS = (0, 64, 256, 1024, 4096, 16384, 65536, 262144)


@dataclass
class Tally:
    """A cumulative histogram of non-negative observations."""

    buckets: tuple[float, ...]
    counts: list[int] = field(default_factory=list)
    count: int = 0
    sum: float = 0.0

    def __post_init__(self):
        self.counts = [0] * len(self.buckets)

    def observe(self, value: float) -> None:
        for i in range(bisect_left(self.buckets, value), len(self.buckets)):
            self.counts[i] += 1
        self.count += 1
        self.sum += value


@dataclass
class CycleTally:
    """One replica's cycles: their duration (engine seconds) and the training tokens they computed."""

    seconds: Tally = field(default_factory=lambda: Tally(SECONDS_BUCKETS))
    tokens: Tally = field(default_factory=lambda: Tally(TOKENS_BUCKETS))

    def observe(self, seconds: float, tokens: int) -> None:
        self.seconds.observe(max(0.0, seconds))
        self.tokens.observe(max(0, tokens))
