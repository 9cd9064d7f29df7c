"""The pydantic base of every public type: unknown fields are refused, so a typo fails loudly.

Building a type with bad values raises `trine.ValidationError` (a `TrineError` and a `ValueError`)
naming the type and the field, e.g. `SamplingParams.max_tokens must be > 0, got 0`, never a raw
pydantic error. (`model_validate`, which the server uses on wire bodies, keeps pydantic's error.)
"""

from __future__ import annotations

from pydantic import BaseModel as _PydanticBaseModel
from pydantic import ConfigDict
from pydantic import ValidationError as _PydanticValidationError

from ..errors import ValidationError


def validation_message(cls_name: str, e: _PydanticValidationError) -> str:
    """One line per problem: a validator's own message as is, else `Type.field: what is wrong`."""
    parts = []
    for err in e.errors():
        msg = err["msg"].removeprefix("Value error, ")
        if err["type"] == "value_error":
            parts.append(msg)
        else:
            loc = ".".join(str(x) for x in err["loc"])
            parts.append(f"{cls_name}.{loc}: {msg}" if loc else f"{cls_name}: {msg}")
    return "; ".join(parts)


class BaseModel(_PydanticBaseModel):
    model_config = ConfigDict(extra="forbid", frozen=False)

    def __init__(self, /, **data):
        try:
            super().__init__(**data)
        except _PydanticValidationError as e:
            raise ValidationError(
                validation_message(type(self).__name__, e), code=f"validation.invalid_{type(self).__name__}"
            ) from None
