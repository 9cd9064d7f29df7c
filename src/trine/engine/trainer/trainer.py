"""Training runs on one base model: forward_backward, optim_step, checkpoints.

A LoRA run is an `Adapter` with its own optimizer state (AdamW, or Dimuon: dimuon.py, chosen when the
run is made); many runs share the frozen base model. One `forward_backward` call packs the data of
many LoRA runs into the same micro-batches (each row uses its run's adapter), so each run's gradient
lands only in its own adapter. A full fine-tuning run (rank 0, full.py) owns a copy of the model:
its rows run on that copy, in micro-batches of their own, by the same code (`_on`), and AdamW steps
its weights (their fp32 masters). Every full run is admitted against the memory budget of
`full_tuning` (`FullTuningShape.run_bytes`) before anything is allocated.

Each entry of a `forward_backward` batch is a `(run_id, Forward)` pair: the op's data, its parsed
`Loss`, its `denominator` (engine/prepare.py: the whole logical batch's token count, so chunks of one
batch add up to its gradient; None: the plain sum) and the datums' `counts`. A prepared op (every
event the service accepted) brings its counts and is not checked again; one without them (a direct
caller's) is checked first, by the same `check_datum`. Its gradient is the gradient of its summed
loss divided by the denominator; without one the loss is the plain sum (the Tinker API). The
reported `loss_sum`, per-token losses and logprobs never depend on it.

How a micro-batch is computed: micro_batch.py. Its rows are grouped by length under
`micro_batch_tokens`, the body runs once with autograd, only positions with a target go through the
LM head, a chunk at a time with each chunk's gradient pushed back at once (the full logits are never
stored), and the gradient gathered for the hidden states flows back through the body in one call.

Prefix sharing (`prefix_sharing=True`, the default): datums of one run that share a token prefix
(a GRPO group's prompt, a multi-turn chain's earlier turns) are grouped first (prefix_groups.py)
and their micro-batches compute each shared position once (shared_prefix.py; a hybrid model's
children start from their prefix's recurrent state), with the same logprobs, losses and
gradients; the other datums take the path above. `TrainUsage.train_tokens`
counts the positions computed, `sequence_tokens` the positions sent.

Images (`TrainDatum.images`, a vision-language model's trainer, given the engine's `ImageEncoder`):
a datum's image positions take the frozen tower's features (under no_grad: LoRA trains the language
model) and multimodal RoPE positions (`inputs`); targets at image positions were set to -100 at
acceptance, so the loss falls on text targets only. Prefix sharing compares images as well as
tokens (`images.keyed_tokens`).

Custom losses (a client's graph, custom_graph.py) are not elementwise: like gspo, a micro-batch
computes its datums' logprobs first (values only), runs each datum's graph on them for the loss and
its gradient dC/dlogp, and the LM head then uses that gradient, so the body runs forward and
backward once (micro_batch.py). Their datums stay off the shared-prefix path. Each graph is first
run on all-zero logprobs with the datum's inputs (`_prepare`), so a graph that cannot run fails
before anything computes.

Invariants
- Gradients accumulate in each run's adapter (a full run's masters) across calls until
  `optim_step`, which applies the run's optimizer, `torch.optim.AdamW` or `Dimuon` (clipping with
  `clip_grad_norm_` first when asked), zeroes the gradients and bumps the version; a step's
  settings must be of the run's family.
  Versions come from one counter per trainer, so (base_model, run_id, version) never names two
  different weights, even across delete_run / create_run or load_state.
- All input is validated before any computation touches gradients.
- `snapshot` returns a detached copy that the trainer never modifies (one per version).
"""

from __future__ import annotations

import copy
import ctypes
import gc
import itertools
import math
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import torch

from ...limits import check_lora_rank, check_token_indices
from ..api import (
    ADAMW,
    DIMUON,
    AdamConfig,
    DimuonConfig,
    Forward,
    FullTuningShape,
    LoRAConfig,
    Loss,
    TrainDatum,
    WeightsIdentity,
    optimizer_of,
)
from ..config import TrainerConfig
from ..images import check_placement, keyed_tokens
from ..model.lora import Adapter
from ..model.model import Transformer
from ..model.multimodal import ImageEncoder, image_inputs
from ..prepare import check_datum
from . import checkpoint, head, micro_batch, prefix_groups, shared_prefix
from .export import export_merged
from .full import FullWeights, available_memory, is_full_checkpoint, read_full_shape, tuning_shape
from .losses import datum_tensors
from .micro_batch import Row
from .optimizers import check_adam, new_optimizer, optimizer_family


