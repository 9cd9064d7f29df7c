"""The HTTP server: one FastAPI app (control plane, actor plane, downloads, the Tinker API, the
OpenAI-compatible API, the web console) over one `Service`.

`start_server(...)` runs it with uvicorn in a background thread and returns a `ServerHandle`
(url, api_key, stop()); `trine serve`, `trine demo` and the tests use it.

Every error leaves as `{"code", "message"}` with a 4xx status for anything the caller can fix
(the OpenAI-compatible routes answer in OpenAI's shape instead, see server/openai/); a 500
(`internal_error`) means a bug in trine, and the server keeps serving (the connection too). A
full disk is 507 `disk_full` (naming the path and its free bytes), a server shutting down 503
`server_shutting_down` with Retry-After. `GET /health` and `GET /metrics` (Prometheus text,
http/prometheus.py) need no key: status and free disk space; request, engine and cycle figures. Body
limits count the bytes actually read; connection limits and the bounded shutdown are in
`http/connections.py`.
"""

from __future__ import annotations

import asyncio
import logging
import os
import socket
import threading
import time
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path

import uvicorn
from fastapi import APIRouter, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, RedirectResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from ..diskspace import DiskFull
from ..home import trine_home
from ..limits import MAX_ADAPTER_UPLOAD_BYTES, MAX_BODY_BYTES, MAX_CONTROL_BYTES
from ..metering.http import MoneyJSONResponse, make_usage_router
from ..service import Service, ServiceError, Unauthorized
from ..service.ownership import Ownership
from ..service.queries import UsageLedger
from . import console, openai, tinker, traces
from .http import context, middleware
from .http.access_log import log_request
from .http.auth import TokenSigner
from .http.connections import (
    HEADER_TIMEOUT,
    MAX_CONNECTIONS,
    SHUTDOWN_TIMEOUT,
    GuardedServer,
    quiet_accept_errors,
    uvicorn_config,
)
from .http.middleware import BodyLimit, InternalErrors
from .http.observed import Observed
from .http.prometheus import HttpMetrics, PrometheusEndpoint
from .http.refusals import public_message, retry_headers
from .pytrio import routes_actor, routes_adapters, routes_control, routes_runs

log = logging.getLogger("trine.server")
EMBEDDED_KEY_FILE = "embedded.key"


def body_limit(path: str) -> int:
    """The most bytes a request body to `path` may have (the actor plane checks smaller per-route
    limits itself)."""
    if path == routes_adapters.ADAPTERS_PATH:
        return MAX_ADAPTER_UPLOAD_BYTES
    if (
        path.startswith("/api/")
        and path not in tinker.LARGE_BODY_PATHS
        and not path.startswith(openai.API_PREFIX)
    ):  # these routes check their own limits
        return MAX_CONTROL_BYTES
    return MAX_BODY_BYTES


def _error(status: int, code: str, message: str, headers: dict | None = None) -> JSONResponse:
    return JSONResponse({"code": code, "message": message}, status_code=status, headers=headers)


def error_body(path: str, status: int, code: str, message: str) -> dict:
    """An error answered before or around the routes (body limits, unknown methods, internal
    errors): in OpenAI's shape on the OpenAI routes, trine's `{"code", "message"}` elsewhere."""
    if openai.serves(path):
        return openai.OpenAIError(status, message, code=code).body()
    return middleware.error_body(path, status, code, message)


