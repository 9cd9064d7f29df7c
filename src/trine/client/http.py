"""HTTP for both planes, with PyTRIO's retry rules.

Retryable: HTTP 408/429/500/502/503/504 and transport errors (connect, read, timeouts). After the
first retryable failure, the *same* request (same body, same event or request id) is re-sent with
exponential backoff until `retry_window_s` has passed; the server deduplicates by those ids. A
retryable answer's `Retry-After` (seconds or an HTTP date) is honoured: the next attempt waits at
least that long, at most `retry_after_max_s` and never past the window. A draining server answers
503 `server_shutting_down` with the time its drain and restart should take, so work it refused or
cancelled is sent again once it is back, not hammered at while it is down. While nothing accepts
connections (a server restarting), attempts are at most `retry_connect_max_delay_s` apart, so a
restarted server gets the retry within 2 s of listening, not up to 10 s later. Each
request that needs retries logs one WARNING on `trine.client` when it starts retrying (and one INFO
line if it then succeeds), never one line per attempt.

A client's first request (creating the `ServiceClient`) retries only for `connect_check_s`, so a
server that is not there fails in seconds; the long window is for a server that was reachable and
is restarting.

Control (`{root}/api/...`): JSON, authenticated with the API key (X-API-Key + Bearer).
Actor (from the run's `actor.endpoint`): authenticated with the run's short-lived JWT, renewed
through control when within 300 s of expiry or after a 401 (once per failed token).
"""

from __future__ import annotations

import asyncio
import email.utils
import logging
import random
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from datetime import datetime, timezone

import httpx

from ..errors import ActorAPIError, AuthError, ControlAPIError, TrineError
from .wire import decode_body

RETRYABLE_STATUS = frozenset({408, 429, 500, 502, 503, 504})
log = logging.getLogger("trine.client")


@dataclass
class Settings:
    request_timeout_s: float = 30.0
    retry_window_s: float = 900.0  # retry a failing request this long after its first failure
    connect_check_s: float = 5.0  # the first request of a new client: fail after this long unreachable
    retry_initial_delay_s: float = 0.5
    retry_max_delay_s: float = 10.0
    retry_after_max_s: float = 60.0  # the longest Retry-After honoured (as the tinker client caps it)
    retry_connect_max_delay_s: float = 2.0  # while nothing listens: a refused connect costs nothing
    poll_wait_s: int = 30  # sent as `Prefer: wait=N` on event long-polls
    sampling_timeout_s: float = 4 * 3600.0
    max_events_in_flight: int = 16  # per training run
    max_samples_in_flight: int = 16  # per sampling client


def normalize_base_url(url: str) -> str:
    url = url.strip().rstrip("/")
    if url.endswith("/api"):
        url = url[: -len("/api")]
    return url


async def send_with_retry(
    send: Callable[[], Awaitable[httpx.Response]],
    settings: Settings,
    what: str = "request",
    window_s: float | None = None,
) -> httpx.Response:
    """Call `send` until it gives a non-retryable response or the retry window closes
    (`window_s`, default `settings.retry_window_s`). `what` names the request in the log."""
    window = settings.retry_window_s if window_s is None else window_s
    first_failure: float | None = None
    delay = settings.retry_initial_delay_s
    attempts = 0
    while True:
        attempts += 1
        try:
            response = await send()
            if response.status_code not in RETRYABLE_STATUS:
                if attempts > 1:
                    log.info("%s succeeded after %d attempts", what, attempts)
                return response
            error: Exception | None = None
        except httpx.TransportError as e:
            response, error = None, e
        now = time.monotonic()
        if first_failure is None:
            first_failure = now
            if window > 0:
                reason = (
                    f"{type(error).__name__}: {error}"
                    if error is not None
                    else f"HTTP {response.status_code}"
                )
                log.warning("%s failed (%s); retrying for up to %.0f s", what, reason, window)
        if now - first_failure >= window:
            if error is not None:
                raise error
            return response
        wait = delay * (1 + 0.1 * random.random())
        if isinstance(error, httpx.ConnectError):  # a restarting server: answer soon after it is back
            wait = min(wait, settings.retry_connect_max_delay_s)
        if response is not None:
            wait = max(wait, min(retry_after(response), settings.retry_after_max_s))
        # the last wait ends when the window closes, so the window is the whole time spent retrying
        await asyncio.sleep(min(wait, first_failure + window - now))
        delay = min(delay * 2, settings.retry_max_delay_s)