@dataclass
class _Run:
    lora: LoRAConfig
    adapter: Adapter | None  # None for a full run
    optimizer: torch.optim.Optimizer  # AdamW or Dimuon
    version: int
    snapshot: Adapter | Transformer | None = None
    snapshot_version: int = -1
    full: FullWeights | None = None  # a full fine-tuning run's own weights

    def params(self) -> list[torch.Tensor]:
        """What its optimizer steps: the adapter's parameters, or a full run's masters."""
        return self.full.masters if self.full is not None else list(self.adapter.parameters())


class InsufficientMemory(ValueError):
    """A full fine-tuning run that does not fit the replica's budget: refused before it allocates."""

    code = "insufficient_memory"


@dataclass
class TrainUsage:
    train_tokens: int = 0  # positions computed
    loss_tokens: int = 0  # positions with a non-zero weight or advantage
    sequence_tokens: int = 0  # positions of the datums as sent


@dataclass
class ForwardResult:
    """One batch entry's per-datum target logprobs and elementwise losses, and summed metrics."""

    logprobs: list[list[float]]
    losses: list[list[float]]
    loss_sum: float
    token_count: int
    usage: TrainUsage = field(default_factory=TrainUsage)
    metrics: dict[str, float] = field(default_factory=dict)  # a custom loss's, reduced by suffix
    error: str = ""  # a custom loss that failed on a datum's real logprobs: the event fails with it

    @property
    def loss_mean(self) -> float:
        return self.loss_sum / self.token_count if self.token_count else 0.0


