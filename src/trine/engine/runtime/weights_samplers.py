"""Samplers of full fine-tuning weights: one `Sampler` per model instance that requests name.

The worker's own sampler runs the base model and every LoRA adapter on it, in one batch over one KV
pool. A full run's snapshot is another model: its requests run on a sampler of its own, made on first
use with a KV pool of `SamplerConfig.full_weights_kv_cache_bytes` (a quarter of the base pool's when
unset), stepped by the worker beside the base sampler, and dropped with its pool once the snapshot
has left the adapter table (`prune`) and its last request is done.

A request keeps the weights identity it names (the snapshot's checkpoint id), which roots its prefix
cache chains as in every pool; `Sampler.add` pairs a request naming weights with an adapter, so it
runs with an adapter of `NO_TARGETS` (no targets: the model's own weights alone).

Invariants
- A request on full weights never meets another model's KV: each sampler's pool is its own, and its
  prefix cache is keyed by the request's weights identity as every pool is, so neither the base
  model's blocks nor another snapshot's are ever served to it.
- A request belongs to one sampler from `add` until its result or its cancel.
"""

from __future__ import annotations

from typing import Callable

from ..api import LoRAConfig, SampleDelta, SampleRequest, SampleResult
from ..model.lora import Adapter
from ..model.model import Transformer
from ..sampler.sampler import Sampler

NO_TARGETS = LoRAConfig(rank=1, train_attn=False, train_mlp=False, train_unembed=False)


class WeightsSamplers:
    def __init__(self, make: Callable[[Transformer], Sampler]):
        self._make = make  # a sampler on a model, with the full-weights KV pool
        # id(model) -> the model, its sampler and its adapter of no targets
        self._samplers: dict[int, tuple[Transformer, Sampler, Adapter]] = {}
        self._owner: dict[str, Sampler] = {}  # live request id -> its sampler

    def __len__(self) -> int:
        return len(self._samplers)

    def add(self, req: SampleRequest, model: Transformer) -> None:
        """Check and queue `req` on `model`'s sampler (made now if it has none); ValueError as
        `Sampler.add`."""
        held = self._samplers.get(id(model))
        if held is None:
            held = (model, self._make(model), Adapter(model, NO_TARGETS))  # adds nothing
        held[1].add(req, held[2])
        self._samplers[id(model)] = held
        self._owner[req.request_id] = held[1]

    def owns(self, request_id: str) -> bool:
        return request_id in self._owner

    def has_work(self) -> bool:
        return any(s.has_work() for _, s, _ in self._samplers.values())

    def step(self) -> list[SampleResult]:
        """One step of every sampler with work; the requests that finished."""
        results = []
        for _, sampler, _ in list(self._samplers.values()):
            if sampler.has_work():
                results += sampler.step()
        for r in results:
            self._owner.pop(r.request_id, None)
        return results

    def take_deltas(self) -> list[SampleDelta]:
        return [d for _, s, _ in self._samplers.values() for d in s.take_deltas()]

    def cancel(self, request_id: str) -> SampleResult | None:
        sampler = self._owner.pop(request_id, None)
        return sampler.cancel(request_id) if sampler is not None else None

    def prune(self, held: Callable[[Transformer], bool]) -> None:
        """Drop the samplers (and KV pools) of models no longer `held` that have nothing running."""
        for key, (model, sampler, _) in list(self._samplers.items()):
            if not held(model) and not sampler.has_work():
                del self._samplers[key]

    def clear(self) -> None:
        """Drop every sampler and request (after a failed step: the worker fails them)."""
        self._samplers.clear()
        self._owner.clear()
