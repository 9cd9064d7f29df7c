"""API key strings: `trine-<43 base62 chars>` from 32 random bytes; only their sha256 is stored."""
from __future__ import annotations

import hashlib
import secrets

KEY_PREFIX = "trine-"
_ALPHABET = "0123456789ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz"


def base62(data: bytes) -> str:
    n = int.from_bytes(data, "big")
    out = []
    while n:
        n, r = divmod(n, 62)
        out.append(_ALPHABET[r])
    return "".join(reversed(out)) or "0"


def generate_key() -> str:
    """A new secret key string. It is shown to the user once and never stored."""
    return KEY_PREFIX + base62(secrets.token_bytes(32)).rjust(43, "0")


def hash_key(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()


def new_id(prefix: str, nbytes: int = 9) -> str:
    """An opaque id like `tr_4Fz9...`: letters, digits and `_` only (pytrio's telemetry checks this)."""
    return f"{prefix}_{base62(secrets.token_bytes(nbytes))}"
