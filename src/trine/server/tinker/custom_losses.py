"""Tinker's server-side custom losses (`create_custom_loss`, client config `custom_loss_server_side`).

The official client traces a per-datum loss with torch.fx and sends the graph as plain data. This
route checks it against trine's allowlist (engine/loss_graph.py, torch-free) and answers 400 naming
the first bad node, or keeps it for its session and resolves the future to its `loss_id`. A later
`forward_backward` with `loss_fn="custom"` and `loss_fn_config={"loss_id": ...}` runs it on the
server in one forward and one backward (routes_training.py).

Invariants
- The loss id is `<session>:loss:<custom_loss_seq_id>`, so a retried create (same body) joins the
  first; another body under the same seq id is a 409.
- A loss belongs to the key and session that created it; anyone else's forward_backward is refused.
- Losses live in memory, like the model ids: after a restart the client creates them again; a
  session keeps at most MAX_LOSSES_PER_SESSION.
"""

from __future__ import annotations

import hashlib
import json

from fastapi import APIRouter, Request

from ...engine.api import CustomLoss, parse_custom_loss
from ...service import ApiKey, Conflict, InvalidRequest
from ..http.context import json_object, parse_model
from .bodies import CreateCustomLossBody
from .futures import Reply
from .state import Model, StoredLoss, TinkerState, caller

router = APIRouter(prefix="/api/v1")
MAX_BODY_BYTES = 4 << 20
MAX_LOSSES_PER_SESSION = 256  # they live in memory: a session cannot grow it without bound


@router.post("/create_custom_loss")
async def create_custom_loss(request: Request):
    svc, st, key = caller(request)
    raw = await json_object(request, MAX_BODY_BYTES)
    b = parse_model(CreateCustomLossBody, raw)
    session = svc.ownership.session(key, b.session_id)
    loss_id = f"{session.id}:loss:{b.custom_loss_seq_id}"
    try:
        loss = parse_custom_loss(b.name, b.inputs, b.graph, loss_id)
    except ValueError as e:
        raise InvalidRequest(f"create_custom_loss: {e}", code="invalid_custom_loss") from None
    fingerprint = hashlib.sha256(json.dumps(raw, sort_keys=True).encode()).hexdigest()
    known = st.custom_losses.get(loss_id)
    if known is not None and known.fingerprint != fingerprint:
        raise Conflict(
            "custom_loss_seq_id: already used for another loss in this session", code="request_id_reused"
        )
    if known is None:
        if sum(s.session_id == session.id for s in st.custom_losses.values()) >= MAX_LOSSES_PER_SESSION:
            raise InvalidRequest(
                f"create_custom_loss: session {session.id} has {MAX_LOSSES_PER_SESSION} custom losses, the "
                "most one session keeps; reuse their handles or start a new session",
                code="too_many_custom_losses",
            )
        st.custom_losses[loss_id] = StoredLoss(key.id, session.id, loss, fingerprint)

    async def reply() -> Reply:
        return Reply.json({"type": "create_custom_loss", "loss_id": loss_id})

    request_id = f"cl-{loss_id}"
    st.futures.start(key.id, request_id, reply, fingerprint)
    return {"request_id": request_id}


def stored_loss(st: TinkerState, key: ApiKey, m: Model, config: dict) -> CustomLoss:
    """The custom loss a forward_backward names in `loss_fn_config`; InvalidRequest otherwise."""
    if set(config) != {"loss_id"} or not isinstance(config["loss_id"], str):
        raise InvalidRequest(
            'loss_fn_config: a custom loss takes {"loss_id": <the id create_custom_loss returned>}, '
            f"got keys {sorted(config)}"
        )
    stored = st.custom_losses.get(config["loss_id"])
    if stored is None or stored.api_key_id != key.id or stored.session_id != m.session_id:
        raise InvalidRequest(
            f"loss_fn_config.loss_id {config['loss_id'][:120]!r} is not a custom loss of this model's "
            "session: create it with create_custom_loss in the same session (losses do not survive a "
            "server restart)",
            code="custom_loss_not_found",
        )
    return stored.loss
