"""One definition of every limit and name that several layers check (SDK, front ends, service,
engine). Plain constants and checks that raise ValueError naming the field and the fix; no imports
from the rest of trine, so every layer can use them.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass

# ---------------------------------------------------------------------------- LoRA
LORA_RANK_MIN, LORA_RANK_MAX = 1, 256


# rank 0 asks for full-parameter fine-tuning (the Tinker convention SkyRL's backend follows): the run
# trains the model's own weights, not an adapter (engine/trainer/full.py)
FULL_RANK = 0
MAX_TRAINABLE_TOKENS = 4096  # `trainable_token_indices` of a full fine-tuning run


def check_lora_rank(rank, field: str = "lora_rank", *, full: bool = False) -> int:
    """A LoRA rank in range; with `full`, also 0 (full-parameter fine-tuning)."""
    if full and rank == FULL_RANK and not isinstance(rank, bool):
        return rank
    if isinstance(rank, bool) or not isinstance(rank, int) or not LORA_RANK_MIN <= rank <= LORA_RANK_MAX:
        also = f" (or {FULL_RANK} for full-parameter fine-tuning)" if full else ""
        raise ValueError(f"{field} {rank!r}: use an integer from {LORA_RANK_MIN} to {LORA_RANK_MAX}{also}")
    return rank


def check_token_indices(indices, vocab_size: int, field: str = "trainable_token_indices") -> tuple[int, ...]:
    """The embedding rows a full fine-tuning run trains: distinct token ids below `vocab_size`, at most
    MAX_TRAINABLE_TOKENS of them; returned sorted."""
    if not isinstance(indices, (list, tuple)) or any(
        isinstance(i, bool) or not isinstance(i, int) for i in indices
    ):
        raise ValueError(f"{field}: send a list of token ids (integers), got {indices!r}")
    if len(indices) > MAX_TRAINABLE_TOKENS:
        raise ValueError(f"{field}: {len(indices)} ids; at most {MAX_TRAINABLE_TOKENS} are allowed")
    bad = [i for i in indices if not 0 <= i < vocab_size]
    if bad:
        raise ValueError(f"{field}: token id {bad[0]} is outside the vocabulary [0, {vocab_size})")
    if len(set(indices)) != len(indices):
        raise ValueError(f"{field}: token ids repeat; name each at most once")
    return tuple(sorted(indices))


# ---------------------------------------------------------------------------- training events
INIT_RUN = "trainer.init_run"
FORWARD = "trainer.forward"
FORWARD_BACKWARD = "trainer.forward_backward"
OPTIMIZE_STEP = "trainer.optimize_step"
SAVE_STATE = "trainer.save_state"
SAVE_WEIGHTS = "trainer.save_weights"
END_RUN = "trainer.end_run"
EVENT_TYPES = (INIT_RUN, FORWARD, FORWARD_BACKWARD, OPTIMIZE_STEP, SAVE_STATE, SAVE_WEIGHTS, END_RUN)
# Not a wire type: a front end whose client has already numbered a request it then refused (Tinker's
# seq_ids) queues this in its place, so later indexes still run; it fails with the refusal.
REFUSED = "trine.refused"
MAX_WAITING_EVENTS_PER_RUN = 64  # accepted, not yet executed

# ---------------------------------------------------------------------------- checkpoints
CHECKPOINT_NAME = re.compile(r"^[A-Za-z0-9](?:[A-Za-z0-9._-]*[A-Za-z0-9_-])?$")
CHECKPOINT_NAME_MAX = 200
CHECKPOINT_VISIBILITIES = ("WORKSPACE", "TEMPORARY")
TEMPORARY_CHECKPOINT_TTL_SECONDS = 6 * 3600


def check_checkpoint_name(name, field: str = "name") -> str:
    if not isinstance(name, str) or len(name) > CHECKPOINT_NAME_MAX or not CHECKPOINT_NAME.match(name):
        raise ValueError(
            f"{field} {name!r}: use 1-{CHECKPOINT_NAME_MAX} letters, digits, '.', '_' or "
            "'-', starting with a letter or digit"
        )
    return name


# ---------------------------------------------------------------------------- sampling
MAX_SAMPLES_PER_REQUEST = 256
MAX_TOPK_PROMPT_LOGPROBS = 64
MAX_REQUEST_ID_CHARS = 200


MAX_STOP_STRINGS = 64  # every decode step checks them: bounded count and length
MAX_STOP_STRING_CHARS = 256
MAX_STOP_TOKEN_IDS = 256
GREEDY_BELOW_TEMPERATURE = 1e-5  # a smaller temperature samples as temperature 0 (argmax)


def check_stops(stop_strings, stop_token_ids) -> None:
    """Stop lists are bounded (every decode step checks them): ValueError naming the limit."""
    if len(stop_strings) > MAX_STOP_STRINGS:
        raise ValueError(f"stop: {len(stop_strings)} stop strings; at most {MAX_STOP_STRINGS} are allowed")
    longest = max((len(s) for s in stop_strings if isinstance(s, str)), default=0)
    if longest > MAX_STOP_STRING_CHARS:
        raise ValueError(
            f"stop: a stop string has {longest} characters; at most {MAX_STOP_STRING_CHARS} are allowed"
        )
    if len(stop_token_ids) > MAX_STOP_TOKEN_IDS:
        raise ValueError(
            f"stop_token_ids: {len(stop_token_ids)} ids; at most {MAX_STOP_TOKEN_IDS} are allowed"
        )


def check_prompt_length(prompt_tokens: int, max_tokens: int, context: int, model: str) -> None:
    """A prompt plus the tokens to generate must fit the model's context."""
    if prompt_tokens < 1:
        raise ValueError("prompt: send at least one token")
    total = prompt_tokens + max_tokens
    if total > context:
        raise ValueError(
            f"prompt ({prompt_tokens} tokens) + max_tokens ({max_tokens}) = {total} "
            f"exceeds {model}'s context of {context} tokens"
        )


