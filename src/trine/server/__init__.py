"""HTTP front ends over the service, one package per protocol (`pytrio/`, `tinker/`, `openai/`) plus
the web console (`console/`), over the protocol-free HTTP infrastructure of `http/`; `app.py`
assembles them into one app, `traces.py` serves session traces to all of them."""

from .app import ServerHandle, create_app, start_server

__all__ = ["ServerHandle", "create_app", "start_server"]
