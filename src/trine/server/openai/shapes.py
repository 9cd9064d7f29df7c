"""Response bodies of the OpenAI API: whole responses, stream chunks, usage and logprobs.

`usage` reports the prompt once for all `n` choices (they share one prefill), completion tokens
summed over the choices, and `prompt_tokens_details.cached_tokens` from the prefix cache; trine
adds `cost` (the request's price on the server's rate card, in its currency).
"""

from __future__ import annotations

from typing import Callable

from ...metering.money import money
from ...service import SampleOutcome, tool_calls
from .params import Generation
from .structured import tool_calls_json

FINISH = {"stop": "stop", "length": "length"}


def reply(g: Generation, text: str, stop_reason: str) -> tuple[str | None, list[dict] | None, str]:
    """A chat choice's (content, tool_calls, finish_reason). With tools, the tool calls the reply
    holds (service/tool_calls.py) become `tool_calls`, the text before them the content (None
    when blank), and finish_reason is "tool_calls" unless max_tokens cut the reply."""
    content, calls = tool_calls.parse(text) if g.structured.parse_calls else (text, [])
    finish = FINISH.get(stop_reason, "stop")
    if not calls:
        return content, None, finish
    return (
        content if content.strip() else None,
        tool_calls_json(calls),
        "tool_calls" if finish == "stop" else finish,
    )


def usage(out: SampleOutcome) -> dict:
    u = out.usage
    return {
        "prompt_tokens": u["prompt_tokens"],
        "completion_tokens": u["sample_tokens"],
        "total_tokens": u["prompt_tokens"] + u["sample_tokens"],
        "prompt_tokens_details": {"cached_tokens": u["cached_tokens"]},
        "cost": money(out.cost),
    }


def _finite(x: float) -> float:
    return x if x > -1e30 else -9999.0  # OpenAI's floor for impossible tokens; JSON has no -inf


def _entry(token_text: Callable[[int], str], tok: int, lp: float) -> dict:
    t = token_text(tok)
    return {"token": t, "logprob": _finite(lp), "bytes": list(t.encode("utf-8"))}


def chat_logprobs(token_text, tokens, logprobs, tops) -> dict:
    """Chat's `logprobs.content`: one entry per generated token, with its top alternatives."""
    content = []
    for i, (tok, lp) in enumerate(zip(tokens, logprobs)):
        e = _entry(token_text, tok, lp)
        e["top_logprobs"] = [_entry(token_text, t, v) for t, v in tops[i]] if tops else []
        content.append(e)
    return {"content": content, "refusal": None}


def completion_logprobs(token_text, tokens, logprobs, tops, offset: int = 0) -> dict:
    """Completions' legacy `logprobs`: parallel lists, `text_offset` counted from `offset`."""
    texts = [token_text(t) for t in tokens]
    offsets = []
    for t in texts:
        offsets.append(offset)
        offset += len(t)
    return {
        "tokens": texts,
        "token_logprobs": [_finite(x) for x in logprobs],
        "top_logprobs": [{token_text(t): _finite(v) for t, v in top} for top in tops] if tops else None,
        "text_offset": offsets,
    }


def response(
    g: Generation, rid: str, created: int, prompt: list[int], out: SampleOutcome, token_text
) -> dict:
    choices = []
    for i, s in enumerate(out.sequences):
        lp = None
        if g.logprobs:
            tops = s.top_logprobs if g.top_logprobs else None
            lp = (chat_logprobs if g.chat else completion_logprobs)(token_text, s.tokens, s.logprobs, tops)
        if g.chat:
            content, calls, finish = reply(g, s.text, s.stop_reason)
            message = {"role": "assistant", "content": content, "refusal": None}
            if calls:
                message["tool_calls"] = calls
            choices.append({"index": i, "message": message, "logprobs": lp, "finish_reason": finish})
        else:
            choices.append(
                {
                    "index": i,
                    "text": s.text,
                    "logprobs": lp,
                    "finish_reason": FINISH.get(s.stop_reason, "stop"),
                }
            )
        if g.return_token_ids:
            choices[-1]["token_ids"] = list(s.tokens)
    body = {
        "id": rid,
        "object": "chat.completion" if g.chat else "text_completion",
        "created": created,
        "model": g.model,
        "choices": choices,
        "usage": usage(out),
        "system_fingerprint": None,
    }
    if g.return_token_ids:
        body["prompt_token_ids"] = list(prompt)
    return body


def chunk(
    g: Generation,
    rid: str,
    created: int,
    index: int,
    *,
    text: str | None = None,
    role: bool = False,
    logprobs: dict | None = None,
    finish: str | None = None,
    token_ids: list[int] | None = None,
    calls: list[dict] | None = None,
) -> dict:
    """One stream chunk for choice `index`; `calls` (chat): the choice's tool calls, whole."""
    if g.chat:
        delta = {"role": "assistant", "content": ""} if role else ({"content": text} if text else {})
        if calls:
            delta["tool_calls"] = [{"index": k, **c} for k, c in enumerate(calls)]
        choice = {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish}
    else:
        choice = {"index": index, "text": text or "", "logprobs": logprobs, "finish_reason": finish}
    if g.return_token_ids and token_ids is not None:
        choice["token_ids"] = token_ids
    out = {
        "id": rid,
        "object": "chat.completion.chunk" if g.chat else "text_completion",
        "created": created,
        "model": g.model,
        "choices": [choice],
        "system_fingerprint": None,
    }
    if g.include_usage:
        out["usage"] = None
    return out


def usage_chunk(g: Generation, rid: str, created: int, out: SampleOutcome) -> dict:
    return {
        "id": rid,
        "object": "chat.completion.chunk" if g.chat else "text_completion",
        "created": created,
        "model": g.model,
        "choices": [],
        "usage": usage(out),
        "system_fingerprint": None,
    }
