"""Importing a PEFT adapter trained elsewhere (trine's own route; `trine adapters import` and the SDK's
`lora_path=` send it):

    POST /api/trine/v1/adapters?base_model=NAME[&name=NAME]   body: a tar of the PEFT directory

The archive holds `adapter_config.json` and `adapter_model.safetensors` (at its top or in one
folder; other members are ignored, and only regular files are read, by their base names, so nothing
is written outside a temporary directory). The service checks the adapter against the model before
anything is stored (service/imports.py); a mismatch is a 400 `adapter_invalid` naming the tensor and
the shape the model needs. The answer is the new checkpoint, as the PyTRIO checkpoint listing shows
it, with its `source`.
"""

from __future__ import annotations

import io
import shutil
import tarfile
from pathlib import Path

from fastapi import APIRouter, Depends, Query, Request

from ...limits import MAX_ADAPTER_UPLOAD_BYTES
from ...service import ApiKey, InvalidRequest
from ..http.context import api_key, read_body, service_of
from .shapes import checkpoint_json

ADAPTERS_PATH = "/api/trine/v1/adapters"
ADAPTER_FILES = ("adapter_config.json", "adapter_model.safetensors")

router = APIRouter()


@router.post(ADAPTERS_PATH)
async def import_adapter(
    request: Request,
    base_model: str = Query(min_length=1),
    name: str = Query("adapter"),
    filename: str = Query("", max_length=200),
    key: ApiKey = Depends(api_key),
):
    svc = service_of(request)
    archive = await read_body(request, MAX_ADAPTER_UPLOAD_BYTES)
    with svc.imports.workdir() as tmp:
        directory = Path(tmp)
        _extract(archive, directory)
        origin = f"uploaded as {filename}" if filename else "uploaded"
        ck = await svc.imports.adapter(
            key, base_model=base_model, name=name, directory=directory, origin=origin
        )
    return checkpoint_json(svc, ck)


def _extract(archive: bytes, into: Path) -> None:
    """The PEFT files of a tar archive into `into`, by their base names; anything else is skipped."""
    try:
        tf = tarfile.open(fileobj=io.BytesIO(archive))
    except tarfile.TarError:
        raise InvalidRequest(
            "body: send the adapter directory as a tar archive (adapter_config.json and "
            "adapter_model.safetensors)",
            code="invalid_request_body",
        ) from None
    with tf:
        for member in tf.getmembers():
            base = Path(member.name).name
            if member.isfile() and base in ADAPTER_FILES:
                with tf.extractfile(member) as src, open(into / base, "wb") as dst:
                    shutil.copyfileobj(src, dst)
