"""Control-plane request bodies (JSON), as the official `pytrio` 0.2.9 client sends them: pydantic
models whose errors name the field (server/context.py turns them into 400s)."""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from ..service import RunLabels
from .bounds import Int64, Seed


class _Body(BaseModel):
    model_config = ConfigDict(extra="ignore")


class SessionCreate(_Body):
    sdk_version: str = ""
    user_metadata: dict[str, Any] | None = None
    name: str = ""  # trine's own: runs made in the session take these labels (see service/labels.py)
    tags: list[str] = []

    def labels(self) -> RunLabels:
        return RunLabels(self.name, tuple(self.tags), self.user_metadata or {})


class SessionClose(_Body):
    status: str = Field(default="ENDED", pattern="^(ENDED|CANCELLED)$")


class TrainingRunCreate(_Body):
    base_model: str = ""
    lora_rank: Int64 = 32
    train_mlp: bool = True
    train_attn: bool = True
    train_unembed: bool = True
    source_checkpoint_uri: str = ""
    restore_optimizer: bool = False
    seed: Seed | None = None
    name: str = ""  # trine's own (the trine SDK sends them; PyTRIO never does)
    tags: list[str] = []
    user_metadata: dict[str, Any] | None = None


class TrainingRunUpdate(_Body):
    source_checkpoint_uri: str = Field(min_length=1)
    restore_optimizer: bool = False


class SamplingRunCreate(_Body):
    base_model: str = ""
    source_checkpoint_uri: str = ""
