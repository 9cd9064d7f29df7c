"""The OpenAI-compatible routes: `GET /v1/models[/{model}]`, `POST /v1/chat/completions` and
`POST /v1/completions`, also under `/api/openai/v1/...` (PyTRIO's path) and `/oai/api/v1/...`
(Tinker's), and vLLM's `POST /tokenize`, `/detokenize` and `GET /tokenizer_info` (tokenize.py).
Auth is the API key as `Authorization: Bearer`.

A request becomes one sampling request of the service (all `n` choices share one prefill). With
`stream: true` the answer is server-sent events, one chunk per choice per engine step, then
`data: [DONE]`; a client that disconnects mid-stream cancels the request, which frees its
sequences and KV blocks at once. Every failure answers in OpenAI's error shape.
"""

from __future__ import annotations

import asyncio
import json
import logging
import secrets
import time
from dataclasses import dataclass, field

from fastapi import APIRouter, Request
from fastapi.responses import StreamingResponse

from ...diskspace import DiskFull
from ...engine.api import SampleDelta, SampleRequest
from ...limits import MAX_SAMPLE_BYTES
from ...metering.http import MoneyJSONResponse
from ...metering.money import dumps
from ...service import ApiKey, Service, ServiceError
from ..http.context import caller_key, lone_surrogate, read_body, service_of
from . import models as targets
from . import shapes, tokenize, tool_calls
from .bodies import CHAT, COMPLETION, Generation, parse_chat, parse_completion
from .errors import OpenAIError, from_disk_full, from_service
from .text import ModelText, TextStream
from .to_api import chat_images, no_placeholders, sample_request

log = logging.getLogger("trine.server.openai")
API_PREFIX = "/api/openai/v1"  # PyTRIO's path for it (checks its own body limit, in OpenAI's shape)
PREFIXES = ("/v1", API_PREFIX, "/oai/api/v1")
PARAMS = CHAT | COMPLETION  # the names a service error's message may start with
ENDED = ("run_ended", "service_session_closed")  # the remembered sampling run is gone: make another


@dataclass
class OpenAIState:
    """Per server: each model's text handling and the callers' sampling runs."""

    service: Service
    runs: targets.SamplingRuns
    texts: dict[str, ModelText] = field(default_factory=dict)

    def text(self, base: str) -> ModelText:
        if base not in self.texts:
            self.texts[base] = ModelText(self.service.queries.tokenizer(base))
        return self.texts[base]


def state_of(request: Request) -> OpenAIState:
    st = getattr(request.app.state, "openai", None)
    if st is None:
        svc = service_of(request)
        st = request.app.state.openai = OpenAIState(svc, targets.SamplingRuns(svc))
    return st


def _guard(handler):
    """Run a route; any error leaves in OpenAI's shape (and the server keeps serving)."""

    async def route(request: Request):
        try:
            return await handler(request)
        except OpenAIError as e:
            return e.response()
        except ServiceError as e:
            return from_service(e, PARAMS, service_of(request)).response()
        except DiskFull as e:
            log.warning("%s %s: %s", request.method, request.url.path, e.message)
            return from_disk_full(e, service_of(request)).response()
        except Exception as e:  # a bug in trine: say so in OpenAI's shape, keep serving
            log.exception("unhandled error on %s %s", request.method, request.url.path)
            return _internal(e).response()

    route.__name__ = handler.__name__
    return route


async def _body(request: Request) -> dict:
    raw = await read_body(request, MAX_SAMPLE_BYTES)
    try:
        body = json.loads(raw)
    except (ValueError, RecursionError):
        raise OpenAIError(400, "the request body is not valid JSON", code="invalid_json") from None
    if path := lone_surrogate(raw, body):
        raise OpenAIError(
            400,
            f"{path}: the text holds an unpaired UTF-16 surrogate (a \\ud800-\\udfff escape without "
            "its pair), which is not Unicode text; send valid UTF-8",
            param=path,
            code="invalid_value",
        )
    return body


# ---------------------------------------------------------------------------- models
async def list_models(request: Request):
    key = caller_key(request)
    return {"object": "list", "data": targets.listing(service_of(request), key)}


async def get_model(request: Request):
    key = caller_key(request)
    svc = service_of(request)
    return targets.model_card(svc, key, targets.resolve(svc, key, request.path_params["model"]))


# ---------------------------------------------------------------------------- generation
async def chat_completions(request: Request):
    key = caller_key(request)
    return await _generate(request, key, parse_chat(await _body(request)))


async def completions(request: Request):
    key = caller_key(request)
    return await _generate(request, key, parse_completion(await _body(request)))