def create_app(service: Service, signer: TokenSigner, *, routers: tuple[APIRouter, ...] = ()) -> FastAPI:
    """The app: control plane, actor plane, downloads, the metering usage API and the web console.
    Extra `routers` are mounted next to them; they reach the service with `context.service_of`
    and the caller's key through the `context.api_key` dependency."""

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        quiet_accept_errors(asyncio.get_running_loop())
        await service.start()
        try:
            yield
        finally:
            await service.stop()

    app = FastAPI(
        title="trine",
        lifespan=lifespan,
        openapi_url=None,
        docs_url=None,
        redoc_url=None,
        default_response_class=MoneyJSONResponse,
    )  # amounts fixed-point (metering/money.py)
    app.state.service = service
    app.state.signer = signer

    @app.exception_handler(ServiceError)
    async def service_error(request: Request, e: ServiceError):
        return _error(e.status, e.code, public_message(service, e.message), retry_headers(e))

    @app.exception_handler(DiskFull)
    async def disk_full(request: Request, e: DiskFull):
        log.warning("%s", e.message)  # the operator's copy names the path
        return _error(e.status, e.code, public_message(service, e.message))

    @app.exception_handler(RequestValidationError)
    async def validation_error(request: Request, e: RequestValidationError):
        parts = []
        for err in e.errors()[:3]:
            parts.append(f"{'.'.join(str(x) for x in err['loc'])}: {err['msg']}")
        code = (
            "invalid_request_body"
            if any(err["type"] == "json_invalid" for err in e.errors())
            else "validation_failed"
        )
        return _error(400, code, "; ".join(parts))

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, e: StarletteHTTPException):
        code = {404: "not_found", 405: "method_not_allowed"}.get(e.status_code, "http_error")
        message = f"{request.method} {request.url.path}: {e.detail}"
        body = error_body(request.url.path, e.status_code, code, message)
        return JSONResponse(body, status_code=e.status_code, headers=e.headers)

    app.add_middleware(InternalErrors, shaped=error_body)  # innermost: what no exception handler takes
    app.add_middleware(
        BodyLimit, limit_for=body_limit, shaped=error_body, decodes=lambda p: p in tinker.ENCODED_BODY_PATHS
    )

    @app.head("/")
    @app.get("/")
    async def root(request: Request):
        if "text/html" in request.headers.get("accept", ""):  # a browser: the web console
            return RedirectResponse("/console", status_code=307)
        return {
            "service": "trine",
            "models": [m.name for m in service.queries.models()],
            "console": "/console",
        }

    @app.get("/health")
    async def health():
        """Liveness for load balancers and orchestrators (no key): 503 while shutting down."""
        draining = service.gate.draining
        body = {"status": "shutting_down" if draining else "ok", "free_bytes": service.free_space()}
        return JSONResponse(body, status_code=503 if draining else 200)

    prometheus = PrometheusEndpoint(service)  # this app's registry: tests run many apps in one process

    @app.get("/metrics")
    async def metrics():
        """Prometheus text (no key): per-route requests and latency, engine replicas' queues, KV
        cache and tokens by phase, clock cycles, free disk space and draining (http/prometheus.py)."""
        return await prometheus.response()

    # each request timed once: one INFO line on `trine.access`, and /metrics by route template
    app.add_middleware(Observed, observers=[log_request, HttpMetrics(prometheus.registry)])
    app.include_router(routes_control.router)
    app.include_router(routes_control.files_router)
    app.include_router(routes_actor.router)
    app.include_router(tinker.make_router())  # the Tinker API (/api/v1/...), same service and keys
    # metering: usage by phase with cost, for the caller's key only (GET /api/trine/v1/usage, /rates)
    app.state.rate_card = service.rate_card
    app.include_router(make_usage_router(_usage_ledger, context.api_key, app.state.rate_card))
    app.include_router(console.router)  # the web console at /console (pages and their JSON)
    app.include_router(routes_runs.router)  # logged metrics; runs with labels (`trine runs`)
    app.include_router(routes_adapters.router)  # adapter imports (`trine adapters import`)
    app.include_router(traces.router)  # session traces: files, signed URLs, the console's timeline
    # the OpenAI-compatible API: /v1/..., /api/openai/v1/..., /oai/api/v1/... (its own error shape)
    app.include_router(openai.router)
    for r in routers:
        app.include_router(r)
    return app


def _usage_ledger(request: Request) -> UsageLedger:
    return context.service_of(request).queries.ledger


def embedded_key(keys: Ownership, home: Path) -> str:
    """The key an embedded server hands its caller: kept in `home/embedded.key` (0600), created
    once; a fresh one replaces it if the stored one was revoked."""
    path = home / EMBEDDED_KEY_FILE
    if path.is_file():
        secret = path.read_text().strip()
        try:
            keys.authenticate(secret)
            return secret
        except Unauthorized:
            pass
    secret = keys.create_key("embedded")
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(secret)
    return secret


