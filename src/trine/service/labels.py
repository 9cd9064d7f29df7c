"""Run labels: a session's or training run's name, tags and user metadata, checked and stored.

Invariants
- A name is at most MAX_NAME_CHARS characters; at most MAX_TAGS tags of at most MAX_TAG_CHARS
  each, without commas; metadata is at most MAX_METADATA_KEYS string keys with values kept as
  strings. Anything else is an InvalidRequest naming the field.
- `user_metadata["name"]` and `user_metadata["tags"]` (comma-separated, or a list) are the name and
  tags when the protocol carries only metadata (Tinker's `user_metadata`); explicit ones win. Those
  two keys are not kept in the metadata: `as_metadata` writes the labels back under them.
- A training run inherits its session's labels: the session's tags and metadata join its own, and
  the session's name names it when it has none.
"""

from __future__ import annotations

import json

from .commands import RunLabels
from .errors import InvalidRequest

MAX_NAME_CHARS = 200
MAX_TAGS = 32
MAX_TAG_CHARS = 64
MAX_METADATA_KEYS = 64
MAX_METADATA_VALUE_CHARS = 1024


def checked(labels: RunLabels, field: str = "") -> RunLabels:
    """The labels with name and tags taken from the metadata where not given, every bound checked."""
    at = f"{field}." if field else ""
    meta = labels.user_metadata if labels.user_metadata is not None else {}
    if not isinstance(meta, dict):
        raise InvalidRequest(f"{at}user_metadata: send an object of strings, got {type(meta).__name__}")
    if len(meta) > MAX_METADATA_KEYS:
        raise InvalidRequest(f"{at}user_metadata: {len(meta)} keys; at most {MAX_METADATA_KEYS} are allowed")
    clean = {}
    for k, v in meta.items():
        v = v if isinstance(v, str) else json.dumps(v)
        if not isinstance(k, str) or len(k) > MAX_TAG_CHARS or len(v) > MAX_METADATA_VALUE_CHARS:
            raise InvalidRequest(
                f"{at}user_metadata[{str(k)[:80]!r}]: keys are strings of at most "
                f"{MAX_TAG_CHARS} characters, values at most {MAX_METADATA_VALUE_CHARS}"
            )
        clean[k] = v
    name = labels.name or clean.get("name", "")
    if not isinstance(name, str) or len(name) > MAX_NAME_CHARS:
        raise InvalidRequest(f"{at}name: a string of at most {MAX_NAME_CHARS} characters")
    tags = labels.tags if labels.tags else _tags_of(meta.get("tags", ""))
    if isinstance(tags, str) or not all(isinstance(t, str) for t in tags):
        raise InvalidRequest(f"{at}tags: send a list of strings")
    tags = _unique(t.strip() for t in tags if t.strip())
    if len(tags) > MAX_TAGS or any(len(t) > MAX_TAG_CHARS or "," in t for t in tags):
        raise InvalidRequest(
            f"{at}tags: at most {MAX_TAGS} tags of at most {MAX_TAG_CHARS} characters, without commas"
        )
    for k in ("name", "tags"):  # held as the labels themselves (`as_metadata` puts them back)
        clean.pop(k, None)
    return RunLabels(name.strip(), tuple(tags), clean)


def inherit(own: RunLabels, session: RunLabels) -> RunLabels:
    """A run's labels with its session's (see the module docstring)."""
    return RunLabels(
        own.name or session.name,
        tuple(_unique([*session.tags, *own.tags])),
        {**session.user_metadata, **own.user_metadata},
    )


def stored(labels: RunLabels) -> dict:
    """The record fields (`name`, `tags`, `user_metadata`) of checked labels."""
    return {
        "name": labels.name,
        "tags": json.dumps(list(labels.tags)) if labels.tags else "",
        "user_metadata": json.dumps(labels.user_metadata) if labels.user_metadata else "",
    }


def of_record(rec) -> RunLabels:
    """The labels a session or training run record holds."""
    return RunLabels(
        rec.name or "",
        tuple(json.loads(rec.tags)) if rec.tags else (),
        json.loads(rec.user_metadata) if rec.user_metadata else {},
    )


def _tags_of(value) -> list:
    """Tags carried in metadata: a comma-separated string (Tinker's str values), or a list."""
    return value.split(",") if isinstance(value, str) else value if isinstance(value, list) else [value]


def _unique(items) -> list[str]:
    return list(dict.fromkeys(items))


def as_metadata(rec) -> dict[str, str]:
    """A record's labels as one string map (its metadata, with `name` and comma-joined `tags`), the
    shape of the protocols' `user_metadata` fields; {} when it has none."""
    lab = of_record(rec)
    out = dict(lab.user_metadata)
    if lab.name:
        out["name"] = lab.name
    if lab.tags:
        out["tags"] = ",".join(lab.tags)
    return out
