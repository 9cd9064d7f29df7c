"""RestClient results: runs, sessions, samplers and checkpoints (PyTRIO's names and fields)."""

from __future__ import annotations

from datetime import datetime
from typing import Literal

from .base import BaseModel


class Cursor(BaseModel):
    offset: int
    limit: int
    total_count: int


class Checkpoint(BaseModel):
    checkpoint_id: str
    checkpoint_type: Literal["training", "sampler", "external"]
    time: datetime
    path: str
    size_bytes: int | None = None
    public: bool = False
    expires_at: datetime | None = None
    source: str | None = None  # an imported adapter's origin (trine)


class CheckpointsListResponse(BaseModel):
    checkpoints: list[Checkpoint]
    cursor: Cursor | None = None


class TrainingRun(BaseModel):
    training_run_id: str
    base_model: str
    model_owner: str
    is_lora: bool
    corrupted: bool = False
    lora_rank: int | None = None
    last_request_time: datetime
    last_checkpoint: Checkpoint | None = None
    last_sampler_checkpoint: Checkpoint | None = None
    user_metadata: dict[str, object] | None = None


class TrainingRunsResponse(BaseModel):
    training_runs: list[TrainingRun]
    cursor: Cursor


class CheckpointArchiveUrlResponse(BaseModel):
    url: str
    expires: datetime


class CheckpointDownloadSource(BaseModel):
    checkpoint_id: str
    url: str
    expires: datetime
    source: Literal["object_storage", "actor"]
    checkpoint_status: Literal["LOCAL", "SYNCING", "READY"]
    tls_cert_pem: str | None
    tls_not_after: datetime | None


class CheckpointDownloadResult(BaseModel):
    checkpoint_id: str
    path: str
    bytes_written: int
    file_size_bytes: int
    status_code: int
    resumed: bool


class GetSessionResponse(BaseModel):
    training_run_ids: list[str]
    sampler_ids: list[str]


class ListSessionsResponse(BaseModel):
    sessions: list[str]


class GetSamplerResponse(BaseModel):
    sampler_id: str
    base_model: str
    model_path: str | None = None
