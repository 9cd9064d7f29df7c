"""RestClient: metadata of runs, sessions, samplers and checkpoints, checkpoint downloads and
session traces. Every method returns an APIFuture (`.result()` or `await`); `*_async` methods
return the value."""

from __future__ import annotations

import asyncio
import io
import os
import shutil
import tarfile
from pathlib import Path
from typing import TYPE_CHECKING

from ..errors import TrineError, ValidationError
from ..types import (
    Checkpoint,
    CheckpointArchiveUrlResponse,
    CheckpointDownloadResult,
    CheckpointDownloadSource,
    CheckpointsListResponse,
    Cursor,
    GetSamplerResponse,
    GetSessionResponse,
    ListSessionsResponse,
    TrainingRun,
    TrainingRunsResponse,
)
from .futures import APIFuture

if TYPE_CHECKING:
    from .service import Session


def _require(name: str, value: str) -> None:
    if not isinstance(value, str) or not value:
        raise ValidationError(f"{name} must be a non-empty str, got {value!r}")


def _cursor(c: dict) -> Cursor:
    return Cursor(offset=c["offset"], limit=c["limit"], total_count=c["total"])


def _checkpoint(c: dict) -> Checkpoint:
    kind = {"TRAINING": "training", "SAMPLER": "sampler", "EXTERNAL": "external"}.get(c["checkpoint_type"])
    if kind is None:
        raise TrineError(f"unknown checkpoint_type {c['checkpoint_type']!r}", code="invalid_response")
    return Checkpoint(
        checkpoint_id=c["checkpoint_cuid"],
        checkpoint_type=kind,
        time=c["created_at"],
        path=c["checkpoint_uri"],
        size_bytes=c.get("size_bytes"),
        expires_at=c.get("expired_at"),
        source=c.get("source") or None,
    )


def _training_run(r: dict) -> TrainingRun:
    rank = r.get("lora_rank") or 0
    return TrainingRun(
        training_run_id=r["training_run_cuid"],
        base_model=r["base_model"],
        model_owner=r["workspace_cuid"],
        is_lora=r["is_lora"],
        corrupted=r.get("corrupted", False),
        lora_rank=rank if r["is_lora"] and rank > 0 else None,
        last_request_time=r["updated_at"],
        user_metadata=r.get("user_metadata"),
    )


