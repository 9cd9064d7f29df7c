"""ServiceClient: the entry point. It checks the API key, opens a service session on the server
and creates training, sampling and REST clients that share its runtime (one background loop).

The session is closed (`ENDED`) by `close()`, by leaving a `with` block, or when the client and
every client derived from it are garbage collected or the interpreter exits.
"""

from __future__ import annotations

import os
import weakref
from typing import Any

from .. import __version__
from ..errors import AuthError, ValidationError
from ..types import (
    GetServerCapabilitiesResponse,
    LoraConfig,
    ModelOperationCapabilities,
    SupportedModel,
    Usage,
)
from . import tokenizer as tok
from .http import Settings
from .paths import checkpoint_uri
from .profile import load_profile
from .rest import RestClient
from .runtime import Runtime
from .sampling import SamplingClient
from .training import TrainingClient

DEFAULT_BASE_URL = "http://127.0.0.1:8000"
_configured: dict = {}


def configure(api_key: str | None = None, base_url: str | None = None, **settings) -> None:
    """Process-wide defaults for ServiceClients created afterwards: the API key, the base URL,
    and any `Settings` field (e.g. `retry_window_s=60`). Explicit constructor arguments win."""
    known = set(Settings.__dataclass_fields__)
    unknown = sorted(set(settings) - known)
    if unknown:
        raise ValueError(
            f"configure: unknown option(s) {unknown}; use api_key, base_url or one of {sorted(known)}"
        )
    if api_key is not None:
        _configured["api_key"] = api_key
    if base_url is not None:
        _configured["base_url"] = base_url
    _configured.setdefault("settings", {}).update(settings)


def _env(*names: str) -> str:
    for name in names:
        value = os.environ.get(name, "").strip()
        if value:
            return value
    return ""


def _labels(name: str | None, tags: list[str] | None, user_metadata: dict[str, str] | None) -> dict:
    """A training run's labels as the create-run body carries them (checked locally for type)."""
    if name is not None and not isinstance(name, str):
        raise ValidationError(f"name must be a str, got {type(name).__name__}")
    if tags is not None and (isinstance(tags, str) or not all(isinstance(t, str) for t in tags)):
        raise ValidationError("tags must be a list of str, e.g. ['grpo', 'arithmetic']")
    if user_metadata is not None and not isinstance(user_metadata, dict):
        raise ValidationError("user_metadata must be a dict of str to str")
    return {"name": name or "", "tags": list(tags or []), "user_metadata": user_metadata}


def _close_session(runtime: Runtime, session_id: str) -> None:
    """Finalizer: one best-effort close request (no retries: never hang an exiting program)."""

    async def close():
        try:
            await runtime.control.call(
                "POST",
                f"openapi/v1/service-sessions/{session_id}/close",
                json={"status": "ENDED"},
                retry=False,
            )
        except Exception:  # noqa: BLE001 - the server ends idle sessions on its own
            pass

    runtime.close(close())


class Session:
    """What derived clients share: the runtime and the server-side session id. Derived clients
    hold a reference to it, so the session lives as long as any of them."""

    def __init__(self, runtime: Runtime, session_id: str):
        self.runtime = runtime
        self.session_id = session_id
        self._finalizer = weakref.finalize(self, _close_session, runtime, session_id)

    def close(self) -> None:
        self._finalizer()

    async def create_sampling_client(self, base_model: str | None, model_path: str | None) -> SamplingClient:
        model_path = checkpoint_uri(model_path) if model_path else model_path
        if not base_model:
            if not model_path:
                raise ValidationError("create_sampling_client needs base_model or model_path")
            base_model = (await self.find_checkpoint(model_path))["base_model"]
        run = await self.runtime.control.call(
            "POST",
            f"openapi/v1/service-sessions/{self.session_id}/sampling-runs",
            json={"base_model": base_model, "source_checkpoint_uri": model_path or ""},
        )
        return SamplingClient(self, run)

    async def find_checkpoint(self, path: str) -> dict:
        return await self.runtime.control.call(
            "GET",
            "openapi/v1/training-runs/by-checkpoint-uri",
            params={"checkpoint_uri": checkpoint_uri(path)},
        )

    def get_tokenizer(self, model_id: str, model_alias: str) -> Any:
        """The served model's tokenizer (transformers), cached per model for this session."""
        rt = self.runtime
        with rt.tokenizer_lock:
            if model_id not in rt.tokenizers:
                t = tok.resolve_local(model_id, model_alias)
                if t is None:
                    files = rt.run_sync(tok.fetch_tokenizer_files(rt.control, model_alias))
                    t = tok.install(model_id, model_alias, files)
                rt.tokenizers[model_id] = t
            return rt.tokenizers[model_id]


