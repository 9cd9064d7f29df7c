"""TrainingClient: one LoRA training run. Every call returns an APIFuture as soon as the server
has the request queued; the run's events execute in call order (see events.py), so a loop may
submit forward_backward and optim_step without waiting, one clock cycle per step.

The first stateful call sends `trainer.init_run` and waits for it (the server loads the model
there); `load_state*` is allowed only before that.
"""

from __future__ import annotations

import asyncio
import functools
import hashlib
import inspect
import logging
import uuid
import weakref
from typing import TYPE_CHECKING, Any

from .. import __version__
from ..errors import TrineError, ValidationError
from ..limits import (
    CHECKPOINT_NAME,
    CHECKPOINT_NAME_MAX,
    FORWARD,
    FORWARD_BACKWARD,
    INIT_RUN,
    OPTIMIZE_STEP,
    SAVE_STATE,
    SAVE_WEIGHTS,
    TEMPORARY_CHECKPOINT_TTL_SECONDS,
)
from ..types import (
    AdamParams,
    Datum,
    ForwardBackwardOutput,
    GetInfoResponse,
    LoraConfig,
    OptimStepResponse,
    SaveWeightsForSamplerResponse,
    SaveWeightsResponse,
    TensorData,
    Usage,
)
from .batch import Limits, Plan, plan_batch
from .events import EventQueue
from .futures import APIFuture, gather
from .http import ActorConnection
from .paths import checkpoint_uri
from .runtime import UsageLedger
from .traced_loss import TracedLoss
from .wire import tensor_from_wire

if TYPE_CHECKING:
    from .sampling import SamplingClient
    from .service import Session

log = logging.getLogger("trine")

TEMP_SAMPLING_TTL_S = TEMPORARY_CHECKPOINT_TTL_SECONDS


def normalize_checkpoint_name(name: str) -> str:
    """PyTRIO's rule: spaces become '-', the name must match CHECKPOINT_NAME, and names over 200
    characters are shortened to 180 characters + 20 hex digits of their sha256."""
    if not isinstance(name, str):
        raise ValidationError(f"checkpoint name must be a str, got {type(name).__name__}")
    normalized = name.replace(" ", "-")
    if not CHECKPOINT_NAME.fullmatch(normalized):
        raise ValidationError(
            f"checkpoint name {name!r} is invalid: use letters, digits, '.', '_' and '-', "
            "starting with a letter or digit",
            code="validation.invalid_checkpoint_name",
        )
    if len(normalized) > CHECKPOINT_NAME_MAX:
        normalized = (
            normalized[: CHECKPOINT_NAME_MAX - 20] + hashlib.sha256(normalized.encode()).hexdigest()[:20]
        )
    return normalized


def _event_usage(response: dict) -> Usage:
    usage = response.get("usage") or {}
    return Usage.from_wire(usage, cost=response.get("cost"))


def _cycle(responses: list[dict]) -> int | None:
    cycles = [r["cycle"] for r in responses if isinstance(r.get("cycle"), int)]
    return max(cycles) if cycles else None


class _Heartbeat:
    """The run's heartbeat task; cancelled when the TrainingClient is garbage collected."""

    def __init__(self):
        self.task: asyncio.Task | None = None

    def stop(self, loop: asyncio.AbstractEventLoop) -> None:
        if self.task is not None and not loop.is_closed():
            loop.call_soon_threadsafe(self.task.cancel)


