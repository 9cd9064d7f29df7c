"""OpenAI request bodies -> a validated `Generation`: what to sample and how to answer.

Parameters trine honours are checked here with OpenAI's ranges (plus the extensions `top_k`,
`stop_token_ids`, `return_token_ids` and `prompt_logprobs`, named as vLLM names them); parameters it
cannot honour and unknown keys get a 400 naming every one of them, so no request is silently served
differently from what it asked for. Values that ask for the default (`modalities: ["text"]`,
`store: false`, ...) are accepted. Chat's tools and structured output: structured.py.

Completions take a batch of prompts (`prompts`, one or more); `echo` and `max_tokens: 0` score a
prompt without generating (what evaluation harnesses' loglikelihood tasks send).
"""

from __future__ import annotations

import base64
import json
import re
from dataclasses import dataclass, field
from typing import Any

from ...engine.api import PromptImage
from ...limits import (
    INT64_MAX,
    MAX_SAMPLES_PER_REQUEST,
    MAX_STOP_STRING_CHARS,
    SAMPLING_BOUNDS,
    sampling_bound_error,
)
from .errors import OpenAIError, bad_param
from .structured import Structured, assistant_tool_calls, parse_structured

MAX_TOP_LOGPROBS = 20
MAX_LOGIT_BIAS = 300  # token ids in one logit_bias
MAX_TEMPERATURE = 2  # OpenAI's; trine's own range has no upper bound
MAX_REPETITION_PENALTY = 10.0  # this plane's cap; trine's own range has no upper bound
MAX_STOP_STRINGS = 16  # tighter than trine's own limit (limits.MAX_STOP_STRINGS): OpenAI allows a few
_NAME = re.compile(r"[A-Za-z0-9_.\-\[\]]+")  # a key shown bare in a message; others are quoted
ROLES = ("system", "developer", "user", "assistant", "tool")
# an image_url's one accepted form; its scheme and media type in any case (RFC 2397), its data as sent
DATA_URL = re.compile(r"data:image/(png|jpeg|jpg);base64,(.*)", re.DOTALL | re.IGNORECASE)

COMMON = {
    "model",
    "n",
    "max_tokens",
    "temperature",
    "top_p",
    "top_k",
    "seed",
    "stop",
    "stop_token_ids",
    "logprobs",
    "stream",
    "stream_options",
    "user",
    "return_token_ids",
    "prompt_logprobs",
    "presence_penalty",
    "frequency_penalty",
    "repetition_penalty",
    "min_p",
    "logit_bias",
}
STRUCTURED = {"tools", "tool_choice", "parallel_tool_calls", "response_format"}  # structured.py
CHAT = COMMON | {"messages", "max_completion_tokens", "top_logprobs"} | STRUCTURED
COMPLETION = COMMON | {"prompt", "echo", "best_of"}
TOOLS = "tools and structured output are served on /v1/chat/completions"
FUNCTIONS = "deprecated by OpenAI: use tools and tool_choice"
TEXT_ONLY = "the served models generate text only"
NOT_STORED = "responses are not stored"
LEGACY = "not supported on /v1/completions here"
# parameter -> (the values that mean "not used", which are accepted; why other values are refused)
NEUTRAL: dict[str, tuple[tuple, str]] = {
    "tools": ((None, []), TOOLS),
    "tool_choice": ((None, "none"), TOOLS),
    "functions": ((None, []), FUNCTIONS),
    "function_call": ((None, "none"), FUNCTIONS),
    "parallel_tool_calls": ((None, False, True), TOOLS),
    "response_format": ((None, {"type": "text"}), TOOLS),
    "modalities": ((None, ["text"]), TEXT_ONLY),
    "audio": ((None,), TEXT_ONLY),
    "prediction": ((None,), TEXT_ONLY),
    "reasoning_effort": ((None,), TEXT_ONLY),
    "web_search_options": ((None,), TEXT_ONLY),
    "store": ((None, False), NOT_STORED),
    "metadata": ((None, {}), NOT_STORED),
    "service_tier": ((None, "auto", "default"), "there is one service tier"),
    "suffix": ((None, ""), LEGACY),
    "best_of": ((None, 1), "served on /v1/completions (OpenAI's chat API has none)"),
}
DEFAULT_COMPLETION_TOKENS = 16  # /v1/completions without max_tokens, as OpenAI's legacy API