async def tokenize_route(request: Request):
    key = caller_key(request)
    return await tokenize.tokenize(state_of(request), key, await _body(request))


async def detokenize_route(request: Request):
    key = caller_key(request)
    return await tokenize.detokenize(state_of(request), key, await _body(request))


async def tokenizer_info_route(request: Request):
    key = caller_key(request)
    return tokenize.tokenizer_info(state_of(request), key, request.query_params.get("model"))


async def _generate(request: Request, key: ApiKey, g: Generation):
    st = state_of(request)
    target = targets.resolve(st.service, key, g.model)
    text = st.text(target.base)
    served = st.service.queries.model(target.base)
    context = served.max_seq_len
    if g.images and served.vision is None:  # named before a text model's template sees image parts
        chat_images(g, [], served)
    prompts = [
        await text.prompt_ids(g.messages, p, context, g.structured.tools, g.tool_messages)
        for p in (g.prompts or [None])
    ]
    no_placeholders(g, prompts, served)
    images = ()
    if g.images:
        loop = asyncio.get_running_loop()
        prompts[0], images = await loop.run_in_executor(None, chat_images, g, prompts[0], served)
    rid = f"{'chatcmpl' if g.chat else 'cmpl'}-{secrets.token_hex(12)}"
    grammar = g.structured.grammar_on(text.tokenizer)
    reqs = [
        sample_request(g, rid if len(prompts) == 1 else f"{rid}-{i}", prompt, context, grammar, images)
        for i, prompt in enumerate(prompts)
    ]
    created = int(time.time())
    if not g.stream:
        outs = await _unless_disconnected(request, _all(st, key, target, reqs))
        answers = [
            shapes.Answer(p, _prompt_text(g, i, p, text), out)
            for i, (p, out) in enumerate(zip(prompts, outs))
        ]
        return MoneyJSONResponse(shapes.response(g, rid, created, answers, text.token_text))
    first, items = await _unless_disconnected(request, _start(st, key, target, reqs[0], True))
    return StreamingResponse(
        _events(g, rid, created, first, items, text),
        media_type="text/event-stream",
        headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
    )


def _prompt_text(g: Generation, i: int, prompt: list[int], text: ModelText) -> str:
    """What echo repeats: the prompt's text as the client sent it, or its token ids decoded."""
    if not g.echo:
        return ""
    p = g.prompts[i]
    return p if isinstance(p, str) else text.tokenizer.decode(prompt)


async def _all(st: OpenAIState, key: ApiKey, target: targets.ModelTarget, reqs: list[SampleRequest]):
    """The outcomes of a batch's requests, run concurrently (each metered and cached as its own);
    the first failure cancels the rest and is raised."""
    tasks = [asyncio.ensure_future(_start(st, key, target, req, False)) for req in reqs]
    try:
        return [out for out, _ in await asyncio.gather(*tasks)]
    finally:
        for t in tasks:
            t.cancel()


async def _unless_disconnected(request: Request, work):
    """Await `work`, cancelling it if the client goes away first (its sampling is then cancelled
    too, which frees the engine at once)."""
    task = asyncio.ensure_future(work)
    gone = asyncio.ensure_future(_disconnect(request))
    try:
        await asyncio.wait({task, gone}, return_when=asyncio.FIRST_COMPLETED)
        if not task.done():
            task.cancel()
            raise OpenAIError(499, "the client closed the connection", code="client_closed_request")
        return task.result()
    finally:
        gone.cancel()
        task.cancel()  # no-op once done; this handler itself may have been cancelled


