"""How long a job takes on this machine, from throughput measured on it.

`trine estimate --measure` runs a short benchmark through an embedded server on this machine (the
same server, scheduler and engine a job uses; see `cli/measure.py`) and stores a `Throughput` in
`$TRINE_HOME/throughput.json`, one entry per model and decode batch. The prediction:

    prefill  = computed prompt tokens (after the prefix cache) / prefill tokens per second
    sample   = decode steps x seconds per decode step at the job's batch, where a step decodes one
               token of every sequence of a step at once (batch = prompts_per_step x group_size) and
               a trajectory has turns x completion_tokens of them
    train    = train tokens / forward_backward tokens per second + one optim_step per step

Phases are added, not overlapped: a loop that waits for its samples before training (GRPO, the
examples) takes about this long; a pipelined loop can take less. Invariants: the prediction is
never made from a measurement of another model, and it says which batch the step time was
measured at (the nearest one stored when the job's own batch was not measured).
"""

from __future__ import annotations

import json
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from .rates import model_key

FILE = "throughput.json"


@dataclass(frozen=True)
class Throughput:
    model: str
    batch: int  # sequences decoding together when decode_step_s was measured
    prefill_tokens_per_s: float
    decode_step_s: float  # one token for each of `batch` sequences
    train_tokens_per_s: float  # forward_backward positions per second
    optim_step_s: float
    threads: int  # torch threads of the engine that measured it
    device: str
    measured_at: float

    def to_dict(self) -> dict:
        return asdict(self)


@dataclass(frozen=True)
class WallClock:
    seconds: dict[str, float]  # prefill, sample, train, total
    throughput: Throughput

    def to_dict(self) -> dict:
        return {"seconds": dict(self.seconds), "throughput": self.throughput.to_dict()}


def predict(shape, tokens, tp: Throughput) -> WallClock:
    """Seconds by phase of a job (`shape`: a JobShape; `tokens`: its PhaseTokens with the cache)."""
    decode_steps = shape.steps * shape.turns * shape.completion_tokens
    optim_steps = shape.steps if shape.train_passes > 0 else 0
    s = {
        "prefill": tokens.prefill / tp.prefill_tokens_per_s,
        "sample": decode_steps * tp.decode_step_s,
        "train": tokens.train / tp.train_tokens_per_s + optim_steps * tp.optim_step_s,
    }
    s["total"] = sum(s.values())
    return WallClock(s, tp)


def load(home: Path, model: str, batch: int) -> Throughput | None:
    """The stored measurement of `model` at `batch`, else at the nearest batch measured; None if none."""
    path = Path(home) / FILE
    if not path.is_file():
        return None
    entries = [
        Throughput(**e) for e in json.loads(path.read_text()) if model_key(e["model"]) == model_key(model)
    ]
    return min(entries, key=lambda t: (abs(t.batch - batch), -t.measured_at), default=None)


def save(home: Path, tp: Throughput) -> Path:
    """Store `tp`, replacing an earlier measurement of the same model and batch."""
    path = Path(home) / FILE
    entries = json.loads(path.read_text()) if path.is_file() else []
    entries = [e for e in entries if (model_key(e["model"]), e["batch"]) != (model_key(tp.model), tp.batch)]
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(json.dumps([*entries, tp.to_dict()], indent=2) + "\n")
    tmp.replace(path)
    return path


def fmt_duration(seconds: float) -> str:
    """`0.4 s`, `42 s`, `3.5 min`, `2.1 h`."""
    if seconds < 10:
        return f"{seconds:.1f} s"
    if seconds < 120:
        return f"{seconds:.0f} s"
    if seconds < 7200:
        return f"{seconds / 60:.1f} min"
    return f"{seconds / 3600:.1f} h"


def describe(tp: Throughput) -> str:
    when = time.strftime("%Y-%m-%d %H:%M", time.localtime(tp.measured_at))
    return (
        f"measured on this machine {when} ({tp.device}, {tp.threads} thread(s)): prefill "
        f"{tp.prefill_tokens_per_s:,.0f} tokens/s, a decode step of {tp.batch} sequences "
        f"{1000 * tp.decode_step_s:,.0f} ms, training {tp.train_tokens_per_s:,.0f} tokens/s"
    )
