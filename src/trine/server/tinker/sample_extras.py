"""The Tinker `asample` fields beyond PyTRIO's sample body, parsed into SampleRequest fields:
`topk_sample_logprobs` (the OpenAI plane's `top_logprobs`: one engine implementation),
`prompt_logprobs_last_n`, `prompt_alt_tokens_k` and `target_prompt_logprobs`.

`target_prompt_logprobs` is an int64 TensorData `[len(prompt) - 1, K]`, dense or sparse CSR: cell
[i, j] names a token id to score at prompt entry i + 1, -1 names nothing. It becomes one list of ids
per row (`SampleRequest.target_prompt_ids`); `TargetLayout` keeps where each id sat, so the answer
has the request's shape and layout (CSR stays CSR), with 0.0 where the request had -1.
Every error is an InvalidRequest naming the wire field.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import numpy as np
from pydantic import Field

from ...limits import INT64_MAX, MAX_TOPK_PROMPT_LOGPROBS
from ...service import InvalidRequest
from ..http.bounds import Int64
from ..http.context import parse_model
from ..pytrio.bodies import Body

WIDTH = MAX_TOPK_PROMPT_LOGPROBS  # every top-k / draw / target width
_Width = Field(default=0, ge=0, le=WIDTH)


class WireTensor(Body):
    data: list[Int64]
    dtype: Literal["int64"]
    shape: list[Int64] | None = None
    sparse_crow_indices: list[Int64] | None = None
    sparse_col_indices: list[Int64] | None = None


class Extras(Body):
    topk_sample_logprobs: int = _Width
    prompt_alt_tokens_k: int = _Width
    prompt_logprobs_last_n: int | None = Field(default=None, ge=1, le=INT64_MAX)
    target_prompt_logprobs: WireTensor | None = None


@dataclass(frozen=True)
class TargetLayout:
    """Where a target_prompt_logprobs request's ids sat: `cells` are its ids in storage order (dense:
    row-major; CSR: its values), `csr` its (crow, col) indices when it was sparse."""

    shape: tuple[int, int]
    cells: np.ndarray
    csr: tuple[list[int], list[int]] | None

    def values(self, rows: list[list[float]]) -> np.ndarray:
        """The answer's values in storage order: each asked cell's logprob, 0.0 where it had -1."""
        out = np.zeros(len(self.cells), dtype=np.float32)
        asked = self.cells != -1
        flat = [x for row in rows for x in row]
        if len(flat) != int(asked.sum()):
            raise ValueError(f"target_prompt_logprobs: {len(flat)} logprobs for {int(asked.sum())} ids")
        out[asked] = flat
        return out


def parse_extras(body: dict, prompt_len: int, prompt_logprobs: bool) -> tuple[dict, TargetLayout | None]:
    """SampleRequest fields (keywords; `top_logprobs` is a SamplingOptions one) of a Tinker sample body, and
    the layout of
    its target_prompt_logprobs (None when it sent none)."""
    e = parse_model(Extras, {k: body[k] for k in Extras.model_fields if body.get(k) is not None})
    last_n = e.prompt_logprobs_last_n
    if last_n is not None:
        if not prompt_logprobs:
            raise InvalidRequest(
                "prompt_logprobs_last_n: applies to prompt logprobs; set prompt_logprobs "
                "(include_prompt_logprobs=True)"
            )
        if last_n > prompt_len - 1:
            raise InvalidRequest(
                f"prompt_logprobs_last_n {last_n}: use 1 to len(prompt) - 1 = {prompt_len - 1}"
            )
    layout = ids = None
    if e.target_prompt_logprobs is not None:
        layout = _layout(e.target_prompt_logprobs, prompt_len)
        ids = _rows(layout)
        if not any(ids):
            raise InvalidRequest(
                "target_prompt_logprobs: names no token id (every cell is -1); name at "
                "least one, or leave the field out"
            )
    return dict(
        top_logprobs=e.topk_sample_logprobs,
        prompt_alt_tokens_k=e.prompt_alt_tokens_k,
        prompt_logprobs_last_n=last_n,
        target_prompt_ids=ids,
    ), layout


def _layout(t: WireTensor, prompt_len: int) -> TargetLayout:
    field = "target_prompt_logprobs"
    if t.shape is None or len(t.shape) != 2:
        raise InvalidRequest(f"{field}.shape: give a 2-D shape [len(prompt) - 1, K], got {t.shape}")
    rows, width = t.shape
    if rows != prompt_len - 1:
        raise InvalidRequest(f"{field}.shape: needs len(prompt) - 1 = {prompt_len - 1} rows, got {rows}")
    if not 1 <= width <= WIDTH:
        raise InvalidRequest(f"{field}.shape: K = {width}; use 1 to {WIDTH} ids per position")
    cells = np.asarray(t.data, dtype=np.int64)
    if len(cells) and cells.min() < -1:
        raise InvalidRequest(f"{field}.data: use token ids, or -1 for a cell that asks for nothing")
    if (t.sparse_crow_indices is None) != (t.sparse_col_indices is None):
        raise InvalidRequest(f"{field}: send sparse_crow_indices and sparse_col_indices together")
    if t.sparse_crow_indices is None:
        if len(cells) != rows * width:
            raise InvalidRequest(f"{field}.data: {len(cells)} values do not fill the shape [{rows}, {width}]")
        return TargetLayout((rows, width), cells, None)
    crow, col = np.asarray(t.sparse_crow_indices, np.int64), np.asarray(t.sparse_col_indices, np.int64)
    if (
        len(crow) != rows + 1
        or len(col) != len(cells)
        or crow[0] != 0
        or crow[-1] != len(cells)
        or np.any(np.diff(crow) < 0)
        or (len(col) and (col.min() < 0 or col.max() >= width))
    ):
        raise InvalidRequest(f"{field}: the sparse CSR indices do not describe a {rows}x{width} tensor")
    return TargetLayout((rows, width), cells, (crow.tolist(), col.tolist()))


def _rows(layout: TargetLayout) -> list[list[int]]:
    """The ids each row asks for (the -1 cells dropped)."""
    rows, width = layout.shape
    if layout.csr is None:
        return [[int(x) for x in r if x != -1] for r in layout.cells.reshape(rows, width)]
    crow = layout.csr[0]
    return [[int(x) for x in layout.cells[crow[i] : crow[i + 1]] if x != -1] for i in range(rows)]
