"""TensorData: a flat list of numbers, a dtype (float32 or int64) and a shape.

Built from a torch tensor, a numpy array or a (nested) list of numbers: floats become float32,
integers int64. Invariant: prod(shape) == len(data). torch is never imported here; a torch tensor
is recognised only if the caller already imported torch.
"""

from __future__ import annotations

import math
import sys
from typing import Any, Literal

import numpy as np
from pydantic import Field, model_validator

from .base import BaseModel

Dtype = Literal["float32", "int64"]


def _torch():
    return sys.modules.get("torch")


class TensorData(BaseModel):
    data: list[float] | list[int]
    dtype: Dtype
    shape: list[int] = Field(default_factory=list)

    @model_validator(mode="before")
    @classmethod
    def _coerce(cls, value: Any) -> Any:
        if isinstance(value, cls):
            return value
        torch = _torch()
        if torch is not None and isinstance(value, torch.Tensor):
            return cls.from_torch(value).model_dump()
        if isinstance(value, np.ndarray):
            return cls.from_numpy(value).model_dump()
        if isinstance(value, (list, tuple)):
            arr = np.asarray(value)
            if arr.dtype.kind not in "iuf" and arr.size > 0:
                raise ValueError(
                    f"TensorData: only lists of numbers are allowed (got numpy dtype {arr.dtype})"
                )
            return cls.from_numpy(arr.astype(np.float32) if arr.size == 0 else arr).model_dump()
        return value

    @model_validator(mode="after")
    def _check(self) -> TensorData:
        if "shape" not in self.model_fields_set:
            self.shape = [len(self.data)]
        if any(d < 0 for d in self.shape):
            raise ValueError(f"TensorData.shape: negative dimension in {self.shape}")
        if math.prod(self.shape) != len(self.data):
            raise ValueError(
                f"TensorData: {len(self.data)} values do not fit shape {self.shape} "
                f"(expected {math.prod(self.shape)})"
            )
        if self.dtype == "float32":
            self.data = [float(x) for x in self.data]
        else:
            out = []
            for x in self.data:
                if isinstance(x, float) and not x.is_integer():
                    raise ValueError(f"TensorData: dtype int64 but got the non-integer value {x}")
                out.append(int(x))
            self.data = out
        return self

    @classmethod
    def from_numpy(cls, array: np.ndarray) -> TensorData:
        if np.issubdtype(array.dtype, np.floating):
            array, dtype = array.astype(np.float32), "float32"
        elif np.issubdtype(array.dtype, np.integer) or array.dtype == np.bool_:
            array, dtype = array.astype(np.int64), "int64"
        else:
            raise ValueError(f"TensorData.from_numpy: unsupported dtype {array.dtype} (use ints or floats)")
        return cls(data=array.reshape(-1).tolist(), dtype=dtype, shape=list(array.shape))

    @classmethod
    def from_torch(cls, tensor: Any) -> TensorData:
        import torch

        t = tensor.detach().cpu()
        if t.dtype.is_floating_point:
            t, dtype = t.to(torch.float32), "float32"
        else:
            t, dtype = t.to(torch.int64), "int64"
        return cls(data=t.reshape(-1).tolist(), dtype=dtype, shape=list(t.shape))

    def to_numpy(self) -> np.ndarray:
        np_dtype = np.float32 if self.dtype == "float32" else np.int64
        return np.array(self.data, dtype=np_dtype).reshape(self.shape)

    def to_torch(self) -> Any:
        """A torch tensor of this dtype and shape (imports torch; raises ImportError without it)."""
        import torch

        return torch.tensor(
            self.data, dtype=torch.float32 if self.dtype == "float32" else torch.int64
        ).reshape(self.shape)

    def tolist(self) -> list:
        return list(self.data)

    def __len__(self) -> int:
        return len(self.data)
