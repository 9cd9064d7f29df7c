"""What every front end takes from a request: the service, the caller's API key, the token signer,
and the body (read within a limit, parsed as JSON, validated with pydantic).

Every route and dependency here is `async`: it runs on the event loop, where every change of
service state happens (FastAPI would run a plain `def` in a thread pool).
"""

from __future__ import annotations

import json
import re
from typing import Any

from fastapi import Request
from pydantic import ValidationError

from ...service import ApiKey, InvalidRequest, Service, TooLarge
from .access_log import note_key
from .auth import TokenSigner, bearer


def service_of(request: Request) -> Service:
    return request.app.state.service


def signer_of(request: Request) -> TokenSigner:
    return request.app.state.signer


async def api_key(request: Request) -> ApiKey:
    """Dependency: the caller's API key (`X-API-Key` or `Authorization: Bearer`)."""
    return caller_key(request)


def caller_key(request: Request) -> ApiKey:
    """The caller's API key, for code already on the event loop (front ends that authenticate
    inside an async route rather than through the `api_key` dependency)."""
    secret = request.headers.get("x-api-key") or bearer(request.headers.get("authorization"))
    key = service_of(request).ownership.authenticate(secret)
    note_key(request, key.name)
    return key


async def read_body(request: Request, limit: int) -> bytes:
    """The request body, refusing more than `limit` bytes (413) without reading it all first."""
    declared = request.headers.get("content-length")
    if declared and declared.isdigit() and int(declared) > limit:
        raise TooLarge(
            f"body: {declared} bytes exceeds the limit of {limit} bytes; split the batch "
            "into smaller requests"
        )
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise TooLarge(f"body exceeds the limit of {limit} bytes; split the batch into smaller requests")
        chunks.append(chunk)
    return b"".join(chunks)


_SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F]")  # a \\ud800-\\udfff escape in JSON text


def lone_surrogate(raw: bytes, body: Any) -> str | None:
    """The path (`messages[0].content`) of the first string in `body`, parsed from `raw`, holding an
    unpaired UTF-16 surrogate (JSON allows the escape; no tokenizer can encode it), or None. Only a
    body whose text has such an escape is walked."""
    if not _SURROGATE_ESCAPE.search(raw):
        return None

    def walk(value: Any, path: str) -> str | None:
        if isinstance(value, str):
            try:
                value.encode("utf-8")
            except UnicodeEncodeError:
                return path or "body"
            return None
        items = (
            value.items() if isinstance(value, dict) else enumerate(value) if isinstance(value, list) else []
        )
        for key, item in items:
            if isinstance(key, str) and (found := walk(key, path)):
                return found
            sub = f"{path}[{key}]" if isinstance(key, int) else (f"{path}.{key}" if path else str(key))
            if found := walk(item, sub):
                return found
        return None

    return walk(body, "")


def parse_json(raw: bytes, empty_ok: bool = True) -> Any:
    """A JSON body; an empty body is `{}` when `empty_ok`."""
    if empty_ok and not raw.strip():
        return {}
    try:
        return json.loads(raw)
    except (ValueError, RecursionError):
        raise InvalidRequest("body: not valid JSON", code="invalid_request_body") from None


async def json_object(
    request: Request, limit: int | None = None, what: str = "send a JSON object", empty_ok: bool = True
) -> dict:
    """The body as a JSON object (an empty body is `{}` when `empty_ok`), read within `limit` bytes
    if given; anything else is a 400 ending with `what`."""
    raw = await (read_body(request, limit) if limit is not None else request.body())
    body = parse_json(raw, empty_ok)
    if not isinstance(body, dict):
        raise InvalidRequest(f"body: {what}", code="invalid_request_body")
    return body


def validation_message(e: ValidationError, prefix: str = "") -> str:
    """pydantic's first errors, each naming its field from `prefix` (`payload.data.0.target_ids: ...`)."""
    parts = []
    for err in e.errors()[:3]:
        loc = ".".join(str(x) for x in (prefix, *err["loc"]) if x != "")
        parts.append(f"{loc or 'body'}: {err['msg']}")
    return "; ".join(parts)


def parse_model(cls, data: Any, prefix: str = ""):
    """`data` validated as the pydantic model `cls`; InvalidRequest naming the field otherwise."""
    try:
        return cls.model_validate(data)
    except ValidationError as e:
        raise InvalidRequest(validation_message(e, prefix)) from None


async def json_model(request: Request, cls):
    """The body (a JSON object, `{}` when empty) as pydantic model `cls`; errors name the field."""
    return parse_model(cls, await json_object(request))
