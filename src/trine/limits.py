"""One definition of every limit and name that several layers check (SDK, front ends, service,
engine). Plain constants and checks that raise ValueError naming the field and the fix; no imports
from the rest of trine, so every layer can use them.
"""
from __future__ import annotations

import re

# ---------------------------------------------------------------------------- LoRA
LORA_RANK_MIN, LORA_RANK_MAX = 1, 256


def check_lora_rank(rank, field: str = "lora_rank") -> int:
    if isinstance(rank, bool) or not isinstance(rank, int) or not LORA_RANK_MIN <= rank <= LORA_RANK_MAX:
        raise ValueError(f"{field} {rank!r}: use an integer from {LORA_RANK_MIN} to {LORA_RANK_MAX}")
    return rank


# ---------------------------------------------------------------------------- training events
INIT_RUN = "trainer.init_run"
FORWARD = "trainer.forward"
FORWARD_BACKWARD = "trainer.forward_backward"
OPTIMIZE_STEP = "trainer.optimize_step"
SAVE_STATE = "trainer.save_state"
SAVE_WEIGHTS = "trainer.save_weights"
END_RUN = "trainer.end_run"
EVENT_TYPES = (INIT_RUN, FORWARD, FORWARD_BACKWARD, OPTIMIZE_STEP, SAVE_STATE, SAVE_WEIGHTS, END_RUN)
MAX_WAITING_EVENTS_PER_RUN = 64  # accepted, not yet executed

# ---------------------------------------------------------------------------- checkpoints
CHECKPOINT_NAME = re.compile(r"^[A-Za-z0-9](?:[A-Za-z0-9._-]*[A-Za-z0-9_-])?$")
CHECKPOINT_NAME_MAX = 200
CHECKPOINT_VISIBILITIES = ("WORKSPACE", "TEMPORARY")
TEMPORARY_CHECKPOINT_TTL_SECONDS = 6 * 3600


def check_checkpoint_name(name, field: str = "name") -> str:
    if not isinstance(name, str) or len(name) > CHECKPOINT_NAME_MAX or not CHECKPOINT_NAME.match(name):
        raise ValueError(f"{field} {name!r}: use 1-{CHECKPOINT_NAME_MAX} letters, digits, '.', '_' or "
                         "'-', starting with a letter or digit")
    return name


# ---------------------------------------------------------------------------- sampling
MAX_SAMPLES_PER_REQUEST = 256
MAX_TOPK_PROMPT_LOGPROBS = 64
MAX_REQUEST_ID_CHARS = 200


def check_prompt_length(prompt_tokens: int, max_tokens: int, context: int, model: str) -> None:
    """A prompt plus the tokens to generate must fit the model's context."""
    if prompt_tokens < 1:
        raise ValueError("prompt: send at least one token")
    total = prompt_tokens + max_tokens
    if total > context:
        raise ValueError(f"prompt ({prompt_tokens} tokens) + max_tokens ({max_tokens}) = {total} "
                         f"exceeds {model}'s context of {context} tokens")


# ---------------------------------------------------------------------------- request bodies
MAX_EVENT_BYTES = 64 << 20
MAX_SAMPLE_BYTES = 16 << 20
MAX_CONTROL_BYTES = 1 << 20