# ---------------------------------------------------------------------------- images
# An image's decoded size (width x height, before the processor resizes it), read from its header
# before any pixel is decoded: trine's own bound, so a small file that declares a huge canvas (a
# decompression bomb) is refused without being decoded, whatever Pillow's global MAX_IMAGE_PIXELS is.
# 4096 x 4096: the largest image Qwen3.5's processor keeps at full resolution (its max_pixels).
MAX_IMAGE_PIXELS = 4096 * 4096
MAX_IMAGES_PER_INPUT = 16  # images in one model input: a prompt, a datum, a chat's messages
MAX_IMAGE_ASPECT_RATIO = 200  # the longer side over the shorter: Qwen's image processor refuses more


# ---------------------------------------------------------------------------- request bodies
MAX_EVENT_BYTES = 64 << 20
MAX_SAMPLE_BYTES = 16 << 20
MAX_CONTROL_BYTES = 1 << 20
MAX_BODY_BYTES = MAX_EVENT_BYTES  # any route without a smaller limit of its own
MAX_ADAPTER_UPLOAD_BYTES = 1 << 30  # a PEFT adapter uploaded for import (a tar of its two files)
BODY_IDLE_SECONDS = 30.0  # a request body that sends nothing for this long gets a 408

# ---------------------------------------------------------------------------- wire numbers
INT64_MAX = 2**63 - 1  # indexes, steps, seeds, offsets, limits: what SQLite and torch hold
MAX_PAGE_SIZE = 1000  # `limit` of every list route
MAX_TTL_SECONDS = 100 * 365 * 86400  # a checkpoint's time to live: at most a century


def check_ttl_seconds(ttl, field: str = "ttl_seconds"):
    """A checkpoint's time to live: None (never expires) or whole seconds up to a century."""
    if ttl is not None and (
        isinstance(ttl, bool) or not isinstance(ttl, int) or not 1 <= ttl <= MAX_TTL_SECONDS
    ):
        raise ValueError(
            f"{field} {ttl!r}: use 1 to {MAX_TTL_SECONDS} seconds (100 years), or none to never expire"
        )
    return ttl


