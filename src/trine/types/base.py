"""The pydantic base of every public type: unknown fields are refused, so a typo fails loudly."""
from __future__ import annotations

from pydantic import BaseModel as _PydanticBaseModel
from pydantic import ConfigDict


class BaseModel(_PydanticBaseModel):
    model_config = ConfigDict(extra="forbid", frozen=False)
