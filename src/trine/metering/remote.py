"""Read usage, rates and the model list from a running trine server (what `trine usage/models --url` use)."""

from __future__ import annotations

import os

import httpx


def server_url(url: str | None) -> str | None:
    """The service root from --url or $TRINE_BASE_URL, normalised like the PyTRIO client ("/", "/api" cut)."""
    url = (url or os.environ.get("TRINE_BASE_URL") or "").strip().rstrip("/")
    if url.endswith("/api"):
        url = url[:-4]
    return url or None


def api_key(key: str | None) -> str:
    key = key or os.environ.get("TRINE_API_KEY") or os.environ.get("PYTRIO_API_KEY")
    if not key:
        raise ValueError("api key: pass --api-key or set TRINE_API_KEY to read from a server")
    return key


def get_json(url: str, key: str, path: str, params: dict | None = None, timeout: float = 30.0) -> dict:
    """GET {url}{path} with the API key (sent as X-API-Key and Bearer, like the PyTRIO client)."""
    params = {k: v for k, v in (params or {}).items() if v is not None}
    try:
        r = httpx.get(
            url + path,
            params=params,
            timeout=timeout,
            headers={"X-API-Key": key, "Authorization": f"Bearer {key}"},
        )
    except httpx.HTTPError as e:
        raise ConnectionError(f"cannot reach the trine server at {url}: {e}") from None
    if r.status_code >= 400:
        try:
            msg = r.json().get("message") or r.text
        except ValueError:
            msg = r.text
        raise ValueError(f"{url}{path} answered {r.status_code}: {msg}")
    return r.json()


def models(url: str, key: str) -> list[dict]:
    """Every item of the server's model catalogue (GET /api/models, paged like the PyTRIO client)."""
    items: list[dict] = []
    while True:
        page = get_json(url, key, "/api/models", {"limit": 100, "offset": len(items)})
        items += page["items"]
        if not page["items"] or len(items) >= page["total"]:
            return items
