"""Credentials: API keys on the control plane, signed short-lived JWTs (HS256) on the actor plane.

The signing secret is 32 random bytes in `$TRINE_HOME/secret.key` (mode 0600), created on first use,
so tokens survive a restart and nobody without the data dir can mint one. A token names its API key,
its subject (a run or a checkpoint) and its kind; it expires after `ttl` seconds.
"""

from __future__ import annotations

import os
import secrets
import time
from datetime import datetime, timezone
from pathlib import Path

import jwt

from ...service.errors import Unauthorized

ALGORITHM = "HS256"


def iso(ts: float | None) -> str | None:
    """Unix seconds -> ISO-8601 UTC with a `Z`, as PyTRIO expects datetimes."""
    if ts is None:
        return None
    return datetime.fromtimestamp(ts, timezone.utc).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


class TokenSigner:
    def __init__(self, home: str | Path, ttl: float = 3600.0):
        self.ttl = ttl
        path = Path(home) / "secret.key"
        if not path.is_file():
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
            with os.fdopen(fd, "w") as f:
                f.write(secrets.token_hex(32))
        self._secret = bytes.fromhex(path.read_text().strip())

    def issue(self, *, key_id: str, subject: str, kind: str, ttl: float | None = None) -> tuple[str, float]:
        """A token and its expiry (unix seconds)."""
        exp = time.time() + (ttl or self.ttl)
        token = jwt.encode(
            {"key": key_id, "sub": subject, "kind": kind, "exp": int(exp)}, self._secret, algorithm=ALGORITHM
        )
        return token, float(int(exp))

    def verify(self, token: str | None, kind: str | tuple[str, ...], url: str = "") -> dict:
        """The token's claims. `url` names the signed URL it came in (`download URL`): the refusals
        then say to ask for a new one, not to renew an actor token."""
        what = f"this {url}'s token" if url else "the actor token"
        renew = f"ask for a new {url}" if url else "renew it through the control plane"
        if not token:
            if url:
                raise Unauthorized(f"this {url} lacks its ?token=: use the whole URL, or {renew}")
            raise Unauthorized(f"send the actor token as `Authorization: Bearer <token>` ({renew})")
        try:
            claims = jwt.decode(
                token,
                self._secret,
                algorithms=[ALGORITHM],
                options={"require": ["exp", "sub", "key", "kind"]},
            )
        except jwt.ExpiredSignatureError:
            raise Unauthorized(f"{what} expired; {renew}", code="token_expired") from None
        except jwt.InvalidTokenError:
            fix = f"; {renew}" if url else ""
            raise Unauthorized(f"{what} is not valid for this server{fix}", code="invalid_token") from None
        kinds = (kind,) if isinstance(kind, str) else kind
        if claims["kind"] not in kinds:
            raise Unauthorized(
                f"this token is for a {claims['kind']} endpoint, not this one", code="invalid_token"
            )
        return claims


def bearer(header: str | None) -> str | None:
    if header and header[:7].lower() == "bearer ":
        return header[7:].strip() or None
    return None