@dataclass
class Generation:
    """One validated request of either endpoint."""

    chat: bool
    model: str
    messages: list[dict] | None  # chat: [{"role", "content": str or parts}], roles as the template knows them
    prompts: list[str | list[int]] | None  # completions: one or more prompts, each text or token ids
    n: int = 1
    max_tokens: int | None = None  # None (chat): up to the model's context
    max_tokens_field: str = "max_tokens"  # the field it came in (chat: or max_completion_tokens)
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    logprobs: bool = False
    top_logprobs: int = 0
    stream: bool = False
    include_usage: bool = False
    return_token_ids: bool = False  # extension (vLLM's name): prompt_token_ids and each choice's token_ids
    echo: bool = False  # completions: the prompt (text, and tokens with logprobs) before each choice
    best_of: int | None = None  # completions: sample this many per prompt, answer the n most likely
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0  # extension (vLLM's)
    min_p: float = 0.0  # extension (vLLM's)
    logit_bias: tuple[tuple[int, float], ...] = ()
    prompt_logprobs: int | None = None  # extension (vLLM's): the prompt's logprobs, with this many top ones
    structured: Structured = field(default_factory=Structured)  # chat: tools, response_format
    tool_messages: bool = False  # chat: the conversation has tool calls or results (needs a tools template)
    images: list[PromptImage] = field(default_factory=list)  # chat: image_url parts, in order


def parse_chat(body: Any) -> Generation:
    body = _object(body)
    _refuse_unsupported(body, CHAT)
    g = Generation(True, _model(body), _messages(body.get("messages")), None)
    g.images = [
        p.pop("image")
        for m in g.messages
        if isinstance(m["content"], list)
        for p in m["content"]
        if "image" in p
    ]
    g.structured = parse_structured(body)
    g.tool_messages = any(m["role"] == "tool" or "tool_calls" in m for m in g.messages)
    _common(body, g)
    if body.get("max_completion_tokens") is not None:
        g.max_tokens = _int(body, "max_completion_tokens", 1, INT64_MAX)
        g.max_tokens_field = "max_completion_tokens"
    g.logprobs = _bool(body, "logprobs")
    if body.get("top_logprobs") is not None:
        g.top_logprobs = _int(body, "top_logprobs", 0, MAX_TOP_LOGPROBS)
        if g.top_logprobs and not g.logprobs:
            raise bad_param("top_logprobs", "needs logprobs: true")
    return g


def parse_completion(body: Any) -> Generation:
    body = _object(body)
    _refuse_unsupported(body, COMPLETION)
    g = Generation(
        False, _model(body), None, _prompts(body.get("prompt")), max_tokens=DEFAULT_COMPLETION_TOKENS
    )
    g.echo = _bool(body, "echo")
    _common(body, g)
    if body.get("logprobs") is not None:  # completions: an int, the number of top logprobs
        g.top_logprobs = _int(body, "logprobs", 0, MAX_TOP_LOGPROBS)
        g.logprobs = True
    if g.max_tokens == 0 and not g.echo:
        raise bad_param("max_tokens", "0 generates nothing; with echo: true it scores the prompt only")
    if body.get("best_of") is not None:
        g.best_of = _int(body, "best_of", 1, MAX_SAMPLES_PER_REQUEST)
        if g.best_of < g.n:
            raise bad_param("best_of", f"must be >= n ({g.n}), got {g.best_of}")
        if g.stream and g.best_of > g.n:
            raise bad_param("best_of", "greater than n cannot be streamed", "unsupported_value")
    if g.stream and g.echo:
        raise OpenAIError(
            400,
            "echo: is not supported with stream: true; send the request without stream",
            param="echo",
            code="unsupported_parameter",
        )
    if g.stream and len(g.prompts) > 1:
        raise bad_param(
            "prompt",
            f"a batch of {len(g.prompts)} prompts cannot be streamed; send it without stream, or one "
            "prompt per streaming request",
            "unsupported_value",
        )
    return g


# ---------------------------------------------------------------------------- checks
def _object(body: Any) -> dict:
    if not isinstance(body, dict):
        raise OpenAIError(400, "the request body must be a JSON object", code="invalid_json")
    return body


