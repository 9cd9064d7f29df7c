"""Continuous-batching sampler over the paged KV pool, with a prefix cache: the step loop.

One `step()`: the scheduler admits what fits and plans the step (scheduler.py: admission, KV
reservations, prefill chunks, the prefill share); at most one prefill forward over the planned
chunk of prompts, where a prompt whose last chunk is done forks its `num_samples` sequences from
its blocks (kv_layout.py) and samples their first token; then one decode forward in which every
sequence that was running when the step began (any mix of adapters) advances by one token. Tokens
are drawn by sampling.py and checked against the request's stops by stops.py. docs/architecture.md
places the sampler in the engine.

Invariants
- Usage: prompt_tokens == prefill_tokens + cached_tokens for every request; sample_tokens counts
  every generated token of every sample.
- The prompt is prefilled once per request, whatever its `num_samples`.
- Requests that score their prompt (prompt logprobs, their top-k, `generate=False`, alt-token
  draws, target ids: prompt_scores.py) read the prefix cache only before the first position they
  score (none for whole-prompt logprobs; `prompt_logprobs_last_n` moves it to the suffix), and
  write it like any other, with the scores they computed for each block. A request that reuses
  cached scores (`reuse_prompt_scores`) is served the blocks that carry them, metered as cached.
- Streaming (`SampleRequest.stream`): every step that gives a sequence a token leaves one
  SampleDelta for it in `take_deltas()`; a sequence's deltas concatenate to its result.
- `cancel(request_id)` frees the request's sequences, KV blocks and reservations at once and
  returns its partial result (stop_reason "cancelled" on the sequences it cut short).
- Inflight requests (`SampleRequest.inflight`) follow their target: `publish(target, version,
  adapter)`, called between steps, makes every live request on the target run the new weights from
  the next step on. A waiting request (no KV yet) is re-rooted on the new version, so its prefix
  lookup only finds KV of those weights. A request already holding KV keeps it and goes on under
  the new weights (as PipelineRL does: nothing is recomputed); its KV is then `mixed` and nothing
  it computes from then on is keyed in the prefix cache, so no later request is served KV of
  weights other than its own. Each sampled token records the version that produced it.
- A hybrid model (Qwen3.5): every prompt being prefilled and every sequence also holds its linear
  layers' recurrent state in a slot of the state pool (state_cache.py), read and written by each
  forward; samples start from copies of their prompt's state. The prefix cache serves such a model
  only prefixes that end at a state snapshot, which prefill chunks and stopping sequences take.
- Images (a vision-language model's sampler, given the engine's `ImageEncoder`): a prompt's images
  become the tower's features at their placeholders, with multimodal RoPE positions, in the prefill
  chunks that hold them; its sequences decode at index + rope delta (image_prefill.py). Its prefix
  cache keys name each image by content hash and offset (`Request.key`), so a group or a chat's next
  turn reuses the image's KV and state, and two images never share an entry. Usage counts image
  tokens among the prefill and cached tokens (`image_tokens`, `cached_image_tokens`).
"""

from __future__ import annotations

import dataclasses
import time

import torch

from ...limits import MAX_TOPK_PROMPT_LOGPROBS, check_prompt_length
from ..api import SampleDelta, SampledSequence, SampleRequest, SampleResult, WeightsIdentity
from ..config import SamplerConfig
from ..images import check_placement
from ..model.lora import Adapter, AdapterBatch
from ..model.model import Transformer
from ..model.multimodal import ImageEncoder
from ..model.qwen3_5 import HybridConfig
from ..model.tokenizer import Tokenizer
from .grammar import Grammars
from .image_prefill import ImagePrefill, meter_images
from .kv_cache import default_kv_cache_bytes
from .kv_layout import KVLayout
from .prompt_scores import PromptScores, check_prompt_scores, first_scored, scores_prompt
from .sampling import check_sampling_options, generators, sample
from .sequence import Request, Sequence
from .state_cache import StateCache, default_state_cache_bytes
from .stops import Stops, check_stop_options, final_text
from .window import kv_classes


