"""Per-key limits: live training runs, their adapter memory, and queued training tokens.

One key cannot take the machine from the others: past a limit (`limits.KeyLimits`) a request is
refused with 429 naming the limit, before anything is created or queued.

Adapter memory is estimated from the run's LoRA shape: rank x (in + out features of every
targeted layer) fp32 parameters, held four times (weights, gradients, two Adam moments). A full
fine-tuning run (rank 0) counts what it holds (`FullTuningShape.run_bytes`): its own weights, a
snapshot, gradients, masters and AdamW state.
"""

from __future__ import annotations

from ..engine.api import Forward, LoRAConfig, Op
from ..limits import KeyLimits
from ..store import ApiKey, Store, TrainingRun
from .errors import TooManyRequests
from .models import ServedModel

COPIES = 4  # weights, gradients, Adam's two moments


def adapter_bytes(m: ServedModel, lora: LoRAConfig) -> int:
    """The training memory a run of shape `lora` holds on `m` (estimated as the module docstring says)."""
    if m.info is None:
        return 0
    if lora.full:
        return m.info.full_tuning.run_bytes(lora) if m.info.full_tuning is not None else 0
    features = m.info.lora_features
    return lora.rank * sum(features.get(t, 0) for t in lora.target_names()) * 4 * COPIES


class KeyQuotas:
    def __init__(self, *, store: Store, models: dict[str, ServedModel], limits: KeyLimits | None = None):
        self.store = store
        self.models = models
        self.limits = limits or KeyLimits()

    def check_new_run(self, key: ApiKey, m: ServedModel, lora: LoRAConfig) -> None:
        live, count = self.store.training_runs(key.id, status="ACTIVE")
        if count >= self.limits.live_runs:
            raise TooManyRequests(
                f"this key already has {count} live training runs, the limit per key "
                f"(live_runs = {self.limits.live_runs}); close sessions or finish runs first",
                code="key_limit_live_runs",
            )
        held = sum(self._run_bytes(r) for r in live)
        new = adapter_bytes(m, lora)
        if held + new > self.limits.adapter_bytes:
            what = "a full fine-tuning run" if lora.full else f"a rank-{lora.rank} run"
            raise TooManyRequests(
                f"{what} needs about {new / 2**20:.0f} MiB of training memory and "
                f"this key's live runs hold {held / 2**20:.0f} MiB; the limit per key is "
                f"{self.limits.adapter_bytes / 2**20:.0f} MiB (adapter_bytes): use a lower "
                "rank or finish runs first",
                code="key_limit_adapter_memory",
            )

    def check_queue(self, key: ApiKey, op: Op, queued_tokens: int) -> None:
        """`queued_tokens`: the key's forward tokens accepted and not yet run."""
        if isinstance(op, Forward) and queued_tokens + op.tokens > self.limits.queued_tokens:
            raise TooManyRequests(
                f"this key has {queued_tokens} training tokens queued; {op.tokens} more would "
                f"pass the limit per key (queued_tokens = {self.limits.queued_tokens}): wait "
                "for queued events to finish",
                code="key_limit_queued_tokens",
            )

    def _run_bytes(self, r: TrainingRun) -> int:
        m = self.models.get(r.base_model)
        return adapter_bytes(m, LoRAConfig.named_by(r)) if m else 0
