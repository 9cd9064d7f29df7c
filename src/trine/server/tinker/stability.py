"""Sampling-side records that `stable_reinforce` trains against ("stability info").

When a sampler is asked to record (Tinker's `record_stability_info=True`), every sampled sequence
is kept under its sequence id: the tokens it produced and their logprobs under the exact weights
and numerics of the sampler. A training request names those tokens by provenance spans; the
trainer then uses the recorded logprobs as the behaviour policy instead of values the client sends.

Invariants
- A record belongs to one API key; another key asking for it gets "unknown sequence".
- A record lives `ttl` seconds after it was sampled or last used by a training request, and at
  most `max_records` are kept (least recently used dropped first). Records are in memory only:
  a restart forgets them (the training request then fails with a message saying so).
"""

from __future__ import annotations

import time
from collections import OrderedDict
from dataclasses import dataclass


@dataclass
class SequenceRecord:
    api_key_id: str
    tokens: list[int]
    logprobs: list[float]
    expires_at: float


class StabilityRecords:
    def __init__(self, ttl: float = 86400.0, max_records: int = 200_000):
        self.ttl = ttl
        self.max_records = max_records
        self._records: OrderedDict[str, SequenceRecord] = OrderedDict()

    def __len__(self) -> int:
        return len(self._records)

    def record(self, api_key_id: str, sequence_id: str, tokens: list[int], logprobs: list[float]) -> None:
        self._records[sequence_id] = SequenceRecord(
            api_key_id, list(tokens), list(logprobs), time.time() + self.ttl
        )
        self._records.move_to_end(sequence_id)
        while len(self._records) > self.max_records:
            self._records.popitem(last=False)

    def sampled_logprobs(
        self, api_key_id: str, sequence_id: str, offset: int, length: int, targets: list[int], where: str
    ) -> list[float]:
        """The recorded logprobs of sampled tokens [offset, offset + length) of `sequence_id`,
        after checking that `targets` are those very tokens; restarts the record's lifetime."""
        rec = self._records.get(sequence_id)
        now = time.time()
        if rec is None or rec.api_key_id != api_key_id or rec.expires_at < now:
            raise ValueError(
                f"{where}: sequence {sequence_id!r} has no stability record (it was not sampled "
                "with record_stability_info=True by this key, it expired after a day "
                "unused, or the server restarted); sample again with record_stability_info"
            )
        if offset + length > len(rec.tokens):
            raise ValueError(
                f"{where}: positions [{offset}, {offset + length}) are past the "
                f"{len(rec.tokens)} sampled tokens of sequence {sequence_id!r}"
            )
        if list(targets) != rec.tokens[offset : offset + length]:
            raise ValueError(
                f"{where}: the target tokens differ from the tokens sequence {sequence_id!r} "
                f"sampled at [{offset}, {offset + length})"
            )
        rec.expires_at = now + self.ttl
        self._records.move_to_end(sequence_id)
        return rec.logprobs[offset : offset + length]