def retry_after(response: httpx.Response) -> float:
    """Seconds the response's `Retry-After` asks for (delta seconds or an HTTP date); 0 if none."""
    value = response.headers.get("retry-after", "").strip()
    if not value:
        return 0.0
    try:
        return max(0.0, float(value))
    except ValueError:
        pass
    try:
        when = email.utils.parsedate_to_datetime(value)
    except (TypeError, ValueError):
        return 0.0
    if when.tzinfo is None:
        when = when.replace(tzinfo=timezone.utc)
    return max(0.0, (when - datetime.now(timezone.utc)).total_seconds())


def error_fields(body: object) -> tuple[str, str, dict]:
    """(code, message, details) from `{code, message, ...}` or `{error: {code, message}}`."""
    if isinstance(body, dict) and isinstance(body.get("error"), dict):
        body = body["error"]
    if not isinstance(body, dict):
        return "", "", {}
    details = {k: v for k, v in body.items() if k not in ("code", "message")}
    return str(body.get("code") or ""), str(body.get("message") or ""), details


class ControlHTTP:
    """The control plane of one server, bound to one API key."""

    def __init__(self, base_url: str, api_key: str, settings: Settings):
        self.root = normalize_base_url(base_url)
        self.settings = settings
        self.client = httpx.AsyncClient(
            base_url=self.root + "/api/",
            timeout=settings.request_timeout_s,
            headers={"X-API-Key": api_key, "Authorization": f"Bearer {api_key}"},
        )

    async def call(
        self,
        method: str,
        path: str,
        *,
        json: dict | None = None,
        params: dict | None = None,
        retry: bool = True,
        retry_window_s: float | None = None,
        timeout: float | None = None,
        content: bytes | None = None,
    ) -> dict:
        """The JSON object a control endpoint returns; `retry=False` tries once (used at exit),
        `retry_window_s` shortens the retry window, `timeout` the per-attempt timeout; `content` a
        raw body (an upload) in place of `json`."""
        kw = {"timeout": timeout} if timeout is not None else {}
        if content is not None:
            kw["content"] = content
        send = lambda: self.client.request(method, path, json=json, params=params, **kw)  # noqa: E731
        try:
            response = await (
                send_with_retry(send, self.settings, f"{method} /api/{path}", retry_window_s)
                if retry
                else send()
            )
        except httpx.TransportError as e:
            raise ControlAPIError(
                f"cannot reach the trine server at {self.root} ({type(e).__name__}: {e}); "
                "is `trine serve` running there?",
                code="network_error",
            ) from e
        try:
            body = response.json() if response.content.strip() else {}
        except ValueError:
            body = None
        if response.status_code >= 400:
            code, message, details = error_fields(body)
            cls = AuthError if response.status_code == 401 else ControlAPIError
            raise cls(
                message or f"control request {method} /api/{path} failed with HTTP {response.status_code}",
                code=code,
                status_code=response.status_code,
                details=details,
            )
        if not isinstance(body, dict):
            raise ControlAPIError(
                f"control request {method} /api/{path} did not return a JSON object",
                code="invalid_response",
                status_code=response.status_code,
            )
        return body

    async def get_bytes(self, path: str) -> bytes:
        """A control GET whose answer is a file, not JSON."""
        try:
            response = await send_with_retry(lambda: self.client.get(path), self.settings, f"GET /api/{path}")
        except httpx.TransportError as e:
            raise ControlAPIError(
                f"cannot reach the trine server at {self.root} ({e})", code="network_error"
            ) from e
        if response.status_code >= 400:
            try:
                code, message, details = error_fields(response.json())
            except ValueError:
                code, message, details = "", "", {}
            raise ControlAPIError(
                message or f"GET /api/{path} failed with HTTP {response.status_code}",
                code=code,
                status_code=response.status_code,
                details=details,
            )
        return response.content

    async def aclose(self) -> None:
        await self.client.aclose()