class TrainingClient:
    def __init__(
        self,
        session: Session,
        run: dict,
        lora: LoraConfig,
        *,
        source_checkpoint: str | None = None,
        load_optimizer: bool = False,
    ):
        self._session = session
        self._rt = session.runtime
        self.training_run_id: str = run["training_run_cuid"]
        self.training_run_cuid = self.training_run_id
        self.model_id: str = run["model_id"]
        self.model_alias: str = run["model_alias"]
        self.lora = lora
        self._limits = Limits.from_wire(run.get("trainer"))
        self._actor = (run["actor"], run["actor_jwt"])
        self._source_checkpoint = source_checkpoint
        self._load_optimizer = load_optimizer
        self._queue: EventQueue | None = None
        self._initialized = False
        self._init_lock = asyncio.Lock()
        self._usage = UsageLedger(parent=self._rt.usage)
        self._optim_steps = 0  # optim_step calls made: the default step of log_metrics
        self._heartbeat = _Heartbeat()
        weakref.finalize(self, self._heartbeat.stop, self._rt.loop)

    # -- plumbing ---------------------------------------------------------------------------

    def _renew(self):
        return self._rt.control.call("POST", f"openapi/v1/training-runs/{self.training_run_id}/renew")

    async def _ensure_initialized(self) -> EventQueue:
        """Bind the actor, start the heartbeat and run `trainer.init_run` exactly once."""
        async with self._init_lock:
            if self._initialized:
                return self._queue
            if self._queue is None:
                conn = ActorConnection(*self._actor, self._renew, self._rt.settings, self._rt.actor_http)
                self._queue = EventQueue(conn, self.training_run_id, self._rt.settings, __version__)
                self._heartbeat.task = asyncio.ensure_future(_heartbeat_loop(conn))
            lora = {
                "rank": self.lora.rank,
                "seed": self.lora.seed,
                "train_mlp": self.lora.train_mlp,
                "train_attn": self.lora.train_attn,
                "train_unembed": self.lora.train_unembed,
            }
            payload = {
                "base_model": self.model_id,
                "lora_config": lora,
                "load_optimizer": self._load_optimizer,
                "checkpoint_uri": self._source_checkpoint,
            }
            (future,) = self._queue.submit(INIT_RUN, [payload])
            await asyncio.wrap_future(future)
            self._initialized = True
            return self._queue

    async def _submit(self, event_type: str, payloads: list[dict]) -> list[APIFuture]:
        queue = await self._ensure_initialized()
        return [APIFuture(f) for f in queue.submit(event_type, payloads)]

    def vocab_size(self) -> int:
        """len(tokenizer): the bound every token id is checked against before sending."""
        return len(self.get_tokenizer())

    def _plan(
        self, data: list[Datum], loss_fn: str, auto_shift: bool, custom: TracedLoss | None = None
    ) -> Plan:
        if not isinstance(data, list):
            raise ValidationError(f"data must be a list of Datum, got {type(data).__name__}")
        return plan_batch(
            data,
            loss_fn=loss_fn,
            auto_shift=auto_shift,
            limits=self._limits,
            vocab_size=self.vocab_size(),
            custom=None if custom is None else dict(custom.inputs[1:]),
        )

    # -- forward / forward_backward ---------------------------------------------------------

    async def _submit_forward(
        self, event_type: str, plan: Plan, loss_fn_config: dict | None, auto_shift: bool
    ) -> APIFuture[ForwardBackwardOutput]:
        futures = await self._submit(event_type, plan.payloads(loss_fn_config, auto_shift))
        expected = [len(c) for c in plan.chunks]
        return gather(futures).map(functools.partial(self._parse_forward, expected=expected))

    def _parse_forward(self, responses: list[dict], expected: list[int]) -> ForwardBackwardOutput:
        outputs, loss_sum, count, custom = [], 0.0, 0, {}
        usage = sum((_event_usage(r) for r in responses[1:]), _event_usage(responses[0]))
        for k, (response, n) in enumerate(zip(responses, expected)):
            result = response.get("result") or {}
            chunk_outputs = result.get("loss_fn_outputs")
            if not isinstance(chunk_outputs, list) or len(chunk_outputs) != n:
                raise TrineError(
                    f"the server returned a malformed forward result for chunk {k}", code="invalid_response"
                )
            outputs += [{name: tensor_from_wire(t) for name, t in out.items()} for out in chunk_outputs]
            loss_sum += float(result["metrics"]["loss_sum"])
            count += int(result["metrics"]["token_count"])
            for key, value in result["metrics"].items():  # a custom loss's: :mean ones weighted by datums
                if key.startswith("custom/"):
                    custom[key] = custom.get(key, 0.0) + float(value) * (n if key.endswith(":mean") else 1)
        self._usage.add(usage)
        return ForwardBackwardOutput(
            loss_fn_outputs=outputs,
            metrics={
                "loss_sum": loss_sum,
                "loss_mean": loss_sum / count if count else 0.0,
                "token_count": count,
                **{k: v / sum(expected) if k.endswith(":mean") else v for k, v in custom.items()},
            },
            usage=usage,
            cycle=_cycle(responses),
        )

    def forward(
        self,
        data: list[Datum],
        loss_fn: str = "cross_entropy",
        loss_fn_config: dict | None = None,
        auto_shift: bool = False,
    ) -> APIFuture[ForwardBackwardOutput]:
        """Losses and per-token logprobs without touching gradients."""
        plan = self._plan(data, loss_fn, auto_shift)
        return self._rt.run_sync(self._submit_forward(FORWARD, plan, loss_fn_config, auto_shift))

    async def forward_async(
        self,
        data: list[Datum],
        loss_fn: str = "cross_entropy",
        loss_fn_config: dict | None = None,
        auto_shift: bool = False,
    ) -> APIFuture[ForwardBackwardOutput]:
        plan = await asyncio.to_thread(self._plan, data, loss_fn, auto_shift)
        return await self._rt.run_async(self._submit_forward(FORWARD, plan, loss_fn_config, auto_shift))

    def forward_backward(
        self,
        data: list[Datum],
        loss_fn: str = "cross_entropy",
        loss_fn_config: dict | None = None,
        auto_shift: bool = False,
    ) -> APIFuture[ForwardBackwardOutput]:
        """Accumulate the gradient of the summed per-token loss over `data` (split into chunks that
        share the whole batch's totals when the run's limits require it)."""
        plan = self._plan(data, loss_fn, auto_shift)
        return self._rt.run_sync(self._submit_forward(FORWARD_BACKWARD, plan, loss_fn_config, auto_shift))

    async def forward_backward_async(
        self,
        data: list[Datum],
        loss_fn: str = "cross_entropy",
        loss_fn_config: dict | None = None,
        auto_shift: bool = False,
    ) -> APIFuture[ForwardBackwardOutput]:
        plan = await asyncio.to_thread(self._plan, data, loss_fn, auto_shift)
        return await self._rt.run_async(
            self._submit_forward(FORWARD_BACKWARD, plan, loss_fn_config, auto_shift)
        )

    def _custom_linearization(
        self, data: list[Datum], forward: ForwardBackwardOutput, loss_fn, loss_fn_config: dict | None
    ) -> tuple[list[Datum], dict[str, float]]:
        """Run the user's torch loss on the forward logprobs; return cross_entropy data whose
        weights are -dL/dlogprob, so the server's (linear) backward gives the same gradient."""
        try:
            import torch  # noqa: F401  (the loss below is the user's torch code)
        except ImportError as e:
            raise TrineError(
                "forward_backward_custom needs torch installed", code="dependency.missing_torch"
            ) from e
        logprobs = []
        for out in forward.loss_fn_outputs:
            if "logprobs" not in out:
                raise TrineError("the server's forward output has no 'logprobs'", code="invalid_response")
            logprobs.append(out["logprobs"].to_torch().clone().requires_grad_(True))
        if loss_fn_config is not None and _accepts_config(loss_fn):
            loss, metrics = loss_fn(data, logprobs, loss_fn_config)
        else:
            loss, metrics = loss_fn(data, logprobs)
        loss.backward()
        linear = []
        for datum, lp in zip(data, logprobs):
            if lp.grad is None:
                raise ValidationError(
                    "forward_backward_custom: the loss has no gradient with respect to the "
                    "logprobs; return a tensor computed from them"
                )
            linear.append(
                Datum(
                    model_input=datum.model_input,
                    loss_fn_inputs={
                        "target_tokens": datum.loss_fn_inputs["target_tokens"],
                        "weights": TensorData.from_torch(-lp.grad),
                    },
                )
            )
        return linear, {k: float(v) for k, v in (metrics or {}).items()}

    def _server_side(self, loss_fn, server_side: bool | None) -> bool:
        if server_side and not isinstance(loss_fn, TracedLoss):
            raise ValidationError(
                "forward_backward_custom(server_side=True) runs a traced loss: pass "
                "trine.custom_loss(fn, input_ranks), with fn(logprobs, *inputs) -> (loss, metrics) per datum"
            )
        return isinstance(loss_fn, TracedLoss) and server_side is not False

    def forward_backward_custom(
        self,
        data: list[Datum],
        loss_fn,
        loss_fn_config: dict | None = None,
        *,
        server_side: bool | None = None,
    ) -> APIFuture[ForwardBackwardOutput]:
        """`loss_fn(data, logprobs: list[torch.Tensor]) -> (loss, metrics)` computed locally with
        torch; blocks for the forward pass, then returns the backward pass's future.

        A traced loss (`trine.custom_loss(fn, input_ranks)`) runs on the server instead, in one
        forward and one backward (`server_side=False` runs it locally, as above)."""
        if self._server_side(loss_fn, server_side):
            plan = self._plan(data, "custom", False, loss_fn)
            return self._rt.run_sync(self._submit_forward(FORWARD_BACKWARD, plan, loss_fn.wire(), False))
        forward = self.forward(data).result()
        linear, metrics = self._custom_linearization(data, forward, loss_fn, loss_fn_config)
        return self.forward_backward(linear).map(lambda out: _merge_metrics(out, metrics))

    async def forward_backward_custom_async(
        self,
        data: list[Datum],
        loss_fn,
        loss_fn_config: dict | None = None,
        *,
        server_side: bool | None = None,
    ) -> APIFuture[ForwardBackwardOutput]:
        if self._server_side(loss_fn, server_side):
            plan = await asyncio.to_thread(self._plan, data, "custom", False, loss_fn)
            return await self._rt.run_async(
                self._submit_forward(FORWARD_BACKWARD, plan, loss_fn.wire(), False)
            )
        forward = await (await self.forward_async(data))
        linear, metrics = self._custom_linearization(data, forward, loss_fn, loss_fn_config)
        return (await self.forward_backward_async(linear)).map(lambda out: _merge_metrics(out, metrics))

    # -- optimizer, checkpoints -------------------------------------------------------------

    async def _optim_step(self, adam_params: AdamParams) -> APIFuture[OptimStepResponse]:
        if not isinstance(adam_params, AdamParams):
            raise ValidationError(f"adam_params must be a trine.AdamParams, got {type(adam_params).__name__}")
        (future,) = await self._submit(OPTIMIZE_STEP, [{"adam_params": adam_params.model_dump()}])
        self._optim_steps += 1
        return future.map(self._parse_optim)

    def _parse_optim(self, response: dict) -> OptimStepResponse:
        usage = _event_usage(response)
        self._usage.add(usage)
        metrics = (response.get("result") or {}).get("metrics") or {}
        return OptimStepResponse(metrics={k: float(v) for k, v in metrics.items()}, cycle=_cycle([response]))

    def optim_step(self, adam_params: AdamParams) -> APIFuture[OptimStepResponse]:
        """One AdamW step on the accumulated gradient; bumps the adapter's version."""
        return self._rt.run_sync(self._optim_step(adam_params))

    async def optim_step_async(self, adam_params: AdamParams) -> APIFuture[OptimStepResponse]:
        return await self._rt.run_async(self._optim_step(adam_params))

    async def _save(
        self,
        event_type: str,
        name: str,
        ttl_seconds: int | None,
        overwrite: bool,
        visibility: str,
        kind: str = "snapshot",
    ) -> APIFuture[dict]:
        if ttl_seconds is not None and (not isinstance(ttl_seconds, int) or ttl_seconds <= 0):
            raise ValidationError(f"ttl_seconds must be a positive int or None, got {ttl_seconds!r}")
        if kind not in ("snapshot", "inflight"):
            raise ValidationError(f"kind must be 'snapshot' or 'inflight', got {kind!r}")
        payload = {
            "name": normalize_checkpoint_name(name),
            "ttl_seconds": ttl_seconds,
            "overwrite": overwrite,
            "visibility": visibility,
        }
        if kind != "snapshot":  # trine's extension of the save_weights payload
            payload["kind"] = kind
        (future,) = await self._submit(event_type, [payload])
        return future.map(lambda r: (r.get("result") or {}).get("checkpoint") or {})

    async def _save_state(self, name, ttl_seconds, overwrite) -> APIFuture[SaveWeightsResponse]:
        future = await self._save(SAVE_STATE, name, ttl_seconds, overwrite, "WORKSPACE")
        return future.map(
            lambda c: SaveWeightsResponse(
                path=c["uri"], model=c.get("model_id") or self.model_id, size=int(c.get("size_bytes") or 0)
            )
        )

    def save_state(
        self, name: str, ttl_seconds: int | None = None, overwrite: bool = False
    ) -> APIFuture[SaveWeightsResponse]:
        """Save weights + optimizer state; `.path` resumes training (create_training_client_from_state)."""
        return self._rt.run_sync(self._save_state(name, ttl_seconds, overwrite))

    async def save_state_async(
        self, name: str, ttl_seconds: int | None = None, overwrite: bool = False
    ) -> APIFuture[SaveWeightsResponse]:
        return await self._rt.run_async(self._save_state(name, ttl_seconds, overwrite))

    async def _save_weights_for_sampler(
        self, name, ttl_seconds, visibility="WORKSPACE", kind="snapshot"
    ) -> APIFuture[SaveWeightsForSamplerResponse]:
        future = await self._save(SAVE_WEIGHTS, name, ttl_seconds, False, visibility, kind)
        return future.map(
            lambda c: SaveWeightsForSamplerResponse(
                path=c["uri"], model=c.get("model_id") or self.model_id, size=int(c.get("size_bytes") or 0)
            )
        )

    def save_weights_for_sampler(
        self, name: str, ttl_seconds: int | None = None
    ) -> APIFuture[SaveWeightsForSamplerResponse]:
        """Save the adapter (PEFT format) for sampling; `.path` goes to create_sampling_client."""
        return self._rt.run_sync(self._save_weights_for_sampler(name, ttl_seconds))

    async def save_weights_for_sampler_async(
        self, name: str, ttl_seconds: int | None = None
    ) -> APIFuture[SaveWeightsForSamplerResponse]:
        return await self._rt.run_async(self._save_weights_for_sampler(name, ttl_seconds))

    async def _save_weights_and_get_sampling_client(self, kind: str = "snapshot") -> SamplingClient:
        future = await self._save_weights_for_sampler(
            f"temp-sampling-{uuid.uuid4().hex}", TEMP_SAMPLING_TTL_S, "TEMPORARY", kind
        )
        saved = await future
        return await self._session.create_sampling_client(self.model_alias, saved.path)

    def save_weights_and_get_sampling_client(self, kind: str = "snapshot") -> SamplingClient:
        """A sampler on the current weights (after every event submitted so far). Blocks.

        kind "snapshot": those weights, for the sampler's life. kind "inflight": the run's moving
        weights — this save and every later inflight save of the run move every inflight sampler
        of the run (running generations switch between tokens); each sequence's
        `weights_versions` says which save produced each token."""
        return self._rt.run_sync(self._save_weights_and_get_sampling_client(kind))

    async def save_weights_and_get_sampling_client_async(self, kind: str = "snapshot") -> SamplingClient:
        return await self._rt.run_async(self._save_weights_and_get_sampling_client(kind))

    def inflight_sampling_client(self) -> SamplingClient:
        """`save_weights_and_get_sampling_client(kind="inflight")`: publish the current weights as
        the run's inflight target and get a sampler that follows its later inflight saves."""
        return self.save_weights_and_get_sampling_client("inflight")

    async def inflight_sampling_client_async(self) -> SamplingClient:
        return await self.save_weights_and_get_sampling_client_async("inflight")

    def create_sampling_client(self, model_path: str) -> SamplingClient:
        return self._rt.run_sync(self._session.create_sampling_client(self.model_alias, model_path))

    async def create_sampling_client_async(self, model_path: str) -> SamplingClient:
        return await self._rt.run_async(self._session.create_sampling_client(self.model_alias, model_path))

    async def _load_state(self, path: str, with_optimizer: bool) -> APIFuture[dict]:
        async with self._init_lock:
            if self._queue is not None:
                raise ValidationError(
                    "load_state must be called before the first training call of this client; "
                    "use create_training_client_from_state instead",
                    code="validation.already_initialized",
                )
            path = checkpoint_uri(path)
            source = await self._session.find_checkpoint(path)
            mismatches = [
                f"{field} (this run {mine!r}, checkpoint {theirs!r})"
                for field, mine, theirs in (
                    ("base_model", self.model_id, source.get("base_model")),
                    ("lora_rank", self.lora.rank, source.get("lora_rank")),
                    ("train_mlp", self.lora.train_mlp, source.get("train_mlp")),
                    ("train_attn", self.lora.train_attn, source.get("train_attn")),
                    ("train_unembed", self.lora.train_unembed, source.get("train_unembed")),
                )
                if mine != theirs
            ]
            if mismatches:
                raise ValidationError(
                    "Checkpoint configuration is incompatible: " + ", ".join(mismatches),
                    code="validation.checkpoint_config_mismatch",
                )
            run = await self._rt.control.call(
                "PATCH",
                f"openapi/v1/service-sessions/{self._session.session_id}/training-runs/{self.training_run_id}",
                json={"source_checkpoint_uri": path, "restore_optimizer": with_optimizer},
            )
            self._actor = (run["actor"], run["actor_jwt"])
            self._limits = Limits.from_wire(run.get("trainer"))
            self._source_checkpoint = run.get("source_checkpoint_uri") or path
            self._load_optimizer = bool(run.get("restore_optimizer", with_optimizer))
        await self._ensure_initialized()
        return APIFuture.completed({})

    def load_state(self, path: str) -> APIFuture[dict]:
        """Start this run from a save_state checkpoint's weights (before any training call)."""
        return self._rt.run_sync(self._load_state(path, False))

    async def load_state_async(self, path: str) -> APIFuture[dict]:
        return await self._rt.run_async(self._load_state(path, False))

    def load_state_with_optimizer(self, path: str) -> APIFuture[dict]:
        """Like load_state, and restore the optimizer's moments too."""
        return self._rt.run_sync(self._load_state(path, True))

    async def load_state_with_optimizer_async(self, path: str) -> APIFuture[dict]:
        return await self._rt.run_async(self._load_state(path, True))

    # -- logged metrics ---------------------------------------------------------------------

    def _metrics_body(self, metrics: dict[str, float], step: int | None) -> dict:
        if not isinstance(metrics, dict) or not metrics:
            raise ValidationError("metrics must be a non-empty dict of name -> number, e.g. {'reward': 0.5}")
        values = {}
        for k, v in metrics.items():
            try:
                values[k] = float(v)  # numpy and torch scalars too
            except (TypeError, ValueError):
                raise ValidationError(f"metrics[{k!r}] = {v!r} is not a number") from None
        if step is None:
            step = self._optim_steps
        if isinstance(step, bool) or not isinstance(step, int) or step < 0:
            raise ValidationError(f"step must be a non-negative int, got {step!r}")
        return {"step": step, "values": values}

    async def _log_metrics(self, body: dict) -> dict:
        task = asyncio.current_task()
        self._rt.flush_on_close.add(task)  # a script's last log_metrics is sent before the session closes
        try:
            return await self._rt.control.call(
                "POST", f"trine/v1/training-runs/{self.training_run_id}/metrics", json=body
            )
        finally:
            self._rt.flush_on_close.discard(task)

    def log_metrics(self, metrics: dict[str, float], step: int | None = None) -> APIFuture[dict]:
        """Record your own numbers for this run (reward, KL, accuracy, ...) at `step` (default: the
        number of optim_step calls made so far). They are plotted in the console beside the loss,
        listed by `trine runs show` and downloadable as CSV/JSON. Returns at once; `.result()`
        waits for the server to store them (the same step and name again replaces the value)."""
        body = self._metrics_body(metrics, step)
        return APIFuture(self._rt.spawn(self._log_metrics(body)))

    async def log_metrics_async(self, metrics: dict[str, float], step: int | None = None) -> dict:
        return await self._rt.run_async(self._log_metrics(self._metrics_body(metrics, step)))

    # -- local information ------------------------------------------------------------------

    def get_tokenizer(self) -> Any:
        return self._session.get_tokenizer(self.model_id, self.model_alias)

    def get_info(self) -> GetInfoResponse:
        return GetInfoResponse(
            training_run_id=self.training_run_id,
            model_id=self.model_id,
            base_model=self.model_alias,
            lora_config=self.lora,
        )

    def usage(self) -> Usage:
        """Tokens by phase used by this client's finished calls."""
        return self._usage.total


