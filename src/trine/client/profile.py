"""The server profile that the official client's `trio login` saves, read so the trine SDK finds it.

Where pytrio keeps it (pytrio 0.2.9, `pytrio/config/repository.py`): under `~/.pytrio/`, the
default profile in `config.toml`; a named profile (`trio env use NAME`) in `envs/NAME/config.toml`,
the active one named by `$PYTRIO_ENV` or `env.toml`'s `active_env`. A profile is a TOML table with
`api_key` and, unless it is pytrio's hosted service, `base_url`.

Reading never fails a client: an unreadable or malformed profile counts as no profile.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from pathlib import Path

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    import tomli as tomllib

_ENV_NAME = re.compile(r"^[A-Za-z0-9_-]+$")


@dataclass(frozen=True)
class Profile:
    api_key: str
    base_url: str  # "" when the profile names none (pytrio's hosted service)
    path: Path


def _read(path: Path) -> dict:
    try:
        with open(path, "rb") as f:
            return tomllib.load(f)
    except (OSError, tomllib.TOMLDecodeError):
        return {}


def profile_path(home: Path | None = None) -> Path:
    """The active profile's config.toml (it may not exist)."""
    root = (home or Path.home()) / ".pytrio"
    env = (
        os.environ.get("PYTRIO_ENV", "").strip()
        or str(_read(root / "env.toml").get("active_env", "")).strip()
    )
    if env in ("", "default", "(default)") or not _ENV_NAME.match(env):
        return root / "config.toml"
    return root / "envs" / env / "config.toml"


def load_profile(home: Path | None = None) -> Profile | None:
    """The active `trio login` profile, or None when there is none with an API key."""
    path = profile_path(home)
    data = _read(path)
    key, url = data.get("api_key"), data.get("base_url", "")
    if not isinstance(key, str) or not key.strip():
        return None
    return Profile(api_key=key.strip(), base_url=url.strip() if isinstance(url, str) else "", path=path)