def _refuse_unsupported(body: dict, known: set[str]) -> None:
    unknown = sorted(k for k in body if k not in known and k not in NEUTRAL)
    if unknown:
        raise OpenAIError(
            400,
            f"unrecognized request argument(s): {', '.join(map(_shown, unknown))}; remove "
            f"{'it' if len(unknown) == 1 else 'them'}",
            param=unknown[0],
            code="unknown_parameter",
        )
    refused = sorted(k for k in body if k in NEUTRAL and k not in known and body[k] not in NEUTRAL[k][0])
    if refused:
        why = "; ".join(f"{k}: {NEUTRAL[k][1]}" for k in refused)
        raise OpenAIError(
            400,
            f"unsupported parameter(s): {why}. Remove {'it' if len(refused) == 1 else 'them'}.",
            param=refused[0],
            code="unsupported_parameter",
        )


def _shown(name: str) -> str:
    """A body key as a message shows it: bare when it reads as a name, else quoted as JSON, so the
    empty key reads `""` (not as nothing) and a key with spaces keeps its edges."""
    return name if _NAME.fullmatch(name) else json.dumps(name)


def _model(body: dict) -> str:
    model = body.get("model")
    if not isinstance(model, str) or not model.strip():
        raise bad_param(
            "model",
            "name a served model or one of your sampler checkpoints (GET /v1/models lists them)",
            "missing_required_parameter",
        )
    return model.strip()


def _common(body: dict, g: Generation) -> None:
    if body.get("n") is not None:
        g.n = _int(body, "n", 1, MAX_SAMPLES_PER_REQUEST)
    if body.get("max_tokens") is not None:
        g.max_tokens = _int(body, "max_tokens", 0 if g.echo else 1, INT64_MAX)
    if body.get("temperature") is not None:
        g.temperature = _number(body, "temperature", SAMPLING_BOUNDS["temperature"].low, MAX_TEMPERATURE)
    if body.get("top_p") is not None:
        g.top_p = _sampling(body, "top_p")
        if g.top_p == 0:
            raise bad_param("top_p", "must be > 0 (use temperature 0 for greedy decoding)")
    if body.get("top_k") is not None:
        g.top_k = _int(body, "top_k", None, INT64_MAX)
        g.top_k = -1 if g.top_k == 0 else g.top_k  # OpenAI's convention: 0 and -1 both mean off
        if (error := sampling_bound_error("top_k", g.top_k)) is not None:
            raise bad_param("top_k", f"{error} (or 0: off)")
    if body.get("seed") is not None:
        g.seed = _int(body, "seed", -(2**63), 2**63 - 1)
    g.stop = _stop(body.get("stop"))
    if body.get("stop_token_ids") is not None:
        ids = body["stop_token_ids"]
        if not isinstance(ids, list) or any(
            isinstance(t, bool) or not isinstance(t, int) or t < 0 for t in ids
        ):
            raise bad_param("stop_token_ids", "must be a list of token ids (non-negative integers)")
        g.stop_token_ids = tuple(ids)
    g.return_token_ids = _bool(body, "return_token_ids")
    _penalties(body, g)
    if body.get("prompt_logprobs") is not None:
        g.prompt_logprobs = _int(body, "prompt_logprobs", 0, MAX_TOP_LOGPROBS)
    g.stream = _bool(body, "stream")
    if g.stream and g.prompt_logprobs is not None:
        raise OpenAIError(
            400,
            "prompt_logprobs: is not supported with stream: true; send the request without stream",
            param="prompt_logprobs",
            code="unsupported_parameter",
        )
    opts = body.get("stream_options")
    if opts is not None:
        if not g.stream:
            raise bad_param("stream_options", "is only allowed when stream is true")
        if not isinstance(opts, dict) or set(opts) - {"include_usage"}:
            raise bad_param("stream_options", 'must be an object {"include_usage": true|false}')
        g.include_usage = _bool(opts, "include_usage", "stream_options.include_usage")
    if body.get("user") is not None and not isinstance(body["user"], str):
        raise bad_param("user", "must be a string")


