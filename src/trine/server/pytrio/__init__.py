"""The PyTRIO planes (the official `pytrio` 0.2.9 client, and the trine SDK): the control plane
(`/api/...`, JSON, API key; `routes_control.py`, trine's runs API in `routes_runs.py`) and the actor
plane (`/actor/v1/...`, MessagePack events and JSON samples, short-lived JWT; `routes_actor.py`).
Bodies in are `bodies.py`, their conversion into the engine's vocabulary is `to_api.py`, the answers out
are `shapes.py`. The routers are mounted by server/app.py."""