def _parse_time(value: object) -> datetime | None:
    if not isinstance(value, str) or not value:
        return None
    t = datetime.fromisoformat(value.replace("Z", "+00:00"))
    return t if t.tzinfo else t.replace(tzinfo=timezone.utc)


class ActorConnection:
    """The actor endpoint of one run with its JWT. `renew` asks control for new credentials
    (a response with `actor` and `actor_jwt`)."""

    def __init__(
        self,
        actor: dict,
        actor_jwt: dict,
        renew: Callable[[], Awaitable[dict]],
        settings: Settings,
        client: httpx.AsyncClient,
    ):
        self.settings = settings
        self.client = client  # shared by every actor connection of a ServiceClient
        self._renew_fn = renew
        self._renewing: asyncio.Task | None = None
        self._apply(actor, actor_jwt)

    def _apply(self, actor: dict, actor_jwt: dict) -> None:
        endpoint = actor["endpoint"]
        if "://" not in endpoint:
            endpoint = ("https://" if actor.get("tls_enabled") else "http://") + endpoint
        self.endpoint = endpoint.rstrip("/") + "/"
        self.token = actor_jwt["token"]
        self.expires_at = _parse_time(actor_jwt.get("expires_at"))

    async def renew(self, failed_token: str | None = None) -> None:
        """Fetch new credentials once; concurrent callers share one renewal."""
        if failed_token is not None and failed_token != self.token:
            return  # someone renewed already
        if self._renewing is None or self._renewing.done():

            async def run():
                r = await self._renew_fn()
                self._apply(r["actor"], r["actor_jwt"])

            self._renewing = asyncio.ensure_future(run())
        await asyncio.shield(self._renewing)

    async def request(
        self,
        method: str,
        path: str,
        *,
        content: bytes | None = None,
        json: dict | None = None,
        headers: dict | None = None,
        timeout: float | None = None,
    ) -> httpx.Response:
        if (
            self.expires_at is not None
            and (self.expires_at - datetime.now(timezone.utc)).total_seconds() < 300
        ):
            await self.renew()
        for attempt in range(2):
            token = self.token
            h = {**(headers or {}), "Authorization": f"Bearer {token}"}
            try:
                response = await send_with_retry(
                    lambda h=h: self.client.request(
                        method,
                        self.endpoint + path,
                        content=content,
                        json=json,
                        headers=h,
                        timeout=timeout or self.settings.request_timeout_s,
                    ),
                    self.settings,
                    f"{method} {self.endpoint}{path}",
                )
            except httpx.TransportError as e:
                raise ActorAPIError(
                    f"cannot reach the actor at {self.endpoint} ({type(e).__name__}: {e})",
                    code="network_error",
                ) from e
            if response.status_code == 401 and attempt == 0:
                await self.renew(failed_token=token)
                continue
            return response
        return response

    @staticmethod
    def raise_for_error(response: httpx.Response, what: str) -> object:
        """The decoded body, or ActorAPIError carrying the server's code and message."""
        try:
            body = decode_body(response.content, response.headers.get("content-type", ""))
        except Exception:  # noqa: BLE001 - an undecodable body is reported with its status
            body = None
        if response.status_code >= 400:
            code, message, details = error_fields(body)
            raise ActorAPIError(
                message or f"{what} failed with HTTP {response.status_code}",
                code=code,
                status_code=response.status_code,
                details=details,
            )
        if body is None:
            raise TrineError(f"{what}: the server sent an undecodable body", code="invalid_response")
        return body
