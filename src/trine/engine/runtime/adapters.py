"""The adapters an engine samples from: snapshots by checkpoint id, and inflight targets.

One table per engine, touched by its worker thread only.
- A *snapshot* is a published weights save or a loaded PEFT directory, named by its checkpoint id;
  it never changes. A full fine-tuning run's snapshot is a model (`Transformer`), not an adapter.
- An *inflight target* is a training run's moving weights (target id = the run id) at a version;
  `publish` moves it forward, never back (publications may arrive out of order on a pool).

A sample request names its weights by `weights.adapter` and `resolve` turns that into the adapter
it runs; an inflight request also gets the target's current version. Nothing outside the engine
sees an adapter.
"""

from __future__ import annotations

import dataclasses

from ..api import SampleRequest
from ..model.lora import Adapter
from ..model.model import Transformer

Weights = Adapter | Transformer  # a LoRA adapter on the base model, or a full run's own model


class AdapterTable:
    def __init__(self) -> None:
        self._snapshots: dict[str, Weights] = {}  # checkpoint id -> weights
        self._targets: dict[str, tuple[int, Adapter]] = {}  # inflight target -> (version, weights)

    def __len__(self) -> int:
        return len(self._snapshots)

    # ------------------------------------------------------------------ snapshots
    def hold(self, checkpoint_id: str, adapter: Weights) -> None:
        self._snapshots[checkpoint_id] = adapter

    def holds(self, weights: Weights) -> bool:
        """Whether a snapshot or a target is these weights (by identity)."""
        return any(w is weights for w in self._snapshots.values()) or any(
            w is weights for _, w in self._targets.values()
        )

    def evict(self, checkpoint_id: str) -> None:
        self._snapshots.pop(checkpoint_id, None)

    def snapshot(self, checkpoint_id: str) -> Weights:
        adapter = self._snapshots.get(checkpoint_id)
        if adapter is None:
            raise ValueError(
                f"checkpoint {checkpoint_id} is not held by this engine; load it (load_adapter) first"
            )
        return adapter

    # ------------------------------------------------------------------ inflight targets
    def publish(self, target: str, version: int, adapter: Adapter) -> bool:
        """Move `target` to `adapter` at `version`; False (and no change) for an older version."""
        held = self._targets.get(target)
        if held is not None and held[0] >= version:
            return False
        self._targets[target] = (version, adapter)
        return True

    def target_version(self, target: str) -> int:
        """The version of the target's weights held here (0: none)."""
        held = self._targets.get(target)
        return held[0] if held else 0

    def drop_target(self, target: str) -> None:
        self._targets.pop(target, None)

    # ------------------------------------------------------------------ requests
    def resolve(self, req: SampleRequest) -> tuple[SampleRequest, Weights | None]:
        """The weights `req.weights.adapter` names (None: the base model); an inflight request also
        gets its target's current version (a copy: the caller's request is untouched)."""
        name = req.weights.adapter
        if req.inflight:
            held = self._targets.get(name)
            if held is None:
                raise ValueError(
                    f"inflight target {name!r} is not held by this engine; publish it "
                    "(publish_target) before sampling from it"
                )
            version, adapter = held
            return dataclasses.replace(
                req, weights=dataclasses.replace(req.weights, version=version)
            ), adapter
        if name is None:
            return req, None
        adapter = self._snapshots.get(name)
        if adapter is None:
            raise ValueError(
                f"adapter {name!r} is not loaded on this engine; load it (load_adapter) before "
                "sampling from it"
            )
        return req, adapter
