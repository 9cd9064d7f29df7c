"""API key strings: `trine-<43 base62 chars>` from 32 random bytes; only their sha256 is stored.

Every key also has a Tinker form, `tml-` + the key (`tml-trine-...`), because the official `tinker`
client refuses keys that do not start with `tml-`. Both forms carry the same secret and name the
same key: the prefix is stripped before hashing, so it adds nothing an attacker could guess.
"""

from __future__ import annotations

import hashlib
import secrets

KEY_PREFIX = "trine-"
TINKER_PREFIX = "tml-"
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


def tinker_form(key: str) -> str:
    """The form of `key` the tinker SDK accepts (`TINKER_API_KEY`)."""
    return key if key.startswith(TINKER_PREFIX) else TINKER_PREFIX + key


def canonical_key(key: str) -> str:
    """The trine form of a key given in either form."""
    return key[len(TINKER_PREFIX) :] if key.startswith(TINKER_PREFIX + KEY_PREFIX) else key


def hash_key(key: str) -> str:
    """The stored hash; equal for both forms of a key."""
    return hashlib.sha256(canonical_key(key).encode()).hexdigest()


def new_id(prefix: str, nbytes: int = 9) -> str:
    """An opaque id like `tr_4Fz9...`: letters, digits and `_` only (pytrio's telemetry checks this)."""
    return f"{prefix}_{base62(secrets.token_bytes(nbytes))}"
