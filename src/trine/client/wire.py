"""Encoding between the public types and the PyTRIO wire (msgpack events, JSON sampling).

Wire tensors are maps with exactly {dtype, shape, encoding, data: bin}; model inputs are
`{"chunks": [...]}` with image bytes as msgpack bin (events) or base64 (JSON).
"""

from __future__ import annotations

import base64
import secrets
import time

import msgpack
import numpy as np

from ..types import EncodedTextChunk, ModelInput, TensorData

EVENT_ID_ALPHABET = "0123456789abcdefghjkmnpqrstvwxyz"
SDK_NAME = "trine"


def new_event_id() -> str:
    return "event_" + "".join(secrets.choice(EVENT_ID_ALPHABET) for _ in range(12))


def new_request_id() -> str:
    return "req_" + secrets.token_hex(16)


def model_input_to_wire(model_input: ModelInput, *, json: bool) -> dict:
    chunks = []
    for c in model_input.chunks:
        if isinstance(c, EncodedTextChunk):
            chunks.append({"type": "encoded_text", "tokens": list(c.tokens)})
        else:
            chunk = {
                "type": "image",
                "format": c.format,
                "data": base64.b64encode(c.data).decode("ascii") if json else c.data,
            }
            if json or c.expected_tokens is not None:
                chunk["expected_tokens"] = c.expected_tokens
            chunks.append(chunk)
    return {"chunks": chunks}


def tensor_from_wire(t: dict) -> TensorData:
    """A wire tensor (bytes + numpy dtype string + shape) as float32 / int64 TensorData."""
    if set(t) != {"dtype", "shape", "encoding", "data"} or not isinstance(t["data"], (bytes, bytearray)):
        raise ValueError(f"malformed wire tensor: keys {sorted(t)}")
    arr = np.frombuffer(t["data"], dtype=np.dtype(t["dtype"])).reshape(t["shape"])
    return TensorData.from_numpy(arr)


def event_envelope(
    event_type: str, payload: dict, *, event_id: str, index: int, step: int, run_id: str, sdk_version: str
) -> bytes:
    body = {
        "version": 1,
        "event_id": event_id,
        "type": event_type,
        "metadata": {
            "index": index,
            "step": step,
            "timestamp": int(time.time() * 1000),
            "sdk": SDK_NAME,
            "sdk_version": sdk_version,
            "run_id": run_id,
        },
        "payload": _drop_none(payload),
    }
    return msgpack.packb(body, use_bin_type=True)


def _drop_none(value):
    if isinstance(value, dict):
        return {k: _drop_none(v) for k, v in value.items() if v is not None}
    if isinstance(value, list):
        return [_drop_none(v) for v in value]
    return value


def decode_body(content: bytes, content_type: str) -> object:
    """Actor responses: JSON if the content type says so, otherwise msgpack."""
    import json

    if "application/json" in content_type:
        return json.loads(content) if content.strip() else {}
    return msgpack.unpackb(content, raw=False)