def _penalties(body: dict, g: Generation) -> None:
    """Penalties, min_p and logit_bias with OpenAI's (and vLLM's) ranges: trine's own
    (`limits.SAMPLING_BOUNDS`), but repetition_penalty at most MAX_REPETITION_PENALTY."""
    for name in ("presence_penalty", "frequency_penalty"):
        if body.get(name) is not None:
            setattr(g, name, _sampling(body, name))
    if body.get("repetition_penalty") is not None:
        g.repetition_penalty = _number(
            body, "repetition_penalty", SAMPLING_BOUNDS["repetition_penalty"].low, MAX_REPETITION_PENALTY
        )
        if g.repetition_penalty == 0:
            raise bad_param("repetition_penalty", "must be > 0 (1: off)")
    if body.get("min_p") is not None:
        g.min_p = _sampling(body, "min_p")
    bias = body.get("logit_bias")
    if bias is not None:
        if not isinstance(bias, dict) or len(bias) > MAX_LOGIT_BIAS:
            raise bad_param(
                "logit_bias", f"must be an object of at most {MAX_LOGIT_BIAS} token ids to biases"
            )
        pairs = []
        for k in bias:
            if not (isinstance(k, str) and k.isascii() and k.isdigit()):  # not "²" nor "１"
                raise bad_param("logit_bias", f"keys must be token ids (as strings), got {k!r}")
            pairs.append((int(k), _number(bias, k, -100, 100, f"logit_bias[{k}]")))
        g.logit_bias = tuple(pairs)


def _int(body: dict, name: str, lo: int | None = None, hi: int | None = None) -> int:
    v = body[name]
    if isinstance(v, float) and v.is_integer():
        v = int(v)
    if isinstance(v, bool) or not isinstance(v, int):
        raise bad_param(name, f"must be an integer, got {v!r}")
    if (lo is not None and v < lo) or (hi is not None and v > hi):
        where = f"from {lo} to {hi}" if hi is not None else f">= {lo}"
        raise bad_param(name, f"must be {where}, got {v}")
    return v


def _number(body: dict, name: str, lo: float, hi: float, param: str | None = None) -> float:
    v = body[name]
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not lo <= v <= hi:
        raise bad_param(param or name, f"must be a number from {lo} to {hi}, got {v!r}")
    return float(v)


def _sampling(body: dict, name: str) -> float:
    """A bounded sampling parameter in its range (limits.SAMPLING_BOUNDS), both ends included: an
    open end (top_p's 0) is refused after, with its own hint."""
    b = SAMPLING_BOUNDS[name]
    return _number(body, name, b.low, b.high)


def _bool(body: dict, name: str, param: str | None = None) -> bool:
    v = body.get(name)
    if v is None:
        return False
    if not isinstance(v, bool):
        raise bad_param(param or name, f"must be true or false, got {v!r}")
    return v


def _stop(stop: Any) -> tuple[str, ...]:
    if stop is None:
        return ()
    stops = [stop] if isinstance(stop, str) else stop
    if not isinstance(stops, list) or not all(isinstance(s, str) and s for s in stops):
        raise bad_param("stop", "must be a non-empty string or a list of non-empty strings")
    if len(stops) > MAX_STOP_STRINGS or any(len(s) > MAX_STOP_STRING_CHARS for s in stops):
        raise bad_param(
            "stop", f"at most {MAX_STOP_STRINGS} strings of at most {MAX_STOP_STRING_CHARS} characters each"
        )
    return tuple(stops)


