"""Whether the service takes new work: not while it drains for shutdown, nor with too little disk.

Invariants
- Work that will write (a training event, a sample's stored outcome, a checkpoint) is refused
  before anything is written when fewer than `reserve_bytes` are free where it would write:
  `DiskFull` (507 `disk_full`), naming the path and its free bytes.
- Once `draining`, new work is refused with `ShuttingDown` (503 `server_shutting_down`,
  Retry-After); what was accepted before keeps running until the drain's deadline (core.py).
"""

from __future__ import annotations

import math
import time
from pathlib import Path

from ..diskspace import DEFAULT_RESERVE_BYTES, free_bytes, require
from .errors import ShuttingDown

RESTART_SECONDS = 30  # about how long a restart takes: added to a refusal's Retry-After


class WorkGate:
    def __init__(self, *, data_dir: Path, checkpoint_dir: Path, reserve_bytes: int = DEFAULT_RESERVE_BYTES):
        self.data_dir = data_dir
        self.checkpoint_dir = checkpoint_dir
        self.reserve_bytes = reserve_bytes
        self.draining = False
        self._drain_ends = 0.0  # time.monotonic() at the drain's deadline

    def drain(self, seconds: float) -> None:
        self.draining = True
        self._drain_ends = time.monotonic() + seconds

    def admit(self, what: str, *, checkpoint: bool = False) -> None:
        """Raise unless `what` (new work) may start; `checkpoint`: it writes a checkpoint."""
        if self.draining:
            left = max(0.0, self._drain_ends - time.monotonic())
            raise ShuttingDown(
                f"{what}: the server is shutting down and takes no new work; send it again "
                "once it has restarted",
                retry_after=math.ceil(left) + RESTART_SECONDS,
            )
        require(self.data_dir, self.reserve_bytes, what)
        if checkpoint:
            require(self.checkpoint_dir, self.reserve_bytes, what)

    def free_space(self) -> dict[str, int]:
        """Free bytes where the service writes: the data dir (database) and the checkpoints."""
        return {"data_dir": free_bytes(self.data_dir), "checkpoint_dir": free_bytes(self.checkpoint_dir)}