class RestClient:
    def __init__(self, session: Session):
        self._session = session
        self._rt = session.runtime
        self._control = session.runtime.control

    def _future(self, coro) -> APIFuture:
        return APIFuture(self._rt.spawn(coro))

    # -- training runs -------------------------------------------------------------------------

    async def get_training_run_async(self, training_run_id: str, access_scope: str = "owned") -> TrainingRun:
        _require("training_run_id", training_run_id)
        r = await self._rt.run_async(
            self._control.call(
                "GET", f"openapi/v1/training-runs/{training_run_id}", params={"access_scope": access_scope}
            )
        )
        return _training_run(r)

    def get_training_run(self, training_run_id: str, access_scope: str = "owned") -> APIFuture[TrainingRun]:
        _require("training_run_id", training_run_id)
        return self._future(self.get_training_run_async(training_run_id, access_scope))

    async def list_training_runs_async(
        self, limit: int = 20, offset: int = 0, access_scope: str = "owned"
    ) -> TrainingRunsResponse:
        r = await self._rt.run_async(
            self._control.call(
                "GET",
                "openapi/v1/training-runs",
                params={"limit": limit, "offset": offset, "access_scope": access_scope},
            )
        )
        return TrainingRunsResponse(
            training_runs=[_training_run(x) for x in r["training_runs"]], cursor=_cursor(r["cursor"])
        )

    def list_training_runs(
        self, limit: int = 20, offset: int = 0, access_scope: str = "owned"
    ) -> APIFuture[TrainingRunsResponse]:
        return self._future(self.list_training_runs_async(limit, offset, access_scope))

    # -- checkpoints ---------------------------------------------------------------------------

    async def import_adapter_async(
        self, path: str | os.PathLike, base_model: str, name: str | None = None
    ) -> Checkpoint:
        """Upload the PEFT adapter directory `path` (adapter_config.json + adapter_model.safetensors)
        trained on `base_model`, as checkpoint `name` (default: the directory's name): the server
        checks it against the model and keeps it as a sampler checkpoint (sample it, train from
        it, export it). A mismatch raises naming the tensor and the shape the model needs."""
        _require("base_model", base_model)
        path = Path(path)
        archive = adapter_archive(path)
        params = {"base_model": base_model, "name": name or checkpoint_name(path.resolve().name)}
        c = await self._rt.run_async(
            self._control.call(
                "POST",
                "trine/v1/adapters",
                params={**params, "filename": path.name},
                content=archive,
                retry=False,  # an import is not idempotent: a retry would make a second checkpoint
            )
        )
        return _checkpoint(c)

    def import_adapter(
        self, path: str | os.PathLike, base_model: str, name: str | None = None
    ) -> APIFuture[Checkpoint]:
        return self._future(self.import_adapter_async(path, base_model, name))

    async def list_checkpoints_async(self, training_run_id: str) -> CheckpointsListResponse:
        """Every checkpoint of one run (all pages)."""
        _require("training_run_id", training_run_id)
        items: list[dict] = []
        offset = 0
        while True:
            page = await self._rt.run_async(
                self._control.call(
                    "GET",
                    f"openapi/v1/training-runs/{training_run_id}/checkpoints",
                    params={"limit": 200, "offset": offset},
                )
            )
            items += page["checkpoints"]
            cursor = page["cursor"]
            offset = cursor["offset"] + cursor["limit"]
            if not page["checkpoints"] or offset >= cursor["total"]:
                break
        return CheckpointsListResponse(checkpoints=[_checkpoint(c) for c in items])

    def list_checkpoints(self, training_run_id: str) -> APIFuture[CheckpointsListResponse]:
        _require("training_run_id", training_run_id)
        return self._future(self.list_checkpoints_async(training_run_id))

    async def list_user_checkpoints_async(self, limit: int = 100, offset: int = 0) -> CheckpointsListResponse:
        page = await self._rt.run_async(
            self._control.call("GET", "openapi/v1/checkpoints", params={"limit": limit, "offset": offset})
        )
        return CheckpointsListResponse(
            checkpoints=[_checkpoint(c) for c in page["checkpoints"]], cursor=_cursor(page["cursor"])
        )

    def list_user_checkpoints(self, limit: int = 100, offset: int = 0) -> APIFuture[CheckpointsListResponse]:
        return self._future(self.list_user_checkpoints_async(limit, offset))

    async def get_checkpoint_download_url_async(self, checkpoint_id: str) -> CheckpointDownloadSource:
        _require("checkpoint_id", checkpoint_id)
        r = await self._rt.run_async(
            self._control.call("GET", f"openapi/v1/checkpoints/{checkpoint_id}/download-url")
        )
        return CheckpointDownloadSource(
            checkpoint_id=checkpoint_id,
            url=r["url"],
            expires=r["expires_at"],
            source=r["source"],
            checkpoint_status=r["checkpoint_status"],
            tls_cert_pem=r.get("tls_cert_pem"),
            tls_not_after=r.get("tls_not_after"),
        )

    def get_checkpoint_download_url(self, checkpoint_id: str) -> APIFuture[CheckpointDownloadSource]:
        _require("checkpoint_id", checkpoint_id)
        return self._future(self.get_checkpoint_download_url_async(checkpoint_id))

    async def get_checkpoint_archive_url_async(self, checkpoint_id: str) -> CheckpointArchiveUrlResponse:
        source = await self.get_checkpoint_download_url_async(checkpoint_id)
        return CheckpointArchiveUrlResponse(url=source.url, expires=source.expires)

    def get_checkpoint_archive_url(self, checkpoint_id: str) -> APIFuture[CheckpointArchiveUrlResponse]:
        _require("checkpoint_id", checkpoint_id)
        return self._future(self.get_checkpoint_archive_url_async(checkpoint_id))

    async def _download(self, checkpoint_id: str, path: Path, resume: bool) -> CheckpointDownloadResult:
        source = await self.get_checkpoint_download_url_async(checkpoint_id)
        start = path.stat().st_size if resume and path.is_file() else 0
        headers = {"Range": f"bytes={start}-"} if start else {}
        path.parent.mkdir(parents=True, exist_ok=True)
        written = 0
        async with self._rt.actor_http.stream(
            "GET", source.url, headers=headers, follow_redirects=True, timeout=None
        ) as r:
            if r.status_code == 416 and start:
                status, resumed = 416, True
            elif r.status_code in (200, 206):
                resumed = r.status_code == 206
                status = r.status_code
                with path.open("ab" if resumed else "wb") as f:
                    async for block in r.aiter_bytes():
                        f.write(block)
                        written += len(block)
            else:
                await r.aread()
                raise TrineError(
                    f"checkpoint download failed with HTTP {r.status_code}", status_code=r.status_code
                )
        return CheckpointDownloadResult(
            checkpoint_id=checkpoint_id,
            path=str(path),
            bytes_written=written,
            file_size_bytes=path.stat().st_size,
            status_code=status,
            resumed=resumed,
        )

    async def _download_into(self, checkpoint_id: str, directory: Path) -> CheckpointDownloadResult:
        """Download the archive next to `directory`'s files and extract them into it: the directory
        then holds the checkpoint's files (a PEFT adapter: adapter_config.json, adapter_model.safetensors)."""
        directory.mkdir(parents=True, exist_ok=True)
        archive = directory / f".{checkpoint_id}.tar.part"
        result = await self._download(checkpoint_id, archive, resume=True)
        try:
            files = await asyncio.get_running_loop().run_in_executor(
                None, extract_checkpoint, archive, directory
            )
        finally:
            archive.unlink(missing_ok=True)
        return result.model_copy(
            update={"path": str(directory), "file_size_bytes": sum(f.stat().st_size for f in files)}
        )

    def _download_job(self, checkpoint_id: str, destination_path: str | Path, resume: bool):
        if str(destination_path).endswith(("/", os.sep)) or Path(destination_path).is_dir():
            return self._download_into(checkpoint_id, Path(destination_path))
        return self._download(checkpoint_id, Path(destination_path), resume)

    async def download_checkpoint_async(
        self, checkpoint_id: str, destination_path: str | Path, *, resume: bool = True
    ) -> CheckpointDownloadResult:
        _require("checkpoint_id", checkpoint_id)
        return await self._rt.run_async(self._download_job(checkpoint_id, destination_path, resume))

    def download_checkpoint(
        self, checkpoint_id: str, destination_path: str | Path, *, resume: bool = True
    ) -> APIFuture[CheckpointDownloadResult]:
        """Download a checkpoint. Into a directory (one that exists, or a path ending in `/`): its
        files are extracted there, ready for `peft`. Otherwise `destination_path` is the tar archive
        itself (resuming a partial file)."""
        _require("checkpoint_id", checkpoint_id)
        return self._future(self._download_job(checkpoint_id, destination_path, resume))

    async def delete_checkpoint_async(self, training_run_id: str, checkpoint_id: str) -> None:
        _require("training_run_id", training_run_id)
        _require("checkpoint_id", checkpoint_id)
        await self._rt.run_async(self._control.call("DELETE", f"openapi/v1/checkpoints/{checkpoint_id}"))

    def delete_checkpoint(self, training_run_id: str, checkpoint_id: str) -> APIFuture[None]:
        _require("training_run_id", training_run_id)
        _require("checkpoint_id", checkpoint_id)
        return self._future(self.delete_checkpoint_async(training_run_id, checkpoint_id))

    # -- sessions, samplers --------------------------------------------------------------------

    async def get_session_async(self, session_id: str, access_scope: str = "owned") -> GetSessionResponse:
        _require("session_id", session_id)
        r = await self._rt.run_async(
            self._control.call(
                "GET", f"openapi/v1/service-sessions/{session_id}", params={"access_scope": access_scope}
            )
        )
        return GetSessionResponse(
            training_run_ids=r["training_run_cuids"], sampler_ids=r["sampling_run_cuids"]
        )

    def get_session(self, session_id: str, access_scope: str = "owned") -> APIFuture[GetSessionResponse]:
        _require("session_id", session_id)
        return self._future(self.get_session_async(session_id, access_scope))

    async def list_sessions_async(
        self, limit: int = 20, offset: int = 0, access_scope: str = "owned"
    ) -> ListSessionsResponse:
        r = await self._rt.run_async(
            self._control.call(
                "GET",
                "openapi/v1/service-sessions",
                params={"limit": limit, "offset": offset, "access_scope": access_scope},
            )
        )
        return ListSessionsResponse(sessions=[s["service_session_cuid"] for s in r["service_sessions"]])

    def list_sessions(
        self, limit: int = 20, offset: int = 0, access_scope: str = "owned"
    ) -> APIFuture[ListSessionsResponse]:
        return self._future(self.list_sessions_async(limit, offset, access_scope))

    async def export_session_trace_async(self, session_id: str) -> str:
        """A signed URL of the session's trace (Chrome trace-event JSON; open it in
        https://ui.perfetto.dev): it downloads without the API key and expires after about an hour,
        as the Tinker client's `export_session_trace`."""
        _require("session_id", session_id)
        r = await self._rt.run_async(self._control.call("GET", f"trine/v1/sessions/{session_id}/trace-url"))
        return r["url"]

    def export_session_trace(self, session_id: str) -> APIFuture[str]:
        _require("session_id", session_id)
        return self._future(self.export_session_trace_async(session_id))

    async def download_session_trace_async(self, session_id: str, destination_path: str | Path) -> Path:
        """Write the session's trace (queue, prefill, decode and training spans per engine replica,
        with tokens and cost on each) to `destination_path`; returns the path."""
        _require("session_id", session_id)
        data = await self._rt.run_async(self._control.get_bytes(f"trine/v1/sessions/{session_id}/trace"))
        path = Path(destination_path)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(data)
        return path

    def download_session_trace(self, session_id: str, destination_path: str | Path) -> APIFuture[Path]:
        _require("session_id", session_id)
        return self._future(self.download_session_trace_async(session_id, destination_path))

    async def get_sampler_async(self, sampler_id: str) -> GetSamplerResponse:
        _require("sampler_id", sampler_id)
        r = await self._rt.run_async(self._control.call("GET", f"openapi/v1/sampling-runs/{sampler_id}"))
        return GetSamplerResponse(
            sampler_id=r["sampling_run_cuid"],
            base_model=r["base_model"],
            model_path=r.get("source_checkpoint_uri"),
        )

    def get_sampler(self, sampler_id: str) -> APIFuture[GetSamplerResponse]:
        _require("sampler_id", sampler_id)
        return self._future(self.get_sampler_async(sampler_id))


