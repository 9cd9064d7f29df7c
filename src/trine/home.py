"""The data dir: `--home DIR`, else `$TRINE_HOME`, else `~/.trine`. One definition for every part."""

from __future__ import annotations

import os
from pathlib import Path


def trine_home(home: str | Path | None = None) -> Path:
    return Path(home or os.environ.get("TRINE_HOME") or Path.home() / ".trine").expanduser()