def _content(content: Any, where: str) -> str | list[dict]:
    """Message content: a string, or a list of text and image_url parts: their text joined, or,
    with images, the parts as a chat template takes them (`{"type": "image"}` holds the image, a
    PromptImage that parse_chat takes out)."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise bad_param(f"{where}.content", "must be a string or a list of text and image_url parts")
    parts = []
    for i, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else type(part).__name__
        if kind == "image_url":
            parts.append({"type": "image", "image": _image(part, f"{where}.content[{i}]")})
        elif kind == "text" and isinstance(part.get("text"), str):
            parts.append({"type": "text", "text": part["text"]})
        else:
            raise bad_param(
                f"{where}.content",
                f'part {i} is {kind!r}; send text parts ({{"type": "text", "text": ...}}) '
                'and images as image_url parts ({"type": "image_url", "image_url": {"url": "data:..."}})',
            )
    if not any(p["type"] == "image" for p in parts):
        return "".join(p["text"] for p in parts)
    return parts


def _image(part: dict, where: str) -> PromptImage:
    """An image_url part: a `data:` URL of a PNG or JPEG, base64. trine fetches nothing."""
    url, detail = part.get("image_url"), None
    if isinstance(url, dict):
        url, detail = url.get("url"), url.get("detail")
    param = f"{where}.image_url"
    if not isinstance(url, str):
        raise bad_param(param, 'must be {"url": "data:image/png;base64,..."}')
    if detail not in (None, "auto", "high"):
        raise bad_param(
            f"{param}.detail",
            f"{detail!r} is not supported: images are read at the model's own resolution "
            "(detail auto or high)",
            "unsupported_value",
        )
    if url[:5].lower() != "data:":
        raise bad_param(
            f"{param}.url",
            "only data: URLs are accepted (data:image/png;base64,... or data:image/jpeg;base64,...): "
            "trine fetches nothing; send the image's bytes",
            "unsupported_value",
        )
    m = DATA_URL.fullmatch(url)
    if m is None:
        raise bad_param(
            f"{param}.url", "must be data:image/png;base64,<data> or data:image/jpeg;base64,<data>"
        )
    try:
        data = base64.b64decode(m.group(2), validate=True)
    except ValueError:
        raise bad_param(f"{param}.url", "the data: URL's data is not standard base64") from None
    return PromptImage(data, "png" if m.group(1).lower() == "png" else "jpeg", None, param)


def _messages(messages: Any) -> list[dict]:
    if not isinstance(messages, list) or not messages:
        raise bad_param(
            "messages",
            "must be a non-empty list of {role, content} objects",
            "missing_required_parameter" if messages is None else "invalid_value",
        )
    out: list[dict] = []
    call_ids: set = set()  # the ids of earlier assistant tool calls (None: a call without one)
    for i, m in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(m, dict):
            raise bad_param(where, "must be an object with role and content")
        role = m.get("role")
        if role == "function" or m.get("function_call"):
            raise OpenAIError(
                400, f"{where}: function messages are {FUNCTIONS}", param=where, code="unsupported_parameter"
            )
        if role not in ROLES:
            raise bad_param(f"{where}.role", f"must be one of {', '.join(ROLES)}, got {role!r}")
        calls = m.get("tool_calls") if role == "assistant" else None
        if m.get("content") is None and not calls:
            raise bad_param(f"{where}.content", "is missing")
        # "developer" is OpenAI's newer name for the system message; chat templates know "system"
        msg = {
            "role": "system" if role == "developer" else role,
            "content": "" if m.get("content") is None else _content(m["content"], where),
        }
        if calls:
            msg["tool_calls"] = assistant_tool_calls(calls, where)
            call_ids |= {c["id"] if isinstance(c["id"], str) else None for c in msg["tool_calls"]}
        if role == "tool":
            msg["tool_call_id"] = _tool_call_id(m.get("tool_call_id"), call_ids, where)
        out.append(msg)
    return out


def _tool_call_id(tool_call_id: Any, call_ids: set, where: str) -> str:
    """A tool message's `tool_call_id`, as OpenAI checks it: a string answering a call an earlier
    assistant message made (any id, where those calls came without ids)."""
    if not isinstance(tool_call_id, str) or not tool_call_id:
        raise bad_param(
            f"{where}.tool_call_id",
            "is missing: a tool message answers one call, named by the id in the assistant's tool_calls",
            "missing_required_parameter" if tool_call_id is None else "invalid_value",
        )
    if not call_ids:
        raise bad_param(where, "a tool message must answer an earlier assistant message's tool_calls")
    if None not in call_ids and tool_call_id not in call_ids:
        raise bad_param(
            f"{where}.tool_call_id", f"{tool_call_id!r} answers no tool call of an earlier assistant message"
        )
    return tool_call_id


def _prompts(prompt: Any) -> list[str | list[int]]:
    """A prompt (text or token ids) or a batch of them: the list of prompts."""
    if isinstance(prompt, list) and prompt and all(isinstance(p, (str, list)) for p in prompt):
        if len(prompt) > MAX_SAMPLES_PER_REQUEST:
            raise bad_param(
                "prompt", f"a batch of at most {MAX_SAMPLES_PER_REQUEST} prompts, got {len(prompt)}"
            )
        return [_prompt(p, f"prompt[{i}]") for i, p in enumerate(prompt)]
    return [_prompt(prompt, "prompt")]


def _prompt(prompt: Any, param: str) -> str | list[int]:
    if isinstance(prompt, str):
        if not prompt:
            raise bad_param(param, "is empty")
        return prompt
    if (
        isinstance(prompt, list)
        and prompt
        and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt)
    ):
        return list(prompt)
    raise bad_param(
        param,
        "must be a string, a non-empty list of token ids, or a list of such prompts",
        "missing_required_parameter" if prompt is None else "invalid_value",
    )
