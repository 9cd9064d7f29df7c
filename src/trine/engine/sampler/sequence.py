"""The sampler's state of a request and of each of its samples (sequences): plain dataclasses that
the scheduler, the KV layout, token sampling and the step loop read and update.

Lifecycle of a `Request`: waiting (queued, holds nothing) -> prefilling (admitted: its prompt's
blocks are allocated, `prefilled` grows chunk by chunk) -> its `Sequence`s run (one per sample, forked
from the prompt's blocks) -> finished when no sequence runs. A `compute_logprobs` request
(`generate=False`) has no sequences: it finishes when its prompt is prefilled.

Invariants
- `cached <= prefilled <= len(prompt)`; after prefill, usage.prompt_tokens == prefill_tokens + cached_tokens.
- `cached <= cacheable`: no position whose hidden state the request reads is served from the cache.
- Prefix-cache keys are of `key` (and a sequence's `tokens`, which start with it), never of
  placeholder ids: an image's positions are keyed by its content hash and offset.
- A sequence holds KV for every token but its last (`tokens[-1]` is the next forward's input);
  `keys` are the prefix-cache keys of its full blocks. A hybrid model's sequence also holds its
  linear layers' state after the same tokens, in its `slot` (a request prefilling: `slots[0]`).
- `adapter` and `version` are the weights a request runs this step; they change only between
  steps, when its inflight target is published anew (`Sampler.publish`). A request whose KV then
  spans two versions is `mixed`: none of its blocks computed from then on is keyed in the cache.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from ..api import ImageInput, SampleRequest, SampleUsage, SamplingOptions, WeightsIdentity
from ..images import keyed_tokens
from .prompt_scores import cacheable
from .stops import Stops

if TYPE_CHECKING:
    import torch

    from ..model.lora import Adapter
    from .prompt_scores import PromptScores
    from .sampling import TopLogprobs


@dataclass(eq=False)
class Request:
    req: SampleRequest
    stops: Stops
    scores_prompt: bool  # scores prompt positions in prefill (prompt_scores.py)
    order: int = 0  # arrival: requests added earlier have smaller numbers
    arrived: float = 0.0  # the scheduler's clock when it was added
    usage: SampleUsage = field(default_factory=SampleUsage)
    keys: list[int] = field(default_factory=list)  # chain keys of the prompt's full blocks
    blocks: list[int] = field(default_factory=list)  # the prompt's blocks during prefill
    copies: list[int] = field(default_factory=list)  # partial-block copies for samples 1..n-1
    cached: int = 0  # prompt tokens served from the cache
    prefilled: int = 0  # prompt tokens whose KV is computed or cached (prefill progress)
    reserved: int = 0  # blocks reserved for its samples' decoding until they fork
    shared: int = 0  # full prompt blocks, shared by reference by all its sequences
    # a hybrid model's state slots (the prompt's, then its samples') and the snapshots it took that
    # wait for their block to be keyed, as (prefix length, slot): state_cache.py
    slots: list[int] = field(default_factory=list)
    waiting_snapshots: list[tuple[int, int]] = field(default_factory=list)
    # a prompt with images (sampler/image_prefill.py): its multimodal RoPE positions [3, len(prompt)],
    # its decode positions' offset, and its images' features while it is prefilled (by content hash)
    mrope: "torch.Tensor | None" = None
    rope_delta: int = 0
    features: dict[str, "torch.Tensor"] = field(default_factory=dict)
    seqs: list["Sequence"] = field(default_factory=list)
    running: int = 0  # sequences not stopped yet
    scores: "PromptScores | None" = None  # when `scores_prompt`: filled chunk by chunk
    matcher: object | None = None  # the compiled grammar at its start (grammar.py), if any
    adapter: "Adapter | None" = None  # the weights it runs now (an inflight target's may change)
    version: int = 0  # their version; starts as req.weights.version
    # what the sampler reads of `req`, as its own nouns (a SampleRequest is frozen: they never change)
    request_id: str = field(init=False)
    tenant: str = field(init=False)  # admission and prefill are fair across tenants
    prompt: list[int] = field(init=False)
    images: tuple[ImageInput, ...] = field(init=False)  # the prompt's, in offset order
    # what the prefix cache compares: the prompt with each image position keyed by its image
    # (images.keyed_tokens); the prompt itself for text. Its samples' `tokens` extend it.
    key: list = field(init=False)
    options: SamplingOptions = field(init=False)
    num_samples: int = field(init=False)
    generate: bool = field(init=False)  # False: compute_logprobs, no sequences
    stream: bool = field(init=False)  # report each step's new tokens
    inflight: bool = field(init=False)  # its weights follow an inflight target

    def __post_init__(self) -> None:
        req = self.req
        self.request_id = req.request_id
        self.tenant = req.tenant
        self.prompt = req.prompt
        self.images = req.images
        self.key = keyed_tokens(req.prompt, req.images)
        self.options = req.options
        self.num_samples = req.num_samples
        self.generate = req.generate
        self.stream = req.stream
        self.inflight = req.inflight

    @property
    def weights(self) -> WeightsIdentity:
        """The weights identity its prefix-cache keys are rooted in: `req`'s, which `Sampler.publish`
        replaces (a new version) while it has no KV yet."""
        return self.req.weights

    @property
    def mixed(self) -> bool:
        """Its KV was computed under more than one weights version (an inflight swap)."""
        return self.version != self.weights.version

    @property
    def started(self) -> bool:
        """Admitted: it holds KV blocks (prompt blocks, then its sequences')."""
        return bool(self.blocks or self.seqs)

    @property
    def samples(self) -> int:
        """Sequences it will run: num_samples, or 0 for compute_logprobs."""
        return self.num_samples if self.generate else 0

    @property
    def max_new(self) -> int:
        """Tokens each sample may generate."""
        return self.options.max_tokens if self.generate else 0

    @property
    def cacheable(self) -> int:
        """Prompt tokens the prefix cache may serve: those before the first position whose hidden
        state the request reads (its last, when it only samples; 0 for whole-prompt logprobs)."""
        return cacheable(self.req)

    @property
    def prompt_left(self) -> int:
        """Prompt tokens still to prefill."""
        return len(self.prompt) - self.prefilled


@dataclass(eq=False)
class Sequence:
    """One sample of a request."""

    request: Request  # the request it samples for
    tokens: list  # the request's `key` + generated
    blocks: list[int]
    keys: list[int]
    gen: "torch.Generator"
    reserve: int  # blocks it may still allocate
    index: int = 0  # sample index within its request
    slot: int = -1  # a hybrid model's state slot (state_cache.py); -1 for a dense model
    out: list[int] = field(default_factory=list)  # generated tokens
    logprobs: list[float] = field(default_factory=list)
    top: list["TopLogprobs"] = field(default_factory=list)  # when options.top_logprobs
    stop_reason: str | None = None
    text: str | None = None
    matcher: object | None = None  # this sample's grammar state (grammar.py), if constrained
    versions: list[int] = field(default_factory=list)  # per generated token (inflight requests)