def _accepts_config(loss_fn) -> bool:
    try:
        inspect.signature(loss_fn).bind(None, None, None)
        return True
    except (TypeError, ValueError):
        return False


def _merge_metrics(out: ForwardBackwardOutput, metrics: dict[str, float]) -> ForwardBackwardOutput:
    return out.model_copy(update={"metrics": {**out.metrics, **metrics}})


async def _heartbeat_loop(conn: ActorConnection) -> None:
    """Tell the server the client is alive; the server may set the interval (`heartbeat_ms`)."""
    while True:
        interval = 60.0
        try:
            r = await conn.client.post(
                conn.endpoint + "v1/client/heartbeat",
                json={"sdk": "trine", "sdk_version": __version__},
                headers={"Authorization": f"Bearer {conn.token}", "Accept": "application/json"},
            )
            if r.status_code == 401:
                await conn.renew(failed_token=None)
            elif r.status_code < 400:
                ms = r.json().get("heartbeat_ms")
                if isinstance(ms, (int, float)) and ms > 0:
                    interval = max(1.0, ms / 1000)
        except asyncio.CancelledError:
            raise
        except Exception as e:  # noqa: BLE001 - a missed heartbeat is not an error
            log.debug("heartbeat failed: %s", e)
        await asyncio.sleep(interval)
