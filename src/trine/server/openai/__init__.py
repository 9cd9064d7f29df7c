"""The OpenAI-compatible API on trine's port: chat and completions on base models and trained
sampler checkpoints (see routes.py). `router` is mounted by server/app.py."""

from .errors import OpenAIError
from .routes import API_PREFIX, PREFIXES, router, serves

__all__ = ["router", "API_PREFIX", "PREFIXES", "OpenAIError", "serves"]
