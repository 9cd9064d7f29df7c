"""How a benchmark prints its figures: one JSON object on stdout (`--json`), or one line per key."""

from __future__ import annotations

import json


def emit(out: dict, as_json: bool) -> None:
    if as_json:
        print(json.dumps(out))
        return
    for k, v in out.items():
        print(f"{k:28s} {v:.3f}" if isinstance(v, float) else f"{k:28s} {v}")