# ---------------------------------------------------------------------------- optimizer
# AdamParams field -> (low, high, high included): sane ranges, checked before a step is queued.
# eps > 0: with eps 0, a weight whose gradient is 0 (LoRA's A while B is still 0) steps by 0/0 = NaN
# and every later step of the run fails.
ADAM_BOUNDS = {
    "learning_rate": (0.0, 10.0, True),
    "beta1": (0.0, 1.0, False),
    "beta2": (0.0, 1.0, False),
    "eps": (1e-30, 1.0, True),
    "weight_decay": (0.0, 100.0, True),
    "grad_clip_norm": (0.0, math.inf, False),
}


def check_adam_value(name: str, v) -> None:
    """Raise ValueError unless AdamParams field `name` holds a finite number in its range."""
    lo, hi, closed = ADAM_BOUNDS[name]
    ok = (
        not isinstance(v, bool)
        and isinstance(v, (int, float))
        and math.isfinite(v)
        and v >= lo
        and (v <= hi if closed else v < hi)
    )
    if not ok:
        rng = f">= {lo}" if hi == math.inf else f"in [{lo}, {hi}{']' if closed else ')'}"
        raise ValueError(f"AdamParams.{name} must be a finite number {rng}, got {v!r}")


# ---------------------------------------------------------------------------- sampling
@dataclass(frozen=True)
class SamplingBound:
    """A sampling parameter's accepted range: finite, >= `low` (> when `low_open`), <= `high`
    (math.inf: no upper bound), an integer where `integer`; `off` is the value that turns it off,
    accepted even outside the range (top_k's -1) and named in messages."""

    low: float
    high: float
    low_open: bool = False
    off: float | None = None
    integer: bool = False

    def holds(self, v) -> bool:
        if isinstance(v, bool) or not isinstance(v, (int, float)):
            return False
        if self.off is not None and v == self.off:
            return True
        if self.integer and not isinstance(v, int):
            return False
        return math.isfinite(v) and (v > self.low if self.low_open else v >= self.low) and v <= self.high

    def text(self) -> str:
        """The range as messages and the docs write it: `in (0, 1]`, `a finite number >= 0`."""
        if self.high == math.inf:
            kind = "an integer" if self.integer else "a finite number"
            rng = f"{kind} {'>' if self.low_open else '>='} {self.low}"
        else:
            rng = f"in {'(' if self.low_open else '['}{self.low}, {self.high}]"
        return rng if self.off is None else f"{rng} ({self.off}: off)"


# SamplingParams field -> its range, the one every layer checks (the SDK, each front end, the
# engine); OpenAI's plane keeps OpenAI's own tighter caps on temperature and repetition_penalty
SAMPLING_BOUNDS = {
    "temperature": SamplingBound(0, math.inf),
    "top_p": SamplingBound(0, 1, low_open=True),
    "presence_penalty": SamplingBound(-2, 2),  # OpenAI's and vLLM's range
    "frequency_penalty": SamplingBound(-2, 2),
    "repetition_penalty": SamplingBound(0, math.inf, low_open=True, off=1),
    "min_p": SamplingBound(0, 1, off=0),
    "top_k": SamplingBound(1, math.inf, off=-1, integer=True),  # OpenAI's plane also reads 0 as off
}


def sampling_bound_error(name: str, v) -> str | None:
    """`must be <range>, got <v>` unless sampling parameter `name` holds a value in its range."""
    bound = SAMPLING_BOUNDS[name]
    return None if bound.holds(v) else f"must be {bound.text()}, got {v}"


# ---------------------------------------------------------------------------- per API key


@dataclass(frozen=True)
class KeyLimits:
    """What one API key may hold at once; past a limit a request gets 429 naming it."""

    live_runs: int = 64  # ACTIVE training runs
    adapter_bytes: int = 8 << 30  # their LoRA weights + gradients + Adam state (estimated)
    queued_tokens: int = 1 << 22  # tokens of forward / forward_backward events accepted, not yet run