async def _disconnect(request: Request) -> None:
    """Returns when the client disconnects (the body has been read: nothing else can arrive)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def _start(st: OpenAIState, key: ApiKey, target: targets.ModelTarget, req: SampleRequest, stream: bool):
    """Start sampling. Streaming: wait for the first chunk, so that a refused request is a plain
    HTTP error; returns (that chunk, the iterator of the rest). Otherwise: returns (the
    SampleOutcome, None)."""
    for attempt in (0, 1):
        run_id = st.runs.run_id(key, target, fresh=attempt > 0)
        items = st.service.sampling.sample_stream(key, run_id, req)
        try:
            item = await anext(items)
            if stream:
                return item, items
            while isinstance(item, SampleDelta):
                item = await anext(items)
            await items.aclose()
            return item, None
        except ServiceError as e:
            await items.aclose()
            if e.code not in ENDED or attempt:
                raise
        except BaseException:
            await items.aclose()  # e.g. the client went away: cancels the sampling too
            raise
    raise AssertionError("unreachable")


async def _events(g: Generation, rid: str, created: int, first, items, text: ModelText):
    """The server-sent events of a streaming request. If the client goes away, the framework
    cancels this generator; closing `items` then cancels the request in the engine."""
    # with tools, content stops streaming where a tool call starts: the calls come whole at the end
    holds = g.stop + ((tool_calls.OPEN,) if g.structured.parse_calls else ())
    streams = [TextStream(text.tokenizer, holds) for _ in range(g.n)]
    offsets = [0] * g.n

    async def all_items():
        yield first
        async for item in items:
            yield item

    try:
        if g.chat:
            for i in range(g.n):
                yield _sse(shapes.chunk(g, rid, created, i, role=True))
        async for item in all_items():
            if isinstance(item, SampleDelta):
                yield _sse(_delta_chunk(g, rid, created, item, streams[item.sequence], offsets, text))
            elif g.include_usage:
                yield _sse(shapes.usage_chunk(g, rid, created, item))
        yield "data: [DONE]\n\n"
    except ServiceError as e:
        yield _sse(from_service(e, PARAMS).body())
    except DiskFull as e:
        log.warning("stream %s: %s", rid, e.message)
        yield _sse(from_disk_full(e).body())
    except Exception as e:  # a bug in trine: end the stream with an error event
        log.exception("stream %s failed", rid)
        yield _sse(_internal(e).body())
    finally:
        await items.aclose()


def _internal(e: Exception) -> OpenAIError:
    return OpenAIError(500, f"internal error: {type(e).__name__}: {e}", code="internal_error")


def _delta_chunk(
    g: Generation,
    rid: str,
    created: int,
    d: SampleDelta,
    stream: TextStream,
    offsets: list[int],
    text: ModelText,
) -> dict:
    calls = None
    if d.stop_reason:
        content, calls, finish = (
            shapes.reply(g, d.text, d.stop_reason)
            if g.chat
            else (d.text, None, shapes.FINISH.get(d.stop_reason, "stop"))
        )
        piece = stream.finish((content or "") if calls else d.text)
    else:
        piece, finish = stream.add(d.tokens), None
    lp = None
    if g.logprobs:
        tops = d.top_logprobs if g.top_logprobs else None
        if g.chat:
            lp = shapes.chat_logprobs(text.token_text, d.tokens, d.logprobs, tops)
        else:
            lp = shapes.completion_logprobs(text.token_text, d.tokens, d.logprobs, tops, offsets[d.sequence])
            offsets[d.sequence] += sum(len(t) for t in lp["tokens"])
    return shapes.chunk(
        g, rid, created, d.sequence, text=piece, logprobs=lp, finish=finish, token_ids=d.tokens, calls=calls
    )


def _sse(obj: dict) -> str:
    return f"data: {dumps(obj, separators=(',', ':'))}\n\n"


def serves(path: str) -> bool:
    """Whether `path` is under one of the OpenAI API's prefixes (errors there take its shape)."""
    return any(path == p or path.startswith(p + "/") for p in PREFIXES)


async def unknown_route(request: Request):
    path = request.url.path
    served = [r for r in router.routes if r.name != "unknown_route" and r.path_regex.match(path)]
    if served:  # a route of ours, asked with another method
        allowed = ", ".join(sorted({m for r in served for m in r.methods}))
        raise OpenAIError(
            405,
            f"{request.method} {path}: this route takes {allowed}",
            code="method_not_allowed",
            headers={"Allow": allowed},
        )
    raise OpenAIError(
        404,
        f"Invalid URL ({request.method} {path}): this server serves "
        "/v1/models, /v1/chat/completions, /v1/completions, /tokenize, /detokenize and /tokenizer_info",
        code="unknown_url",
    )


router = APIRouter()
for _prefix in ("",) + PREFIXES:  # vLLM serves them at the root
    router.add_api_route(f"{_prefix}/tokenize", _guard(tokenize_route), methods=["POST"])
    router.add_api_route(f"{_prefix}/detokenize", _guard(detokenize_route), methods=["POST"])
    router.add_api_route(f"{_prefix}/tokenizer_info", _guard(tokenizer_info_route), methods=["GET"])
for _prefix in PREFIXES:
    router.add_api_route(f"{_prefix}/models", _guard(list_models), methods=["GET", "HEAD"])
    router.add_api_route(f"{_prefix}/models/{{model:path}}", _guard(get_model), methods=["GET", "HEAD"])
    router.add_api_route(f"{_prefix}/chat/completions", _guard(chat_completions), methods=["POST"])
    router.add_api_route(f"{_prefix}/completions", _guard(completions), methods=["POST"])
    router.add_api_route(
        f"{_prefix}/{{path:path}}", _guard(unknown_route), methods=["GET", "POST", "PUT", "PATCH", "DELETE"]
    )
