"""What every plane's error answer shares, whatever its body's shape (PyTRIO `{code, message}`,
Tinker's, OpenAI's `{"error": {...}}`): when to come back, and a message with no server paths.

Invariants
- A refusal that says when to retry (`ShuttingDown.retry_after`: a draining server) carries
  `Retry-After` on every plane, so every client backs off until the restart.
- No message leaves with an absolute path of the server's files: the data dir, the checkpoint dir
  and each served model's directory are named by what they are (a model by its name). Operators
  find the paths in the server's own log and `trine serve`'s banner. The exceptions are fields,
  not messages: the tokenizer directory an official client loads its tokenizer from (PyTRIO's
  `model_id`, pytrio/shapes.py; Tinker's sampler `base_model`, tinker/routes_sampling.py).
"""

from __future__ import annotations


def retry_headers(e: BaseException) -> dict[str, str] | None:
    """`Retry-After` for an error that says when to come back (seconds), else None."""
    seconds = getattr(e, "retry_after", None)
    return {"Retry-After": str(int(seconds))} if seconds else None


def _roots(service) -> list[tuple[str, str]]:
    """(absolute path, its public name) for every server path a message may name, longest first."""
    out: dict[str, str] = {}
    for path, name in service.named_paths() if service is not None else ():
        for form in (str(path), str(path.resolve())):
            out.setdefault(form, name)
    return sorted(out.items(), key=lambda kv: -len(kv[0]))


def public_message(service, message: str) -> str:
    """`message` with the server's own paths replaced by their names (see the module docstring)."""
    for path, name in _roots(service):
        if path and path != "/" and path in message:
            message = message.replace(path, name)
    return message
