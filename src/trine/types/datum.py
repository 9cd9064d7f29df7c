"""Datum: one training example, the model input plus the named loss inputs (all coerced to TensorData)."""

from __future__ import annotations

from typing import Any

from pydantic import model_validator

from .base import BaseModel
from .model_input import ModelInput
from .tensor import TensorData


class Datum(BaseModel):
    model_input: ModelInput
    loss_fn_inputs: dict[str, TensorData]

    @model_validator(mode="before")
    @classmethod
    def _coerce_tensors(cls, data: Any) -> Any:
        if isinstance(data, dict) and isinstance(data.get("loss_fn_inputs"), dict):
            inputs = {k: TensorData.model_validate(v) for k, v in data["loss_fn_inputs"].items()}
            return {**data, "loss_fn_inputs": inputs}
        return data