class ServiceClient:
    def __init__(
        self, api_key: str | None = None, base_url: str | None = None, *, settings: Settings | None = None
    ):
        """Connect to a trine server at `base_url` with `api_key`. Unset, they come from
        `trine.configure(...)`, then $TRINE_BASE_URL / $TRINE_API_KEY, then $PYTRIO_BASE_URL /
        $PYTRIO_API_KEY (so a PyTRIO setup pointed at trine works as is), then the profile that
        `trio login` saved (~/.pytrio); the URL defaults to http://127.0.0.1:8000. `trine serve`
        prints a key.

        A server that cannot be reached fails here within `settings.connect_check_s` (5 s)."""
        profile = None
        if api_key is None and not (_configured.get("api_key") or _env("TRINE_API_KEY", "PYTRIO_API_KEY")):
            profile = load_profile()
        base_url = (
            base_url
            or _configured.get("base_url")
            or _env("TRINE_BASE_URL", "PYTRIO_BASE_URL")
            or (profile.base_url if profile else "")
            or DEFAULT_BASE_URL
        )
        if api_key is None:
            api_key = (
                _configured.get("api_key")
                or _env("TRINE_API_KEY", "PYTRIO_API_KEY")
                or (profile.api_key if profile else "")
            )
        api_key = api_key.strip()
        if settings is None:
            settings = Settings(**_configured.get("settings", {}))
        if not api_key:
            raise AuthError(
                "no API key: pass ServiceClient(api_key=...) or set TRINE_API_KEY "
                "(`trine serve` prints one; `trine keys create --name NAME` makes more)",
                code="auth.missing_api_key",
            )
        self.base_url = base_url
        runtime = Runtime(base_url, api_key, settings)

        async def open_session():
            # the first contact: fail fast if nothing answers (the long retry window is for restarts)
            identity = await runtime.control.call(
                "GET",
                "openapi/v1/api-key/verify",
                retry_window_s=settings.connect_check_s,
                timeout=max(settings.connect_check_s, 1.0),
            )
            session = await runtime.control.call(
                "POST", "openapi/v1/service-sessions", json={"sdk_version": __version__}
            )
            return identity, session

        try:
            identity, session = runtime.run_sync(open_session())
        except AuthError as e:
            runtime.close()
            if profile is not None:
                e.message += f" (the key came from {profile.path}, saved by `trio login`)"
            raise
        except BaseException:
            runtime.close()
            raise
        self.user_id: str = identity.get("user_cuid", "")
        self.username: str = identity.get("username", "")
        self.workspace_cuid: str = identity.get("workspace_cuid", "")
        self.service_session_cuid: str = session["service_session_cuid"]
        self._session = Session(runtime, self.service_session_cuid)
        self._rt = runtime

    # -- lifecycle ---------------------------------------------------------------------------

    def close(self) -> None:
        """End the session on the server and stop the background loop. Derived clients stop working."""
        self._session.close()

    def __enter__(self) -> ServiceClient:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def usage(self) -> Usage:
        """Tokens by phase (and cost, if the server prices them) of every finished call made
        through this client and the clients derived from it."""
        return self._rt.usage.total

    # -- training ----------------------------------------------------------------------------

    async def _create_training_run(
        self,
        base_model: str,
        lora: LoraConfig,
        source: str,
        restore_optimizer: bool,
        labels: dict | None = None,
    ):
        body = {
            "base_model": base_model,
            "lora_rank": lora.rank,
            "train_mlp": lora.train_mlp,
            "train_attn": lora.train_attn,
            "train_unembed": lora.train_unembed,
            "source_checkpoint_uri": source,
            "restore_optimizer": restore_optimizer,
            **(labels or {}),
        }
        if lora.seed is not None:
            body["seed"] = lora.seed
        if lora.full:  # trine's own fields: the PyTRIO plane refuses rank 0 without them
            body["full_fine_tuning"] = True
            if lora.trainable_token_indices:
                body["trainable_token_indices"] = lora.trainable_token_indices
        run = await self._rt.control.call(
            "POST", f"openapi/v1/service-sessions/{self.service_session_cuid}/training-runs", json=body
        )
        return TrainingClient(
            self._session, run, lora, source_checkpoint=source or None, load_optimizer=restore_optimizer
        )

    def create_lora_training_client(
        self,
        base_model: str,
        rank: int = 32,
        seed: int | None = None,
        train_mlp: bool = True,
        train_attn: bool = True,
        train_unembed: bool = True,
        *,
        full: bool = False,
        trainable_token_indices: list[int] | None = None,
        lora_path: str | os.PathLike | None = None,
        name: str | None = None,
        tags: list[str] | None = None,
        user_metadata: dict[str, str] | None = None,
    ) -> TrainingClient:
        """A new training run on `base_model`: a fresh LoRA adapter of `rank`; with `full=True` (trine's
        own) full-parameter fine-tuning of the model's weights (`train_attn`, `train_mlp`, and with
        `train_unembed` the embedding and head; `trainable_token_indices`: only those embedding rows);
        with `lora_path`, the PEFT adapter in that directory, uploaded and checked against the model
        (its rank and targets are the adapter's). `name`, `tags` and `user_metadata` label it in the
        console, `trine runs` and `trine usage --by run`."""
        return self._rt.run_sync(
            self._create_lora(
                base_model,
                rank,
                seed,
                train_mlp,
                train_attn,
                train_unembed,
                full,
                trainable_token_indices,
                lora_path,
                _labels(name, tags, user_metadata),
            )
        )

    async def create_lora_training_client_async(
        self,
        base_model: str,
        rank: int = 32,
        seed: int | None = None,
        train_mlp: bool = True,
        train_attn: bool = True,
        train_unembed: bool = True,
        *,
        full: bool = False,
        trainable_token_indices: list[int] | None = None,
        lora_path: str | os.PathLike | None = None,
        name: str | None = None,
        tags: list[str] | None = None,
        user_metadata: dict[str, str] | None = None,
    ) -> TrainingClient:
        return await self._rt.run_async(
            self._create_lora(
                base_model,
                rank,
                seed,
                train_mlp,
                train_attn,
                train_unembed,
                full,
                trainable_token_indices,
                lora_path,
                _labels(name, tags, user_metadata),
            )
        )

    async def _create_lora(
        self, base_model, rank, seed, train_mlp, train_attn, train_unembed, full, tokens, lora_path, labels
    ) -> TrainingClient:
        if not isinstance(base_model, str) or not base_model:
            raise ValidationError("base_model must be a model name, e.g. 'SmolLM2-135M-Instruct'")
        if lora_path is not None:
            if full:
                raise ValidationError(
                    "lora_path continues a LoRA adapter; full=True trains the weights instead"
                )
            ck = await RestClient(self._session).import_adapter_async(lora_path, base_model)
            return await self._from_checkpoint(ck.path, False, labels, seed)
        lora = LoraConfig(
            rank=rank,
            seed=seed,
            train_mlp=train_mlp,
            train_attn=train_attn,
            train_unembed=train_unembed,
            full=full,
            trainable_token_indices=tokens,
        )
        return await self._create_training_run(base_model, lora, "", False, labels)

    async def _from_state(self, path: str, restore_optimizer: bool) -> TrainingClient:
        return await self._from_checkpoint(checkpoint_uri(path), restore_optimizer)

    async def _from_checkpoint(
        self, path: str, restore_optimizer: bool, labels: dict | None = None, seed: int | None = None
    ) -> TrainingClient:
        """A run from checkpoint `path`, in its shape (the server's: a rank PyTRIO's client would not
        make, or full fine-tuning, included)."""
        info = await self._session.find_checkpoint(path)
        lora = LoraConfig.model_construct(
            rank=info["lora_rank"],
            seed=info.get("seed") if seed is None else seed,
            train_mlp=info["train_mlp"],
            train_attn=info["train_attn"],
            train_unembed=info["train_unembed"],
            full=info["lora_rank"] == 0,
            trainable_token_indices=info.get("trainable_token_indices"),
        )
        return await self._create_training_run("", lora, path, restore_optimizer, labels)

    def create_training_client_from_state(self, path: str) -> TrainingClient:
        """A new training run starting from a save_state checkpoint's weights (fresh optimizer)."""
        return self._rt.run_sync(self._from_state(path, False))

    async def create_training_client_from_state_async(self, path: str) -> TrainingClient:
        return await self._rt.run_async(self._from_state(path, False))

    def create_training_client_from_state_with_optimizer(self, path: str) -> TrainingClient:
        """Like create_training_client_from_state, restoring the optimizer's state too."""
        return self._rt.run_sync(self._from_state(path, True))

    async def create_training_client_from_state_with_optimizer_async(self, path: str) -> TrainingClient:
        return await self._rt.run_async(self._from_state(path, True))

    # -- sampling, metadata ------------------------------------------------------------------

    def create_sampling_client(
        self, base_model: str | None = None, model_path: str | None = None
    ) -> SamplingClient:
        """A sampler on `base_model`, or on saved weights `model_path` (a `trio://` or `tinker://` path)."""
        return self._rt.run_sync(self._session.create_sampling_client(base_model, model_path))

    async def create_sampling_client_async(
        self, base_model: str | None = None, model_path: str | None = None
    ) -> SamplingClient:
        return await self._rt.run_async(self._session.create_sampling_client(base_model, model_path))

    async def _get_server_capabilities(self) -> GetServerCapabilitiesResponse:
        items: list[dict] = []
        while True:
            page = await self._rt.control.call("GET", "models", params={"limit": 100, "offset": len(items)})
            items += page.get("items") or []
            if not page.get("items") or len(items) >= int(page.get("total", 0)):
                break

        def caps(item: dict, key: str, available: str) -> ModelOperationCapabilities:
            c = item.get(key) or {}
            return ModelOperationCapabilities(
                available=bool(item.get(available)),
                max_batch_size=c.get("max_batch_size"),
                max_tokens_per_request=c.get("max_tokens_per_request"),
                max_seq_len=c.get("max_seq_len"),
            )

        return GetServerCapabilitiesResponse(
            supported_models=[
                SupportedModel(
                    model_name=m["model_id"],
                    max_context_length=m.get("context_length"),
                    alias=m.get("alias"),
                    pricing=m.get("pricing"),
                    training=caps(m, "trainer", "train_available"),
                    sampling=caps(m, "sampler", "sample_available"),
                )
                for m in items
            ]
        )

    def get_server_capabilities(self) -> GetServerCapabilitiesResponse:
        return self._rt.run_sync(self._get_server_capabilities())

    async def get_server_capabilities_async(self) -> GetServerCapabilitiesResponse:
        return await self._rt.run_async(self._get_server_capabilities())

    def get_supported_models(self) -> list[str]:
        return [m.model_name for m in self.get_server_capabilities().supported_models]

    def create_rest_client(self) -> RestClient:
        return RestClient(self._session)