ADAPTER_FILES = ("adapter_config.json", "adapter_model.safetensors")


def checkpoint_name(raw: str) -> str:
    """A checkpoint name made of `raw`: letters, digits, '.', '_' and '-' (anything else becomes '-')."""
    name = "".join(c if c.isalnum() or c in "._-" else "-" for c in raw).strip(".-") or "adapter"
    return name[:200]


def adapter_archive(directory: Path) -> bytes:
    """A tar of a PEFT adapter directory's two files (what the import route reads), symlinks followed
    (a Hugging Face cache snapshot links its files into blobs/; the route reads regular files only)."""
    missing = [f for f in ADAPTER_FILES if not (directory / f).is_file()]
    if missing:
        raise ValidationError(f"{directory} is not a PEFT adapter directory: it has no {', '.join(missing)}")
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", dereference=True) as tf:
        for f in ADAPTER_FILES:
            tf.add(directory / f, arcname=f)
    return buf.getvalue()


def extract_checkpoint(archive: Path, directory: Path) -> list[Path]:
    """Extract a checkpoint archive (one top-level folder of plain files) into `directory`, without
    that folder level. Only regular files are taken, and only by their base names, so no member can
    write outside `directory`. Returns the files written."""
    written = []
    with tarfile.open(archive) as tf:
        for member in tf.getmembers():
            if not member.isfile():
                continue
            target = directory / Path(member.name).name
            with tf.extractfile(member) as src, open(target, "wb") as dst:
                shutil.copyfileobj(src, dst)
            written.append(target)
    if not written:
        raise TrineError(f"the checkpoint archive {archive.name} holds no files", code="invalid_response")
    return written
