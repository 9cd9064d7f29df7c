"""trine's own run routes: logged metrics, and runs as the console and `trine runs` show them.

    POST /api/trine/v1/training-runs/{run_id}/metrics   {"step": n, "values": {"reward": 0.5}}
                                                        -> {"run_id", "step", "logged": [names]}
    GET  /api/trine/v1/training-runs/{run_id}/metrics   ?format=json (default) | csv: one row per step,
                                                        the training curves (train:*) and every
                                                        logged metric
    GET  /api/trine/v1/training-runs                    the key's runs, newest first, with labels,
                                                        LoRA, last optimizer settings, last metrics
    GET  /api/trine/v1/training-runs/{run_id}           one run: its row, steps, metrics, checkpoints

The key comes as `X-API-Key` (or Bearer); another key's run is a 404, as everywhere.
"""

from __future__ import annotations

import csv
import io
from typing import Any

from fastapi import APIRouter, Depends, Query, Request
from fastapi.responses import Response
from pydantic import BaseModel, ConfigDict

from ...limits import MAX_CONTROL_BYTES
from ...service import ApiKey
from ..console.runs import list_runs, metrics_table, run_detail
from ..http.context import api_key, json_object, parse_model, service_of

router = APIRouter(prefix="/api/trine/v1")


class MetricsLog(BaseModel):
    model_config = ConfigDict(extra="forbid")
    step: Any = None
    values: Any = None


@router.post("/training-runs/{run_id}/metrics")
async def log_metrics(run_id: str, request: Request, key: ApiKey = Depends(api_key)):
    body = parse_model(MetricsLog, await json_object(request, MAX_CONTROL_BYTES))
    points = service_of(request).metrics.log(key, run_id, body.step, body.values)
    return {"run_id": run_id, "step": body.step, "logged": [p.name for p in points]}


@router.get("/training-runs/{run_id}/metrics")
async def get_metrics(
    run_id: str,
    request: Request,
    format: str = Query("json", pattern="^(json|csv)$"),
    key: ApiKey = Depends(api_key),
):
    columns, rows = metrics_table(service_of(request), key, run_id)
    if format == "json":
        return {"run_id": run_id, "columns": columns, "rows": rows}
    out = io.StringIO()
    w = csv.writer(out, lineterminator="\n")
    w.writerow(columns)
    w.writerows([["" if v is None else repr(v) if isinstance(v, float) else v for v in row] for row in rows])
    return Response(
        out.getvalue(),
        media_type="text/csv",
        headers={"Content-Disposition": f'attachment; filename="{run_id}-metrics.csv"'},
    )


@router.get("/training-runs")
async def training_runs(request: Request, key: ApiKey = Depends(api_key)):
    return {"runs": list_runs(service_of(request), key)}


@router.get("/training-runs/{run_id}")
async def training_run(run_id: str, request: Request, key: ApiKey = Depends(api_key)):
    return run_detail(service_of(request), key, run_id)