class Trainer:
    """Training runs (a LoRA adapter, or a full run's own weights, + optimizer state) on one base
    model. `full_tuning`: what full runs cost and may hold together (default: three quarters of the
    memory free now)."""

    def __init__(
        self,
        model: Transformer,
        *,
        base_model: str,
        config: TrainerConfig = TrainerConfig(),
        full_tuning: FullTuningShape | None = None,
        encoder: ImageEncoder | None = None,
    ):
        """`encoder`: the engine's image encoder, for a model that takes images (None: text only)."""
        model.requires_grad_(False)  # the base is frozen and shared; only adapters train
        self.model = model
        self.base_model = base_model
        self.config = config
        self.micro_batch_tokens = config.micro_batch_tokens
        self.full_micro_batch_tokens = config.full_micro_batch_tokens
        self.logits_chunk_tokens = config.logits_chunk_tokens
        self.prefix_sharing = config.prefix_sharing  # compute each token shared by datums of one run once
        self.min_shared_tokens = config.min_shared_tokens
        self._runs: dict[str, _Run] = {}
        self._versions = itertools.count(1)
        self._workspace = head.LogitsWorkspace()  # the LM head's [chunk, vocab] buffers, kept
        self.encoder = encoder  # the frozen vision tower behind its cache (model/multimodal.py)
        self.full_tuning = full_tuning or tuning_shape(model, available_memory(model.device) * 3 // 4)

    # ------------------------------------------------------------------ runs
    def create_run(self, run_id: str, lora: LoRAConfig, *, optimizer: str = ADAMW) -> None:
        """A fresh adapter (a copy of the weights for a full run, rank 0) trained by the `optimizer`
        family (one of OPTIMIZERS; AdamW for a full run)."""
        if run_id in self._runs:
            raise ValueError(f"run_id {run_id!r} already exists")
        if lora.full:
            self._admit_full(self._check_full(lora, optimizer))
            full = FullWeights.fresh(self.model, lora)
            self._install(run_id, lora, None, full.new_optimizer(), full)
            return
        adapter = Adapter(self.model, _check_lora(lora), device=self.model.device)
        self._install(run_id, lora, adapter, new_optimizer(adapter, optimizer, lora.rank))

    def _check_full(self, lora: LoRAConfig, optimizer: str) -> LoRAConfig:
        if optimizer != ADAMW:
            raise ValueError(
                f"optimizer {optimizer!r}: full fine-tuning (rank 0) trains with {ADAMW}; "
                f"{DIMUON} steps LoRA matrices"
            )
        if lora.trainable_token_indices:
            check_token_indices(list(lora.trainable_token_indices), self.model.cfg.vocab_size)
        return lora

    def _admit_full(self, lora: LoRAConfig) -> None:
        """Refuse a full run the budget cannot hold, naming the bytes it needs and the bytes free."""
        shape = self.full_tuning
        need = shape.run_bytes(lora)
        held = sum(shape.run_bytes(r.lora) for r in self._runs.values() if r.full is not None)
        if held + need > shape.budget_bytes:
            raise InsufficientMemory(
                f"full fine-tuning of {self.base_model} needs {need} bytes (its weights, a sampler "
                f"snapshot, gradients, fp32 masters and AdamW state); {max(shape.budget_bytes - held, 0)} "
                f"of the {shape.budget_bytes} bytes for full runs are free: end a full run, or train LoRA"
            )

    def delete_run(self, run_id: str) -> None:
        """Drop the run's adapter, gradients and optimizer state, and hand the memory back."""
        self._run(run_id)
        del self._runs[run_id]
        return_freed_memory()

    @property
    def num_runs(self) -> int:
        return len(self._runs)

    def has_run(self, run_id: str) -> bool:
        return run_id in self._runs

    def lora_config(self, run_id: str) -> LoRAConfig:
        return self._run(run_id).lora

    def adapter(self, run_id: str) -> Adapter:
        """The live adapter: its weights change at every optim_step (and its version with them)."""
        run = self._run(run_id)
        if run.adapter is None:
            raise ValueError(f"run {run_id} is a full fine-tuning run: it has no adapter")
        return run.adapter

    def full_weights(self, run_id: str) -> FullWeights:
        """A full run's live weights (they change at every optim_step)."""
        run = self._run(run_id)
        if run.full is None:
            raise ValueError(f"run {run_id} is a LoRA run: it has no weights of its own")
        return run.full

    def weights_identity(self, run_id: str) -> WeightsIdentity:
        return WeightsIdentity(self.base_model, run_id, self._run(run_id).version)

    def snapshot(self, run_id: str) -> Adapter | Transformer:
        """A detached copy of the current weights (an adapter, or a full run's model), never modified
        afterwards; one copy per version."""
        run = self._run(run_id)
        if run.snapshot is None or run.snapshot_version != run.version:
            run.snapshot = None  # a full run's old copy is freed before the new one is made
            if run.full is not None:
                snap = run.full.snapshot()
            else:
                snap = copy.deepcopy(run.adapter)  # Parameter deepcopy clones data, not .grad
                snap.requires_grad_(False)
            run.snapshot, run.snapshot_version = snap, run.version
        return run.snapshot

    def _run(self, run_id: str) -> _Run:
        run = self._runs.get(run_id)
        if run is None:
            raise ValueError(f"run_id {run_id!r} is not a training run on {self.base_model}")
        return run

    def optimizer_family(self, run_id: str) -> str:
        return optimizer_family(self._run(run_id).optimizer)

    def _install(
        self,
        run_id: str,
        lora: LoRAConfig,
        adapter: Adapter | None,
        optimizer: torch.optim.Optimizer,
        full: FullWeights | None = None,
    ) -> None:
        self._runs[run_id] = _Run(lora, adapter, optimizer, next(self._versions), full=full)

    # ------------------------------------------------------------------ forward / backward
    def forward_backward(
        self,
        batch: list[tuple[str, Forward]],
        *,
        backward: bool = True,
        between_microbatches: Callable[[], None] | None = None,
    ) -> list[ForwardResult]:
        """One ForwardResult per (run_id, Forward) entry, in order.

        The data of all entries are packed together. An op's `denominator` (a number >= 1, or None
        for the plain sum) divides that entry's gradient. backward=False is `forward`: no gradient
        changes (this flag decides, not the ops' own `backward`, by which the cycle groups them).
        `between_microbatches` is called after each micro-batch.
        """
        rows = self._prepare(batch)
        logps = [torch.zeros(len(r.datum)) for r in rows]
        losses = [torch.zeros(len(r.datum)) for r in rows]
        charged = [0] * len(rows)
        by_model: dict[int, list[int]] = {}  # the base model's rows, then each full run's
        for i, row in enumerate(rows):
            by_model.setdefault(id(row.weights), []).append(i)
        for idx in by_model.values():
            part = [rows[i] for i in idx]
            computed = self._on(part[0].weights)._compute(
                part, [logps[i] for i in idx], [losses[i] for i in idx], backward, between_microbatches
            )
            for i, c in zip(idx, computed):
                charged[i] = c
        results = [ForwardResult([], [], 0.0, 0, TrainUsage()) for _ in batch]
        for row, logp, loss, computed in zip(rows, logps, losses, charged):
            res = results[row.entry]
            res.logprobs.append(logp.tolist())
            res.losses.append(loss.tolist())
            res.loss_sum += float(loss.double().sum()) if row.custom is None else row.custom.loss
            res.error = res.error or row.error
            for key, value in row.custom.metrics.items() if row.custom is not None else ():
                res.metrics[key] = res.metrics.get(key, 0.0) + value
            res.token_count += row.counts.active_tokens
            res.usage.train_tokens += computed
            res.usage.sequence_tokens += len(row.datum)
            res.usage.loss_tokens += row.counts.loss_tokens(row.loss.is_policy)
        for res, (_, op) in zip(results, batch):  # a custom loss's :mean metrics: over datums
            res.metrics = {k: v / len(op.data) if k.endswith(":mean") else v for k, v in res.metrics.items()}
        return results

    def _on(self, weights: Transformer | None) -> Trainer:
        """This trainer computing on a full run's model (`weights`), or itself (None: the base)."""
        if weights is None:
            return self
        view = copy.copy(self)  # shares the runs and the head's workspace
        view.model = weights
        view.micro_batch_tokens = self.full_micro_batch_tokens
        return view

    def _compute(
        self,
        rows: list[Row],
        logps: list[torch.Tensor],
        losses: list[torch.Tensor],
        backward: bool,
        between_microbatches: Callable[[], None] | None,
    ) -> list[int]:
        """Rows that all run on `self.model`: shared prefixes first, then plain micro-batches; fills
        each row's logps and losses and returns the positions computed for each."""
        shared = self._plan(rows)
        for trees in shared.batches:
            shared_prefix.run_micro_batch(self, rows, trees, logps, losses, backward)
            if between_microbatches is not None:
                between_microbatches()
        plain = [rows[i] for i in shared.plain]
        for mb in micro_batch.micro_batches(plain, self.micro_batch_tokens):
            mb = [shared.plain[i] for i in mb]
            micro_batch.run_micro_batch(
                self, [rows[i] for i in mb], [logps[i] for i in mb], [losses[i] for i in mb], backward
            )
            if between_microbatches is not None:
                between_microbatches()
        return shared.charged

    def _prepare(self, batch: list[tuple[str, Forward]]) -> list[Row]:
        if not isinstance(batch, (list, tuple)) or not batch:
            raise ValueError("batch must be a non-empty list of (run_id, Forward)")
        vocab = self.model.cfg.vocab_size
        rows = []
        for e, entry in enumerate(batch):
            if not (isinstance(entry, (tuple, list)) and len(entry) == 2 and isinstance(entry[1], Forward)):
                raise ValueError(f"batch[{e}] must be a (run_id, Forward) pair")
            run_id, op = entry
            data, loss, counts = op.data, op.loss, op.counts  # a prepared op's counts: checked at acceptance
            scale = micro_batch.grad_scale(op.denominator, f"batch[{e}]")
            run = self._run(run_id)
            weights = run.full.model if run.full is not None else None
            if not isinstance(loss, Loss):
                raise ValueError(
                    f"batch[{e}] loss_fn {loss!r}: pass a parsed Loss (Loss.parse(name, config))"
                )
            if not isinstance(data, (list, tuple)) or not data:
                raise ValueError(f"batch[{e}] data must be a non-empty list of TrainDatum")
            spec = self.encoder.spec if self.encoder is not None else None
            for i, d in enumerate(data):  # images first: a text model's vocabulary lacks placeholders
                if isinstance(d, TrainDatum) and d.images:
                    check_placement(d.tokens, d.images, spec, self.base_model, f"batch[{e}].data[{i}]")
            if counts is None:
                counts = [check_datum(d, loss, vocab, f"batch[{e}].data[{i}]") for i, d in enumerate(data)]
            for i, (datum, c) in enumerate(zip(data, counts)):
                rows.append(Row(e, datum_tensors(datum, loss), c, run.adapter, loss, scale, weights=weights))
                if loss.custom is not None:  # its graph's errors surface here, before anything runs
                    rows[-1].custom = micro_batch.custom_dry_run(loss, rows[-1].datum, f"data[{i}]")
        return rows

    def _plan(self, rows: list[Row]) -> prefix_groups.Plan:
        """Which rows share a prefix (keyed by adapter: runs never share); all plain when off."""
        if not self.prefix_sharing or len(rows) < 2:
            return prefix_groups.Plan([], list(range(len(rows))), [len(r.datum) for r in rows])
        keys = {id(r.adapter): k for k, r in reversed(list(enumerate(rows)))}
        # a custom loss's datums stay on the plain path: a key of their own shares nothing
        key_of = [keys[id(r.adapter)] if r.loss.custom is None else len(rows) + i for i, r in enumerate(rows)]
        # a context key's K and V (in the layers that attend: a hybrid model's linear layers keep
        # a state per row instead) against the least a token's activations hold
        cfg = self.model.cfg
        kv = 2 * cfg.num_kv_heads * cfg.head_dim * len(cfg.attention_layers) / cfg.num_layers
        context_cost = kv / (4 * cfg.hidden_size + 3 * cfg.intermediate_size)
        return prefix_groups.plan(  # equal placeholders of different images share nothing
            [keyed_tokens(r.datum.tokens.tolist(), r.datum.images) for r in rows],
            key_of,
            min_shared=self.min_shared_tokens,
            budget=self.micro_batch_tokens,
            context_cost=context_cost,
        )

    def inputs(self, tokens: torch.Tensor, images: list[tuple], starts: list[int] | None = None) -> dict:
        """The body's `positions` (and, with images, `embeds`) for right-padded rows `tokens` whose
        row b holds positions starts[b].. (default 0) of a datum with images `images[b]`: plain
        positions for text rows; multimodal RoPE and the frozen tower's features otherwise."""
        B, T = tokens.shape
        if any(images):
            return image_inputs(self.model, self.encoder, tokens, images, starts)
        positions = torch.arange(T, device=tokens.device).expand(B, T)
        if starts is not None:
            positions = positions + torch.tensor(starts, device=tokens.device)[:, None]
        return {"positions": positions}

    # ------------------------------------------------------------------ optimizer
    def optim_step(self, run_id: str, settings: AdamConfig | DimuonConfig) -> dict[str, float]:
        """The run's optimizer on the accumulated gradients (clipped first if grad_clip_norm > 0); zero
        them; new version. `settings` must be of the run's family.

        Returns {"grad_norm": norm before clipping, "learning_rate": lr}.
        """
        run = self._run(run_id)
        family = optimizer_family(run.optimizer)
        if optimizer_of(settings) != family:
            sent = "DimuonParams" if isinstance(settings, DimuonConfig) else "AdamParams"
            wanted = "DimuonParams" if family == DIMUON else "AdamParams"
            raise ValueError(
                f"optim_step sent {sent}, but run {run_id} was made with the {family} optimizer: "
                f"send {wanted} (the optimizer is fixed when the training client is created)"
            )
        if isinstance(settings, DimuonConfig):
            settings.check()
        else:
            check_adam(settings)
        if run.full is not None:
            run.full.fill_grads()
        params = run.params()
        if settings.grad_clip_norm > 0:
            norm = torch.nn.utils.clip_grad_norm_(params, settings.grad_clip_norm, foreach=True)
        else:
            norm = torch.nn.utils.get_total_norm([p.grad for p in params], foreach=True)
        norm = float(norm)
        # a full run's gradients are the weights' size: none is held between steps (fill_grads)
        keep_none = run.full is not None
        if not math.isfinite(norm):
            run.optimizer.zero_grad(set_to_none=keep_none)
            raise ValueError(
                "gradients are not finite (NaN or inf); the step was skipped and the gradients "
                "cleared: lower the loss weights / advantages or the learning rate"
            )
        if isinstance(settings, DimuonConfig):
            run.optimizer.step(settings)
        else:
            for group in run.optimizer.param_groups:
                group.update(
                    lr=settings.learning_rate,
                    betas=(settings.beta1, settings.beta2),
                    eps=settings.eps,
                    weight_decay=settings.weight_decay,
                )
            run.optimizer.step()
        run.optimizer.zero_grad(set_to_none=keep_none)
        if run.full is not None:
            run.full.apply()
        run.version = next(self._versions)
        return {"grad_norm": norm, "learning_rate": float(settings.learning_rate)}

    # ------------------------------------------------------------------ checkpoints
    def save_state(self, run_id: str, path: Path) -> int:
        """Write adapter (PEFT format) + optimizer state + LoRA config to directory `path` (a full
        run: its model directory + AdamW state, full.py); bytes written."""
        run = self._run(run_id)
        path = Path(path)
        path.mkdir(parents=True, exist_ok=True)
        if run.full is not None:
            return run.full.save_state(path, self.base_model, run.optimizer)
        written = checkpoint.save_optimizer_state(
            run.adapter, run.optimizer, path, optimizer_family(run.optimizer)
        )
        return written + checkpoint.save_peft_adapter(
            run.adapter, run.lora, path, self.base_model, self.model.source_dir
        )

    def save_weights(self, run_id: str, path: Path) -> int:
        """Write the sampler weights only (a PEFT adapter directory; a full run's model directory);
        bytes written."""
        run = self._run(run_id)
        if run.full is not None:
            return run.full.save_weights(path, self.base_model)
        return checkpoint.save_peft_adapter(
            run.adapter, run.lora, Path(path), self.base_model, self.model.source_dir
        )

    def save_merged(self, run_id: str, path: Path) -> int:
        """Write the run's model as a Hugging Face directory (external weights): the base model with
        the adapter merged by export.export_merged, what `trine export --merged` writes (a full
        run: its own weights); bytes written."""
        run = self._run(run_id)
        path = Path(path)
        if run.full is not None:
            return run.full.save_weights(path, self.base_model)
        with tempfile.TemporaryDirectory(prefix=".merge-", dir=path.parent) as scratch:
            adapter_dir = Path(scratch) / "adapter"
            self.save_weights(run_id, adapter_dir)
            export_merged(adapter_dir, path, self.model.source_dir)
        return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())

    def load_state(self, run_id: str, path: Path, *, with_optimizer: bool, optimizer: str = ADAMW) -> None:
        """(Re)build run `run_id` from a checkpoint directory: its adapter and LoRA config, and its
        optimizer state if `with_optimizer` (which must be of the `optimizer` family), else a fresh
        `optimizer`. A full run's checkpoint makes a full run (its weights, masters and AdamW state).
        Pending gradients are dropped."""
        if is_full_checkpoint(path):
            lora = self._check_full(read_full_shape(path), optimizer)
            self._admit_full(lora)
            full = FullWeights.restore(self.model, path, lora)
            opt = full.new_optimizer()
            if with_optimizer:
                full.load_optimizer(opt, path)
            self._install(run_id, lora, None, opt, full)
            return
        adapter, lora = checkpoint.load_peft_adapter(self.model, path)
        _check_lora(lora)
        opt = new_optimizer(adapter, optimizer, lora.rank)
        if with_optimizer:
            checkpoint.load_optimizer_state(adapter, opt, path, optimizer)
        self._install(run_id, lora, adapter, opt)


def return_freed_memory() -> None:
    """Freed CPU tensors go back to glibc's heap, which keeps them unless trimmed: collect cycles and
    trim, so the memory of a deleted run is returned to the operating system."""
    gc.collect()
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):  # not glibc
        pass


def _check_lora(lora: LoRAConfig) -> LoRAConfig:
    check_lora_rank(lora.rank, "lora rank")
    if not (isinstance(lora.alpha, (int, float)) and math.isfinite(lora.alpha) and lora.alpha > 0):
        raise ValueError(f"lora alpha must be a positive number, got {lora.alpha!r}")
    if not lora.target_names():
        raise ValueError(
            "lora config trains nothing: set at least one of train_attn, train_mlp, train_unembed"
        )
    return lora