def resolve_models(models) -> dict[str, Path]:
    """`models`: a dict name -> dir, or a list of dirs / "NAME=DIR" strings. Name = directory name."""
    if isinstance(models, dict):
        return {str(k): Path(v) for k, v in models.items()}
    out: dict[str, Path] = {}
    for spec in models:
        spec = str(spec)
        name, _, path = spec.partition("=") if "=" in spec else ("", "", spec)
        path = Path(path).expanduser().resolve()
        if not (path / "config.json").is_file():
            raise ValueError(f"--model {spec!r}: {path} is not a model directory (no config.json)")
        name = name or path.name
        if name in out:
            raise ValueError(f"--model: two models are named {name!r}; name one with NAME=DIR")
        out[name] = path
    if not out:
        raise ValueError("--model: serve at least one model")
    return out


@dataclass
class ServerHandle:
    url: str
    api_key: str
    home: Path
    service: Service
    _server: uvicorn.Server
    _thread: threading.Thread

    def stop(self, timeout: float = 30.0) -> None:
        """Drain and stop (http/connections.py), within about `timeout` seconds."""
        self._server.shutdown_timeout = min(self._server.shutdown_timeout, timeout)
        self._server.should_exit = True
        self._thread.join(timeout)

    def __enter__(self) -> "ServerHandle":
        return self

    def __exit__(self, *exc) -> None:
        self.stop()


def start_server(
    models,
    *,
    home: str | Path | None = None,
    host: str = "127.0.0.1",
    port: int = 0,
    cycle_seconds: float = 0.0,
    routers: tuple[APIRouter, ...] = (),
    log_level: str = "warning",
    startup_timeout: float = 600.0,
    max_connections: int = MAX_CONNECTIONS,
    header_timeout: float = HEADER_TIMEOUT,
    shutdown_timeout: float = SHUTDOWN_TIMEOUT,
    **service_options,
) -> ServerHandle:
    """Serve `models` in a background thread; returns once the models are loaded and the port is open.

    home: the data dir (default `$TRINE_HOME` or ~/.trine). port 0 picks a free port.
    service_options go to `Service` (gather_seconds, key_limits, ...; the engine's options as one
    `engine=EngineConfig(...)`, engine/config.py).
    """
    home = trine_home(home)
    service = Service.open(home, resolve_models(models), cycle_seconds=cycle_seconds, **service_options)
    key = embedded_key(service.ownership, home)
    app = create_app(service, TokenSigner(home), routers=routers)
    # IPPROTO_TCP explicitly: asyncio sets TCP_NODELAY on accepted sockets only when proto says TCP
    sock = socket.socket(
        socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP
    )
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError:
        sock.close()
        service.close()  # and with it the data dir's claim
        raise
    bound = sock.getsockname()[1]
    service.serving_at(host, bound)  # the data dir's lock file names where its owner serves
    server = GuardedServer(
        uvicorn_config(
            app, log_level=log_level, max_connections=max_connections, header_timeout=header_timeout
        ),
        drain=service.drain,
        shutdown_timeout=shutdown_timeout,
    )
    errors: list[BaseException] = []

    def run():
        try:
            server.run(sockets=[sock])
        except BaseException as e:  # reported to the caller below
            errors.append(e)
        finally:
            service.close()

    thread = threading.Thread(target=run, name="trine-server", daemon=True)
    thread.start()
    deadline = time.monotonic() + startup_timeout
    while not server.started:
        if not thread.is_alive() or time.monotonic() > deadline:
            server.should_exit = True
            raise RuntimeError(f"trine server failed to start: {errors[0] if errors else 'see log'}")
        time.sleep(0.02)
    url_host = f"[{host}]" if ":" in host else host
    return ServerHandle(f"http://{url_host}:{bound}", key, home, service, server, thread)


def run_forever(
    app: FastAPI,
    host: str,
    port: int,
    log_level: str = "info",
    *,
    max_connections: int = MAX_CONNECTIONS,
    header_timeout: float = HEADER_TIMEOUT,
    shutdown_timeout: float = SHUTDOWN_TIMEOUT,
) -> None:
    """Serve in the foreground (the `trine serve` command) until interrupted; SIGTERM or Ctrl-C
    drains and exits within `shutdown_timeout` seconds (http/connections.py)."""
    GuardedServer(
        uvicorn_config(
            app,
            host=host,
            port=port,
            log_level=log_level,
            max_connections=max_connections,
            header_timeout=header_timeout,
        ),
        drain=app.state.service.drain,
        shutdown_timeout=shutdown_timeout,
        hard_exit=True,
    ).run()


__all__ = ["create_app", "start_server", "ServerHandle", "resolve_models", "embedded_key", "run_forever"]
