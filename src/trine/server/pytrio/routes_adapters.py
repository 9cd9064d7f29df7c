"""Importing a PEFT adapter trained elsewhere (trine's own route; `trine adapters import` and the SDK's
`lora_path=` send it):

    POST /api/trine/v1/adapters?base_model=NAME[&name=NAME]   body: a tar of the PEFT directory

The archive holds `adapter_config.json` and `adapter_model.safetensors` (at its top or in one
folder; other members are ignored, and only regular files are read, by their base names, so nothing
is written outside a temporary directory). A truncated or corrupt archive, or one that unpacks to more
than `MAX_ADAPTER_UPLOAD_BYTES` (a decompression bomb: refused before that much is unpacked), is a 400
naming the body. The service checks the adapter against the model before
anything is stored (service/imports.py); a mismatch is a 400 `adapter_invalid` naming the tensor and
the shape the model needs. The answer is the new checkpoint, as the PyTRIO checkpoint listing shows
it, with its `source`.
"""

from __future__ import annotations

import asyncio
import io
import lzma
import tarfile
import zlib
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
        await asyncio.get_running_loop().run_in_executor(None, _extract, archive, directory)
        origin = f"uploaded as {filename}" if filename else "uploaded"
        ck = await svc.imports.adapter(
            key, base_model=base_model, name=name, directory=directory, origin=origin
        )
    return checkpoint_json(svc, ck)


# what tarfile and its decompressors raise on a truncated or corrupt archive (read from memory: an
# OSError here is bad data, e.g. gzip's BadGzipFile, never the disk)
ARCHIVE_ERRORS = (tarfile.TarError, EOFError, OSError, zlib.error, lzma.LZMAError)


def _extract(archive: bytes, into: Path) -> None:
    """The PEFT files of a tar archive into `into`, by their base names; anything else is skipped.
    Blocking (decompression): run it off the event loop."""
    try:
        tf = tarfile.open(fileobj=io.BytesIO(archive))
    except tarfile.TarError:
        raise InvalidRequest(
            "body: send the adapter directory as a tar archive (adapter_config.json and "
            "adapter_model.safetensors)",
            code="invalid_request_body",
        ) from None
    unpacked = 0
    with tf:
        while (member := _reading(tf.next)) is not None:
            unpacked += tarfile.BLOCKSIZE + member.size  # counted before a byte of it is unpacked
            if unpacked > MAX_ADAPTER_UPLOAD_BYTES:
                raise InvalidRequest(
                    f"body: the archive unpacks to more than {MAX_ADAPTER_UPLOAD_BYTES} bytes (at its "
                    f"member {member.name!r}); send the adapter's two files uncompressed or smaller",
                    code="invalid_request_body",
                )
            base = Path(member.name).name
            if member.isfile() and base in ADAPTER_FILES:
                with _reading(tf.extractfile, member) as src, open(into / base, "wb") as dst:
                    while chunk := _reading(src.read, 1 << 20):
                        dst.write(chunk)


def _reading(read, *args):
    """`read(*args)` on the archive; its truncated or corrupt data a 400 naming the body."""
    try:
        return read(*args)
    except ARCHIVE_ERRORS as e:
        raise InvalidRequest(
            f"body: the tar archive is truncated or corrupt ({type(e).__name__}: {e}); send the "
            "adapter directory as a whole tar archive",
            code="invalid_request_body",
        ) from None
