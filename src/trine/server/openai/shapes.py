"""Response bodies of the OpenAI API: whole responses, stream chunks, usage and logprobs.

`usage` reports each prompt once for all its `n` choices (they share one prefill), completion tokens
summed over the choices, and `prompt_tokens_details.cached_tokens` from the prefix cache; trine
adds `cost` (the request's price on the server's rate card, in its currency). A batch of prompts
answers with one choice per prompt x n, prompt i's choices at indexes i * n .. i * n + n - 1, and
usage summed over its prompts.

With `echo`, a completion choice starts with its prompt: `text` is the prompt's text then the
completion, and `logprobs` lists the prompt's tokens first, the first one's logprob and top
logprobs `null` (nothing precedes it), as OpenAI's legacy API and vLLM answer.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from ...engine.api import SampledSequence
from ...metering.money import money
from ...service import SampleOutcome
from . import tool_calls
from .bodies import Generation
from .structured import tool_calls_json

FINISH = {"stop": "stop", "length": "length"}


def reply(g: Generation, text: str, stop_reason: str) -> tuple[str | None, list[dict] | None, str]:
    """A chat choice's (content, tool_calls, finish_reason). With tools, the tool calls the reply
    holds (tool_calls.py) become `tool_calls`, the text before them the content (None
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


@dataclass
class Answer:
    """One prompt's outcome, with what its choices need: its token ids and (echo) its text."""

    prompt: list[int]
    text: str  # the prompt as the client gave it (text), or its token ids decoded
    out: SampleOutcome


def usage(outs: list[SampleOutcome]) -> dict:
    """The usage of one request: its prompts' outcomes summed."""
    prompt = sum(o.usage["prompt_tokens"] for o in outs)
    sampled = sum(o.usage["sample_tokens"] for o in outs)
    return {
        "prompt_tokens": prompt,
        "completion_tokens": sampled,
        "total_tokens": prompt + sampled,
        "prompt_tokens_details": {"cached_tokens": sum(o.usage["cached_tokens"] for o in outs)},
        "cost": money(sum(o.cost for o in outs)),
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
        "top_logprobs": [{token_text(t): _finite(v) for t, v in top} for top in tops]
        if tops is not None
        else None,
        "text_offset": offsets,
    }


def echo_logprobs(token_text, a: Answer, top: bool) -> dict:
    """The prompt's part of an echoed choice's `logprobs` (completion_logprobs' shape)."""
    lps = a.out.prompt_logprobs or [None] * len(a.prompt)
    out = completion_logprobs(token_text, a.prompt, [], None)
    out["token_logprobs"] = [None if x is None else _finite(x) for x in lps]
    if top:
        tops = a.out.topk_prompt_logprobs or [None] * len(a.prompt)
        out["top_logprobs"] = [None if t is None else {token_text(k): _finite(v) for k, v in t} for t in tops]
    return out


def _joined(first: dict, rest: dict) -> dict:
    """Two completion `logprobs` objects, one after the other (offsets continue)."""
    end = len("".join(first["tokens"]))
    return {
        "tokens": first["tokens"] + rest["tokens"],
        "token_logprobs": first["token_logprobs"] + rest["token_logprobs"],
        "top_logprobs": (
            first["top_logprobs"] + rest["top_logprobs"]
            if first["top_logprobs"] is not None and rest["top_logprobs"] is not None
            else None
        ),
        "text_offset": first["text_offset"] + [end + x for x in rest["text_offset"]],
    }


def vllm_prompt_logprobs(token_text, a: Answer) -> list[dict | None]:
    """vLLM's `prompt_logprobs`: per prompt token (the first: null), a dict from token id (as a
    string) to {logprob, rank, decoded_token}: the prompt's token first, then the top ones. `rank` is
    1 + the place in the top list, null for a prompt token outside it."""
    lps = a.out.prompt_logprobs or [None] * len(a.prompt)
    tops = a.out.topk_prompt_logprobs or [None] * len(a.prompt)
    out: list[dict | None] = []
    for tok, lp, top in zip(a.prompt, lps, tops):
        if lp is None:
            out.append(None)
            continue
        ranked = {t: (v, r + 1) for r, (t, v) in enumerate(top or [])}
        entries = {tok: ranked.get(tok, (lp, None)), **ranked}
        out.append(
            {
                str(t): {"logprob": _finite(v), "rank": r, "decoded_token": token_text(t)}
                for t, (v, r) in entries.items()
            }
        )
    return out


def _sequences(g: Generation, a: Answer) -> list:
    """A prompt's n sequences: the sampled ones (with best_of > n, the n of highest cumulative
    logprob, most likely first, as vLLM picks them), or (max_tokens 0) n empty ones."""
    if a.out.sequences:
        if g.best_of and g.best_of > g.n:
            return sorted(a.out.sequences, key=lambda s: -sum(s.logprobs))[: g.n]
        return a.out.sequences
    return [SampledSequence(tokens=[], logprobs=[], text="", stop_reason="length", top_logprobs=[])] * g.n


def response(g: Generation, rid: str, created: int, answers: list[Answer], token_text) -> dict:
    """The whole answer of a request: one choice per prompt x n (chat: one prompt)."""
    choices = []
    for a in answers:
        for s in _sequences(g, a)[: g.n]:
            i = len(choices)
            lp = None
            if g.logprobs:
                tops = s.top_logprobs if g.top_logprobs else None
                lp = (chat_logprobs if g.chat else completion_logprobs)(
                    token_text, s.tokens, s.logprobs, tops
                )
                if g.echo:
                    lp = _joined(echo_logprobs(token_text, a, bool(g.top_logprobs)), lp)
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
                        "text": (a.text if g.echo else "") + s.text,
                        "logprobs": lp,
                        "finish_reason": FINISH.get(s.stop_reason, "stop"),
                    }
                )
                if g.prompt_logprobs is not None:
                    choices[-1]["prompt_logprobs"] = vllm_prompt_logprobs(token_text, a)
            if g.return_token_ids:
                choices[-1]["token_ids"] = list(s.tokens)
                if not g.chat:
                    choices[-1]["prompt_token_ids"] = list(a.prompt)
    body = {
        "id": rid,
        "object": "chat.completion" if g.chat else "text_completion",
        "created": created,
        "model": g.model,
        "choices": choices,
        "usage": usage([a.out for a in answers]),
        "system_fingerprint": None,
    }
    if g.chat and g.prompt_logprobs is not None:
        body["prompt_logprobs"] = vllm_prompt_logprobs(token_text, answers[0])
    if g.return_token_ids:
        body["prompt_token_ids"] = list(answers[0].prompt)
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
        "usage": usage([out]),
        "system_fingerprint": None,
    }
