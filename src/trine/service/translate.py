"""The seam between the service and the engine: commands become engine requests and ops here, and
engine stream items become the service's chunks. No other module builds an engine op or request
from what a front end asked.

A translation never changes the command it reads: what the service resolved for it (a checkpoint's
directory, a save's URI and target, the model's limits) comes in as arguments and goes into the new
engine object. The loss is parsed here, once, when the event is accepted; the engine op carries the
parsed `Loss` and the gradient denominator, and the trainer uses them as they are.
"""
from __future__ import annotations

from dataclasses import dataclass

from ..engine import ops
from ..engine.losses import Loss, prepare_datum
from ..engine.lora import LoRAConfig
from ..engine.normalisation import BatchCounts, denominator
from ..engine.requests import AdamConfig, SampleDelta, SampleRequest, SamplingOptions, TrainDatum, WeightsIdentity
from .commands import EndRun, Forward, InitRun, LoraSpec, OptimStep, Refused, SampleSpec, Save, TrainingCommand
from .errors import InvalidRequest
from .results import SampleChunk


@dataclass(frozen=True)
class SaveTarget:
    """Where a save goes, as the service resolved it when it accepted the event."""

    uri: str
    checkpoint_id: str
    path: str  # "" for weights kept in memory only (TEMPORARY)


# ---------------------------------------------------------------------------- training
def lora_config(spec: LoraSpec) -> LoRAConfig:
    return LoRAConfig(rank=spec.rank, train_attn=spec.train_attn, train_mlp=spec.train_mlp,
                      train_unembed=spec.train_unembed, seed=spec.seed or 0)


def training_op(command: TrainingCommand, *, checkpoint_path: str = "",
                save: SaveTarget | None = None) -> ops.Op:
    """The engine op of any command but Forward (see `forward_op`). `checkpoint_path`: the
    directory an InitRun's checkpoint_uri names; `save`: a Save's resolved target."""
    if isinstance(command, InitRun):
        return ops.InitRun(lora_config(command.lora), checkpoint_path, command.load_optimizer,
                           command.checkpoint_uri)
    if isinstance(command, OptimStep):
        return ops.OptimStep(AdamConfig(command.learning_rate, command.beta1, command.beta2, command.eps,
                                        command.weight_decay, command.grad_clip_norm))
    if isinstance(command, Save):
        return ops.Save(command.kind, save.checkpoint_id, save.path, save.uri, command.inflight)
    if isinstance(command, EndRun):
        return ops.EndRun(command.reason)
    if isinstance(command, Refused):
        return ops.Refused(command.code, command.message)
    raise TypeError(f"not a training command: {command!r}")


def forward_op(command: Forward, vocab_size: int, max_seq_len: int, model: str) -> ops.Forward:
    """The engine op of a forward / forward_backward, after every check the trainer would make
    (InvalidRequest naming the field). Scans every datum: run it in a thread for large batches."""
    if not command.data:
        raise InvalidRequest("data: the batch is empty; send at least one datum")
    data = [TrainDatum(d.tokens, d.target_tokens, d.weights, d.logprobs, d.advantages, d.sequence_ratio_mask)
            for d in command.data]
    try:
        loss = Loss.parse(command.loss_fn, command.loss_config)
        for i, d in enumerate(data):
            prepare_datum(d, loss, vocab_size, f"data[{i}]")
    except ValueError as e:
        raise InvalidRequest(str(e)) from None
    n = max(len(d.tokens) for d in data)
    if n > max_seq_len:
        raise InvalidRequest(f"data: a sequence has {n} tokens; {model} handles at most {max_seq_len}")
    return ops.Forward(data, loss, command.backward, command.auto_shift, _denominator(command, loss, data))


def _denominator(command: Forward, loss: Loss, data: list[TrainDatum]) -> float | None:
    if not command.normalise:
        return None
    t = command.totals
    try:
        return denominator(loss, data, None if t is None else
                           BatchCounts(t.samples, t.active_tokens, t.advantage_tokens))
    except ValueError as e:  # the message starts with the count's name
        raise InvalidRequest(f"{t.field}.{e}") from None


# ---------------------------------------------------------------------------- sampling
def sample_request(request_id: str, spec: SampleSpec, weights: WeightsIdentity,
                   inflight: bool = False, tenant: str = "") -> SampleRequest:
    """The engine request of `spec`, under the engine-wide `request_id`, on `weights` (with
    `inflight`, `weights.adapter` is an inflight target whose current version the engine uses), for
    `tenant` (the caller's API key id: the engine admits and prefills fairly across tenants)."""
    options = SamplingOptions(spec.max_tokens, spec.temperature, spec.top_p, spec.top_k, spec.seed,
                              spec.stop_strings, spec.stop_token_ids, spec.stop_at_eos, spec.top_logprobs,
                              grammar=spec.grammar)
    return SampleRequest(request_id, list(spec.prompt), options, weights, None, spec.num_samples,
                         spec.prompt_logprobs, spec.topk_prompt_logprobs, spec.generate,
                         prompt_logprobs_last_n=spec.prompt_logprobs_last_n,
                         prompt_alt_tokens_k=spec.prompt_alt_tokens_k, target_prompt_ids=spec.target_prompt_ids,
                         inflight=inflight, tenant=tenant)


def sample_chunk(spec: SampleSpec, delta: SampleDelta) -> SampleChunk:
    return SampleChunk(spec.request_id, delta.sequence, delta.tokens, delta.logprobs, delta.top_logprobs,
                       delta.stop_reason, delta.text, weights_versions=delta.weights_versions)
