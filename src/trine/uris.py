"""Checkpoint URIs: trine's `trio://<run>/<state|weights|external>/<name>` and Tinker's form of the
same thing.

Tinker names a checkpoint `tinker://<run>/<weights|sampler_weights|external_weights>/<name>`: its
`weights` is a training state (trine's `state`), its `sampler_weights` are sampler weights (trine's
`weights`), its `external_weights` a merged Hugging Face model (trine's `external`). Both
front ends, the OpenAI routes and the SDK map with these two pure functions (no server imports), so
every surface accepts both forms. Invariant: `to_tinker_path(to_trio_uri(p)) == p` for a valid `p`.
"""

from __future__ import annotations

TRIO_SCHEME = "trio://"
TINKER_SCHEME = "tinker://"
_TO_TRIO = {"weights": "state", "sampler_weights": "weights", "external_weights": "external"}
_TO_TINKER = {v: k for k, v in _TO_TRIO.items()}


def to_trio_uri(path: str, field: str = "path") -> str:
    """`tinker://<run>/weights/<name>` -> `trio://<run>/state/<name>` (sampler_weights -> weights);
    a well-formed trio:// URI is already in that form. Raises ValueError naming `field` (the request
    field that carried `path`) and the expected form for anything else."""
    if isinstance(path, str) and path.startswith(TRIO_SCHEME):
        parts = path[len(TRIO_SCHEME) :].split("/")
        if len(parts) == 3 and parts[1] in _TO_TINKER and parts[0] and parts[2]:
            return path
    if not isinstance(path, str) or not path.startswith(TINKER_SCHEME):
        raise ValueError(
            f"{field} {path!r}: use a tinker://<run>/<weights|sampler_weights>/<name> path "
            "returned by save_state or save_weights_for_sampler (or an external_weights path)"
        )
    parts = path[len(TINKER_SCHEME) :].split("/")
    if len(parts) != 3 or parts[1] not in _TO_TRIO or not parts[0] or not parts[2]:
        raise ValueError(
            f"{field} {path!r}: expected tinker://<run>/<weights|sampler_weights|external_weights>/<name>"
        )
    return f"{TRIO_SCHEME}{parts[0]}/{_TO_TRIO[parts[1]]}/{parts[2]}"


def to_tinker_path(uri: str) -> str:
    """`trio://<run>/state/<name>` -> `tinker://<run>/weights/<name>` (weights -> sampler_weights)."""
    run, kind, name = uri[len(TRIO_SCHEME) :].split("/", 2)
    return f"{TINKER_SCHEME}{run}/{_TO_TINKER[kind]}/{name}"


def as_trio_uri(path: str) -> str:
    """A checkpoint path in trio:// form: a tinker:// path is mapped, anything else is returned as is."""
    return to_trio_uri(path) if isinstance(path, str) and path.startswith(TINKER_SCHEME) else path