def key_cost(model: Transformer) -> float:
    """A prompt position's attention work per earlier key, over its linear layers' work: scores and
    values are 4 x heads x head_dim flops per key and layer, the layers' GEMMs 2 flops per weight."""
    cfg = model.cfg
    weights = sum(p.numel() for p in model.model.layers.parameters())
    return 4 * cfg.num_heads * cfg.head_dim * len(cfg.attention_layers) / (2 * weights)


class Sampler:
    """Samples from one base model (and any of its LoRA adapters) with continuous batching."""

    def __init__(
        self,
        model: Transformer,
        tokenizer: Tokenizer,
        config: SamplerConfig = SamplerConfig(),
        encoder: ImageEncoder | None = None,
    ):
        """`encoder`: the engine's image encoder, for a model that takes images (None: text only)."""
        self.model = model
        self.tokenizer = tokenizer
        self.config = config
        self.cfg = model.cfg
        self.device = model.device
        self.block_size = config.block_size
        blocks, scheduler = kv_classes(self.cfg)  # a windowed-only model's frees what slid out (window.py)
        self.kv = blocks.from_budget(
            config.kv_cache_bytes
            if config.kv_cache_bytes is not None
            else default_kv_cache_bytes(self.device),
            len(self.cfg.attention_layers),
            self.cfg.num_kv_heads,
            self.cfg.head_dim,
            config.block_size,
            model.dtype,
            self.device,
        )
        self.states = None  # a hybrid model's recurrent state: live slots and snapshots
        if isinstance(self.cfg, HybridConfig):
            budget = config.state_cache_bytes
            if budget is None:
                budget = default_state_cache_bytes(self.device)
            self.states = StateCache(
                self.cfg,
                self.kv,
                config.max_running,
                budget if config.enable_prefix_cache else 0,
                config.state_snapshot_tokens,
                model.dtype,
                self.device,
            )
        self.scheduler = scheduler(
            self.kv,
            config,
            key_cost=key_cost(model),
            states=self.states,
        )
        self.layout = KVLayout(self.kv, config.enable_prefix_cache, key_prompt_tail=self.states is not None)
        self.eos_ids = frozenset(tokenizer.eos_token_ids) | frozenset(self.cfg.eos_token_ids)
        self.grammars = Grammars(tokenizer, self.cfg.vocab_size, self.eos_ids)
        self.images = None if encoder is None else ImagePrefill(model, encoder)
        self._live: dict[str, Request] = {}  # queued or running, by request id
        self._deltas: list[SampleDelta] = []  # streaming requests' new tokens this step
        self._carry: list[SampleResult] = []  # finished during run() but not run()'s own
        self._counters = dict(
            requests=0,
            prompt_tokens=0,
            prefill_tokens=0,
            cached_tokens=0,
            sample_tokens=0,
            image_tokens=0,
            cached_image_tokens=0,
            steps=0,
            prefill_forwards=0,
            decode_forwards=0,
        )

    # ------------------------------------------------------------------ public API
    def add(self, req: SampleRequest, adapter: Adapter | None = None) -> None:
        """Check and queue a request, to run with `adapter` (the weights `req.weights.adapter` names;
        None for the base model). This is the one check of a request against the model: ValueError
        naming the bad field."""
        self._validate(req, adapter)
        self._enqueue(req, adapter)

    def _enqueue(self, req: SampleRequest, adapter: Adapter | None) -> None:
        r = Request(
            req,
            Stops.of(req.options, self.eos_ids),
            scores_prompt(req),
            adapter=adapter,
            version=req.weights.version,
        )
        if req.generate and req.options.grammar:
            r.matcher = self.grammars.compile(req.options.grammar)
        if self.images is not None:
            self.images.queued(r)
        self._live[req.request_id] = r
        self.scheduler.add(r)

    def publish(self, target: str, version: int, adapter: Adapter) -> None:
        """Inflight target `target` now has weights `adapter` at `version`: every live request on
        it runs them from the next step (see the module docstring for its KV). Between steps only."""
        for r in self._live.values():
            if not r.inflight or r.weights.adapter != target or r.version >= version:
                continue
            r.adapter, r.version = adapter, version
            if not r.started:  # no KV yet: it starts on the new weights, cache lookups included
                w = r.weights
                r.req = dataclasses.replace(r.req, weights=WeightsIdentity(w.base_model, w.adapter, version))

    def reset_prefix_cache(self) -> int:
        """Empty the prefix cache of every block no request holds (as vLLM's `reset_prefix_cache`);
        returns how many blocks were forgotten. Between steps only."""
        return self.kv.reset_cache()

    def has_work(self) -> bool:
        return bool(self.scheduler.has_work() or self._carry)

    def take_deltas(self) -> list[SampleDelta]:
        """The streaming requests' new tokens since the last call (call after each step())."""
        out, self._deltas = self._deltas, []
        return out

    def cancel(self, request_id: str) -> SampleResult | None:
        """Stop a request now: its sequences end with stop_reason "cancelled" and release their KV
        blocks and reservations. Returns its (partial) result, which no later step() returns; None if
        the request is unknown or its result was already returned."""
        for i, res in enumerate(self._carry):
            if res.request_id == request_id:
                return self._carry.pop(i)
        r = self._live.get(request_id)
        if r is None:
            return None
        if r in self.scheduler.prefilling:
            self._meter_prompt(r)  # the part computed so far
        self.scheduler.cancel(r)
        for s in r.seqs:
            if s.stop_reason is None:
                s.stop_reason = "cancelled"
                self._retire(s)
        self.scheduler.drop_stopped()
        self._deltas = [d for d in self._deltas if d.request_id != request_id]
        return self._result(r)

    def run(self, reqs: list[SampleRequest | tuple[SampleRequest, Adapter | None]]) -> list[SampleResult]:
        """Add every request (alone, or with the adapter it runs: see `add`), step until they are
        done, return their results in input order. Nothing is added unless every request is valid."""
        pairs = [r if isinstance(r, tuple) else (r, None) for r in reqs]
        ids = [r.request_id for r, _ in pairs]
        if len(set(ids)) != len(ids):
            raise ValueError("request_id: duplicate ids in one run()")
        for r, adapter in pairs:
            self._validate(r, adapter)
        for r, adapter in pairs:
            self._enqueue(r, adapter)
        done: dict[str, SampleResult] = {}
        want = set(ids)
        while want - done.keys():
            for res in self.step():
                if res.request_id in want:
                    done[res.request_id] = res
                else:
                    self._carry.append(res)  # another caller's request: the next step() returns it
        return [done[i] for i in ids]

    @property
    def stats(self) -> dict:
        kv, sch = self.kv, self.scheduler
        return dict(
            self._counters,
            cache_hit_blocks=kv.hit_blocks,
            cache_hit_partial_tokens=kv.hit_partial_tokens,
            cache_queried_blocks=kv.queried_blocks,
            cache_evictions=kv.evictions,
            blocks_total=kv.num_blocks,
            blocks_used=kv.num_used,
            blocks_free=kv.num_free,
            blocks_cached=kv.num_cached,
            blocks_reserved=sch.reserved,
            block_size=self.block_size,
            waiting=len(sch.waiting),
            prefilling=len(sch.prefilling),
            running=len(sch.running),
            **self._state_stats(),
            **(self.images.encoder.stats if self.images is not None else {}),
        )

    def _state_stats(self) -> dict:
        """A hybrid model's state pool and snapshot cache (none for a dense model)."""
        st = self.states
        if st is None:
            return {}
        return dict(
            state_bytes_per_sequence=st.state_bytes,
            state_slots_total=st.running_slots,
            state_slots_free=st.num_free,
            state_snapshots_total=st.snapshot_slots,
            state_snapshots=st.num_snapshots,
            state_snapshot_hits=st.hits,
            state_snapshots_taken=st.taken,
            state_snapshot_evictions=st.evictions,
        )

    @torch.inference_mode()
    def step(self) -> list[SampleResult]:
        """One engine step: admit, prefill one bounded chunk, then decode every running sequence by
        one token."""
        self._counters["steps"] += 1
        finished, self._carry = self._carry, []
        plan = self.scheduler.schedule()
        if plan.prefill:
            t = time.perf_counter()
            finished += self._prefill(plan.prefill)
            self.scheduler.prefilled(plan, time.perf_counter() - t)
        if plan.decode:
            t = time.perf_counter()
            finished += self._decode(plan.decode)
            self.scheduler.decoded(time.perf_counter() - t)
        return finished

    # ------------------------------------------------------------------ forwards
    def _adapters(self, reqs: list[Request]) -> list[Adapter | None]:
        """The adapter each request runs this step: the one place a request's adapter is read."""
        return [r.adapter for r in reqs]

    def _prefill(self, rows: list[tuple[Request, int]]) -> list[SampleResult]:
        """One forward over the next `take` prompt tokens of each row's request; requests whose
        prompt is then complete fork their samples and sample their first token (or finish, for
        compute_logprobs)."""
        now = time.time()
        for r, _ in rows:  # the first chunk of its prompt (a session trace's prefill span)
            r.usage.started_at = r.usage.started_at or now
        tokens, positions, kvc = self.layout.prefill(rows)
        adapters = self._adapters([r for r, _ in rows])
        inputs = {"positions": positions}
        if self.images is not None:  # a chunk with an image row: multimodal positions, embeddings
            inputs.update(self.images.chunk_inputs(rows, tokens, positions))
        state, snapshots = {}, {}
        if self.states is not None:  # each row's state, and the snapshots this chunk takes
            cuts, taken = self.states.prefill_cuts(rows)
            state["state"] = self.states.rows([r.slots[0] for r, _ in rows], cuts, [s for _, _, s in taken])
            for r, p, slot in taken:
                snapshots.setdefault(id(r), []).append((p, slot))
        hidden = self.model.hidden_states(
            tokens, adapters=AdapterBatch.from_rows(adapters, self.device), kv=kvc, **inputs, **state
        )
        self._counters["prefill_forwards"] += 1
        finished, forked, last = [], [], []  # last: (row, its last prompt position, its samples)
        for i, (r, take) in enumerate(rows):
            start = r.prefilled
            if r.scores_prompt:
                self._extend_prompt_scores(r, hidden[i : i + 1, :take], start, adapters[i])
            r.prefilled = start + take
            keyed = self.layout.cache_prompt(r, start, start + take)
            if r.scores is not None:
                self._keep_scores(r, hidden[i], start, keyed)
            if self.states is not None:
                taken = r.waiting_snapshots + snapshots.get(id(r), [])
                r.waiting_snapshots = self.states.keep(r, taken, r.key, r.blocks, r.keys)
            if r.prompt_left:
                continue
            self._prompt_done(r)
            if not r.generate:
                finished.append(self._result(r))
                continue
            forked += self._fork(r)
            last.append((i, take - 1, r.num_samples))
        if forked:
            dev = self.device
            rows_at = torch.tensor([i for i, _, _ in last], device=dev)
            logits = self.model.logits(
                hidden[rows_at, torch.tensor([p for _, p, _ in last], device=dev)],
                AdapterBatch.from_rows([adapters[i] for i, _, _ in last], dev),
            )
            per_seq = torch.repeat_interleave(
                torch.arange(len(last), device=dev), torch.tensor([k for _, _, k in last], device=dev)
            )
            finished += self._advance(forked, logits.index_select(0, per_seq))
            self.scheduler.start([s for s in forked if s.stop_reason is None])
        return finished

    def _extend_prompt_scores(
        self, r: Request, hidden: torch.Tensor, start: int, adapter: Adapter | None
    ) -> None:
        """Add the prompt scores of a chunk (hidden states [1, take, H] from position `start`)."""
        if r.scores is None and start >= first_scored(r.req):  # served scored entries from the cache
            served = [self.kv.blocks[b].scores for b in r.blocks[: start // self.block_size]]
            r.scores = PromptScores.cached(r.req, served, self.block_size)
            hidden = torch.cat([served[-1].last_hidden.view(1, 1, -1), hidden], 1)  # predicts entry `start`
            start -= 1
        elif r.scores is None:  # the first computed chunk: the positions before `start` came from the cache
            r.scores = PromptScores.of(r.req, start)
        single = AdapterBatch.single(adapter)
        r.scores.extend(r.req, lambda h: self.model.logits(h, single), hidden, start)

    def _keep_scores(self, r: Request, hidden: torch.Tensor, start: int, keyed: range) -> None:
        """Keep with each prompt block this chunk keyed (hidden states [take, H] from `start`) the
        scores the request computed for it, for requests that reuse them (prompt_scores.py)."""
        bs = self.block_size
        for b in keyed:
            scores = r.scores.block(b, bs, r.req, hidden[(b + 1) * bs - 1 - start])
            if scores is not None:
                self.kv.keep_scores(r.keys[b], scores)

    def _prompt_done(self, r: Request) -> None:
        r.usage.prefilled_at = time.time()
        if not r.samples:  # its blocks go back now: the prompt's partial last one stays cached
            self.layout.cache_tail(r, r.blocks, r.keys, r.key)
        self.scheduler.prompt_done(r)
        self._meter_prompt(r)
        if self.images is not None:
            self.images.prompt_done(r)
        self._counters["requests"] += 1
        for key in (
            "prompt_tokens",
            "prefill_tokens",
            "cached_tokens",
            "image_tokens",
            "cached_image_tokens",
        ):
            self._counters[key] += getattr(r.usage, key)

    def _fork(self, r: Request) -> list[Sequence]:
        """The request's sequences, one per sample, on the block tables the layout forks."""
        full = len(r.prompt) // self.block_size
        reserve = self.scheduler.sample_reserve(r)
        gens = generators(r.options.seed, r.num_samples)
        r.seqs = [
            Sequence(r, list(r.key), blocks, list(r.keys[:full]), gen, reserve, j)
            for j, (blocks, gen) in enumerate(zip(self.layout.fork(r), gens))
        ]
        if self.states is not None:  # each sample starts from the prompt's state
            self.states.copy(r.slots[0], r.slots[1:])
            for s, slot in zip(r.seqs, r.slots):
                s.slot = slot
            r.slots = []
        r.running = len(r.seqs)
        if r.matcher is not None:
            for s in r.seqs:
                s.matcher = r.matcher.deep_copy()
        return r.seqs

    def _decode(self, seqs: list[Sequence]) -> list[SampleResult]:
        self.scheduler.grow(seqs)
        tokens, positions, kvc = self.layout.decode(seqs)
        if self.images is not None:
            positions = self.images.decode_positions(seqs, positions)
        adapters = AdapterBatch.from_rows(self._adapters([s.request for s in seqs]), self.device)
        if self.states is None:
            hidden = self.model.hidden_states(tokens, positions, adapters, kv=kvc)
        else:
            state = self.states.rows([s.slot for s in seqs])
            hidden = self.model.hidden_states(tokens, positions, adapters, kv=kvc, state=state)
        logits = self.model.logits(hidden[:, 0], adapters)
        self._counters["decode_forwards"] += 1
        self.layout.cache_decoded(seqs)
        finished = self._advance(seqs, logits)
        self.scheduler.drop_stopped()
        return finished

    # ------------------------------------------------------------------ tokens and results
    def _advance(self, seqs: list[Sequence], logits: torch.Tensor) -> list[SampleResult]:
        """Sample one token per sequence from `logits` [B, V], apply stops, retire finished ones."""
        logits = self.grammars.mask(seqs, logits)
        options = [s.request.options for s in seqs]
        histories = [(s.request.prompt, s.out) for s in seqs]  # what penalties count
        tokens, logprobs, tops = sample(logits, options, [s.gen for s in seqs], histories)
        finished = []
        for s, tok, lp, top in zip(seqs, tokens, logprobs, tops):
            r = s.request
            self.grammars.advance(s, tok)
            s.tokens.append(tok)
            s.out.append(tok)
            s.logprobs.append(lp)
            if top is not None:
                s.top.append(top)
            if r.inflight:
                s.versions.append(r.version)
            r.usage.sample_tokens += 1
            self._counters["sample_tokens"] += 1
            s.stop_reason, s.text = r.stops.check(s.out, self.tokenizer)
            if s.stop_reason is not None:
                self._retire(s)
            if r.stream:
                self._deltas.append(
                    SampleDelta(
                        r.request_id,
                        s.index,
                        [tok],
                        [lp],
                        None if top is None else [top],
                        s.stop_reason,
                        s.text if s.stop_reason else None,
                        [r.version] if r.inflight else None,
                    )
                )
            if r.running == 0:
                finished.append(self._result(r))
        return finished

    def _retire(self, s: Sequence) -> None:
        r = s.request
        self.layout.cache_tail(r, s.blocks, s.keys, s.tokens[:-1])  # KV of all but its last
        if self.states is not None and self.layout.prefix_cache and not r.mixed:
            self.states.take(r, s.tokens[:-1], s.blocks, s.keys, s.slot)  # and its state after them
        self.scheduler.release(s)
        s.request.running -= 1
        if s.text is None:
            s.text = final_text(s.out, s.stop_reason, self.tokenizer)

    def _meter_prompt(self, r: Request) -> None:
        """The request's prompt usage: the tokens prefilled so far, cached or computed."""
        r.usage.prompt_tokens, r.usage.cached_tokens = r.prefilled, r.cached
        r.usage.prefill_tokens = r.prefilled - r.cached
        meter_images(r)

    def _result(self, r: Request) -> SampleResult:
        if self._live.pop(r.request_id, None) is not None and self.images is not None:
            self.images.finished(r)
        k = r.options.top_logprobs
        seqs = [
            SampledSequence(
                s.out,
                s.logprobs,
                s.text,
                s.stop_reason,
                s.top if k else None,
                s.versions if r.inflight else None,
            )
            for s in r.seqs
        ]
        scores = r.scores.answer(r.req) if r.scores is not None else {"prompt_logprobs": None}
        return SampleResult(r.request_id, seqs, usage=r.usage, **scores)

    # ------------------------------------------------------------------ validation
    def _validate(self, req: SampleRequest, adapter: Adapter | None) -> None:
        cfg, opts, n = self.cfg, req.options, len(req.prompt)
        if req.request_id in self._live:
            raise ValueError(f"request_id {req.request_id!r} is already queued or running")
        if n == 0:
            raise ValueError("prompt: is empty; give at least one token")
        if req.images:
            spec = self.images.encoder.spec if self.images is not None else None
            check_placement(req.prompt, req.images, spec, req.weights.base_model, "prompt")
        if (
            any(not isinstance(t, int) for t in req.prompt)
            or min(req.prompt) < 0
            or max(req.prompt) >= cfg.vocab_size
        ):
            raise ValueError(f"prompt: token ids must be ints in [0, {cfg.vocab_size})")
        if req.num_samples < 1:
            raise ValueError(f"num_samples: must be >= 1, got {req.num_samples}")
        if self.states is not None and req.generate and req.num_samples > self.states.running_slots:
            raise ValueError(
                f"num_samples: {req.num_samples} is more than this hybrid model's sampler runs at once "
                f"(max_running {self.states.running_slots}: a recurrent state slot each); lower "
                f"num_samples or raise max_running"
            )
        if req.topk_prompt_logprobs < 0:
            raise ValueError(f"topk_prompt_logprobs: must be >= 0, got {req.topk_prompt_logprobs}")
        check_prompt_scores(req, cfg.vocab_size, MAX_TOPK_PROMPT_LOGPROBS)
        if (adapter is None) != (req.weights.adapter is None):
            raise ValueError("adapter: must be given exactly when weights.adapter names one")
        max_new = 0
        if req.generate:
            max_new = opts.max_tokens
            if opts.max_tokens is None or opts.max_tokens <= 0:
                raise ValueError(f"max_tokens: must be >= 1, got {opts.max_tokens}")
            check_sampling_options(opts, cfg.vocab_size)
            check_stop_options(opts, cfg.vocab_size)
            if opts.grammar and not opts.stop_at_eos:
                raise ValueError(
                    "grammar: constrained decoding needs stop_at_eos (a complete grammar "
                    "allows only the end-of-sequence token)"
                )
        check_prompt_length(n, max_new, cfg.max_position_embeddings, req.weights.base_model)
        need = self.scheduler.blocks_needed(n, max_new, req.num_samples if req.generate else 0)
        if need > self.kv.num_blocks:
            raise ValueError(
                f"prompt + max_tokens: {n} + {max_new} tokens x {req.num_samples} samples "
                f"need {need} KV blocks, the pool has {self.kv.num_blocks}; lower "
                f"max_tokens or num_samples, or give the sampler a larger kv_cache_bytes"
            )
