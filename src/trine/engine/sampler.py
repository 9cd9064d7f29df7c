"""Continuous-batching sampler over the paged KV pool, with a prefix cache.

One `step()` does, in order:
1. Admission (FIFO): a waiting request is admitted when its worst-case KV blocks fit the pool
   (free + evictable, minus what running sequences have reserved), so a running sequence never
   runs out of blocks and nothing is ever preempted.
2. At most one prefill forward over a bounded chunk of the admitted prompts (at most
   `max_batch_tokens` positions, padding included), so a long prompt is prefilled over several
   steps: no request stalls the others. The chunk is sized by time, scaled from the last prefill
   step's tokens and seconds (at least one block, at most twice as many as the last step), to take
   about `prefill_step_seconds`, which bounds how long a request arriving meanwhile waits for the
   step in progress. While sequences decode, a prompt that arrived before one of them, or that has
   more than `max_batch_tokens` tokens left, is held to `prefill_share` x the decode time: a chunk's
   seconds are a debt that the following decode steps pay off at `prefill_share` x their own
   seconds, and no such chunk runs while the debt is positive. So a long prompt adds about
   `prefill_share` to the per-token latency of those who came after it however costly its chunks
   are (deep into a long prompt, even one block costs several decode steps). Other prompts (newer
   than every decoding request, and short) go ahead of decoding as soon as they arrive, so a batch
   of requests sent together (a GRPO step) is prefilled at full speed and decodes as one batch.
   Prompts with the fewest tokens left go first (they start decoding at once); the longest one
   takes what is left of the budget. A request
   looks up the longest cached full-block prefix of `prompt[:-1]` at admission and computes only
   the rest: the last prompt token is always computed, since its logits give the first sampled
   token. The prompt is prefilled once per request; when its last chunk is done its `num_samples`
   sequences share the prompt's full blocks by reference and each gets a copy of the partial last
   block. A request whose uncached prefix starts with blocks another request is still computing
   waits, then hits them.
3. One decode forward: every running sequence of every request (any mix of adapters) advances by
   one token. The samples of one request attend as one packed row (`KVContext.query_index`), so
   the prompt KV they share is gathered once per step, not once per sample.

Invariants
- Usage: prompt_tokens == prefill_tokens + cached_tokens for every request; sample_tokens counts
  every generated token of every sample.
- Requests with prompt logprobs (`prompt_logprobs`, `topk_prompt_logprobs`, or `generate=False`)
  run a full forward over the prompt: they never read the prefix cache (0 cached tokens) but do
  write it.
- Each sequence draws from its own `torch.Generator`, seeded from (seed, sample index), one
  uniform per sampled token, so samples do not depend on the rest of the batch or on whether the
  prefix came from the cache. Without a seed the generator is seeded at random.
- Token logprobs are log-softmax of the raw logits (temperature 1, before top-k / top-p): the
  model's own log-probability of the token, which importance-sampling losses compare against.
- Returned tokens include the token that stopped a sequence (EOS, a stop token, or the token that
  completed a stop string); the text excludes a stop token and is cut before a stop string.
- Streaming (`SampleRequest.stream`): every step that gives a sequence a token leaves one
  SampleDelta for it in `take_deltas()`; a sequence's deltas concatenate to its result.
- `cancel(request_id)` frees the request's sequences, KV blocks and reservations at once and
  returns its partial result (stop_reason "cancelled" on the sequences it cut short).
"""
from __future__ import annotations

import math
import secrets
import time
from collections import deque
from dataclasses import dataclass, field

import torch

from .kv_cache import BlockManager, block_key, chain_hashes
from .lora import AdapterBatch
from .model import KVContext, Transformer
from .requests import SampleDelta, SampledSequence, SampleRequest, SampleResult, SampleUsage
from .tokenizer import Tokenizer

CPU_KV_CACHE_BYTES = 512 * 2**20
GPU_KV_CACHE_FRACTION = 0.5  # of the memory free when the sampler is built


def default_kv_cache_bytes(device: torch.device) -> int:
    """512 MiB on CPU; on a GPU, half of its free memory."""
    if device.type == "cuda":
        return int(torch.cuda.mem_get_info(device)[0] * GPU_KV_CACHE_FRACTION)
    return CPU_KV_CACHE_BYTES
LOGITS_CHUNK = 256  # prompt positions per lm_head call when computing prompt logprobs
_MASK64 = 2**64 - 1


def _splitmix64(x: int) -> int:
    x = (x + 0x9E3779B97F4A7C15) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return x ^ (x >> 31)


def sample_seed(seed: int, index: int) -> int:
    """The generator seed of sample `index` of a request seeded with `seed` (stable everywhere)."""
    return _splitmix64(_splitmix64(seed & _MASK64) ^ index) >> 1


@dataclass(eq=False)
class _Request:
    req: SampleRequest
    usage: SampleUsage
    stop_ids: frozenset[int]
    full: bool  # full forward for prompt logprobs: never reads the cache
    keys: list[int] = field(default_factory=list)  # chain keys of the prompt's full blocks
    blocks: list[int] = field(default_factory=list)  # the prompt's blocks during prefill
    copies: list[int] = field(default_factory=list)  # partial-block copies for samples 1..n-1
    order: int = 0  # arrival: requests added earlier have smaller numbers
    cached: int = 0  # prompt tokens served from the cache
    done: int = 0  # prompt tokens whose KV is computed or cached (prefill progress)
    reserved: int = 0  # blocks reserved for its samples' decoding until they fork
    shared: int = 0  # full prompt blocks, shared by reference by all its sequences
    seqs: list["_Seq"] = field(default_factory=list)
    running: int = 0
    prompt_logprobs: list[float | None] | None = None
    topk_prompt_logprobs: list[list[tuple[int, float]] | None] | None = None


@dataclass(eq=False)
class _Seq:
    """One sample. KV is computed for every token but the last; `keys` covers its full blocks."""

    req: _Request
    tokens: list[int]
    blocks: list[int]
    keys: list[int]
    gen: torch.Generator
    reserve: int  # blocks it may still allocate
    index: int = 0  # sample index within its request
    out: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    top: list[list[tuple[int, float]]] = field(default_factory=list)  # when options.top_logprobs
    stop_reason: str | None = None
    text: str | None = None


class Sampler:
    """Samples from one base model (and any of its LoRA adapters) with continuous batching."""

    def __init__(self, model: Transformer, tokenizer: Tokenizer, *, kv_cache_bytes: int | None = None,
                 block_size: int = 16, max_batch_tokens: int = 2048, max_running: int = 64,
                 enable_prefix_cache: bool = True, prefill_share: float = 0.5,
                 prefill_step_seconds: float = 0.25):
        if max_batch_tokens < 1 or max_running < 1:
            raise ValueError("max_batch_tokens and max_running must be >= 1")
        if not (prefill_share > 0 and prefill_step_seconds > 0):
            raise ValueError("prefill_share and prefill_step_seconds must be > 0")
        self.prefill_share = prefill_share
        self.prefill_step_seconds = prefill_step_seconds
        self._prefill_debt = 0.0  # held-back prefill seconds run while decoding, not yet paid by decode steps
        self._arrivals = 0
        self._last_prefill: tuple[int, float] | None = None  # (positions, seconds) of the last prefill
        self.model = model
        self.tokenizer = tokenizer
        cfg = model.cfg
        self.cfg = cfg
        self.device = model.device
        self.block_size = block_size
        self.max_batch_tokens = max_batch_tokens
        self.max_running = max_running
        self.enable_prefix_cache = enable_prefix_cache
        self.kv = BlockManager.from_budget(
            kv_cache_bytes if kv_cache_bytes is not None else default_kv_cache_bytes(self.device),
            cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, block_size, model.dtype, self.device)
        self.eos_ids = frozenset(tokenizer.eos_token_ids) | frozenset(cfg.eos_token_ids)
        self._waiting: deque[_Request] = deque()
        self._prefilling: list[_Request] = []  # admitted, prompt KV not complete yet
        self._running: list[_Seq] = []
        self._live: dict[str, _Request] = {}  # queued or running, by request id
        self._deltas: list[SampleDelta] = []  # streaming requests' new tokens this step
        self._reserved = 0  # blocks promised to admitted requests, not yet allocated
        self._carry: list[SampleResult] = []  # finished during run() but not run()'s own
        self._counters = dict(requests=0, prompt_tokens=0, prefill_tokens=0, cached_tokens=0,
                              sample_tokens=0, steps=0, prefill_forwards=0, decode_forwards=0)
        self._arange = torch.arange(block_size, device=self.device)

    # ------------------------------------------------------------------ public API
    def add(self, req: SampleRequest) -> None:
        """Validate and queue a request. Raises ValueError naming the bad field."""
        self._validate(req)
        opts = req.options
        stop_ids = frozenset(opts.stop_token_ids) | (self.eos_ids if opts.stop_at_eos else frozenset())
        full = req.prompt_logprobs or req.topk_prompt_logprobs > 0 or not req.generate
        self._arrivals += 1
        r = self._live[req.request_id] = _Request(req, SampleUsage(), stop_ids, full, order=self._arrivals)
        self._waiting.append(r)

    def has_work(self) -> bool:
        return bool(self._waiting or self._prefilling or self._running or self._carry)

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
        if r in self._waiting:  # not admitted: holds nothing yet
            self._waiting.remove(r)
        elif r in self._prefilling:  # admitted: its prompt blocks, copies and reservation go back
            self._prefilling.remove(r)
            self.kv.release(r.blocks + r.copies)
            r.blocks, r.copies = [], []
            self._reserved -= r.reserved
            r.usage.prompt_tokens, r.usage.cached_tokens = r.done, r.cached  # what was computed
            r.usage.prefill_tokens = r.done - r.cached
        for s in r.seqs:
            if s.stop_reason is None:
                s.stop_reason = "cancelled"
                self._retire(s)
        self._running = [s for s in self._running if s.stop_reason is None]
        self._deltas = [d for d in self._deltas if d.request_id != request_id]
        return self._result(r)

    def run(self, reqs: list[SampleRequest]) -> list[SampleResult]:
        """Add every request, step until they are done, return their results in input order."""
        ids = [r.request_id for r in reqs]
        if len(set(ids)) != len(ids):
            raise ValueError("request_id: duplicate ids in one run()")
        for r in reqs:
            self._validate(r)
        for r in reqs:
            self.add(r)
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
        kv = self.kv
        return dict(self._counters, cache_hit_blocks=kv.hit_blocks, cache_queried_blocks=kv.queried_blocks,
                    cache_evictions=kv.evictions, blocks_total=kv.num_blocks, blocks_used=kv.num_used,
                    blocks_free=kv.num_free, blocks_cached=kv.num_cached, block_size=self.block_size,
                    waiting=len(self._waiting), prefilling=len(self._prefilling), running=len(self._running))

    @torch.inference_mode()
    def step(self) -> list[SampleResult]:
        """One engine step: admit, prefill one bounded chunk, then decode every running sequence by
        one token."""
        self._counters["steps"] += 1
        decoding = list(self._running)
        finished, self._carry = self._carry, []
        self._prefilling += self._admit()
        if not decoding:
            self._prefill_debt = 0.0  # nobody waits on decode steps: prefill takes the engine
        unpaid = bool(decoding) and self._prefill_debt > 0  # held-back prompts wait for it
        ready = self._prefilling
        if unpaid:  # only prompts newer than every decoding request, and short
            newest = max(s.req.order for s in decoding)
            ready = [r for r in ready if r.order > newest
                     and len(r.req.prompt) - r.done <= self.max_batch_tokens]
        if ready:
            t = time.perf_counter()
            rows = self._chunks(ready, self._prefill_budget())
            finished += self._prefill(rows)
            seconds = time.perf_counter() - t
            self._last_prefill = (len(rows) * max(take for _, take in rows), seconds)
            if decoding and not unpaid:  # a chunk that may hold held-back prompts: they owe it
                self._prefill_debt += seconds
        if decoding:
            t = time.perf_counter()
            finished += self._decode(decoding)
            self._prefill_debt = max(0.0, self._prefill_debt - self.prefill_share * (time.perf_counter() - t))
        return finished

    def _prefill_budget(self) -> int:
        """Prefill positions for this step: what should take `prefill_step_seconds`, scaled from the
        last prefill step; between one block and max_batch_tokens."""
        low = min(self.block_size, self.max_batch_tokens)
        if self._last_prefill is None:
            return min(self.max_batch_tokens, 4 * self.block_size)
        tokens, seconds = self._last_prefill
        scaled = int(tokens * min(2.0, self.prefill_step_seconds / max(seconds, 1e-6)))
        return max(low, min(scaled, self.max_batch_tokens))

    # ------------------------------------------------------------------ validation
    def _validate(self, req: SampleRequest) -> None:
        cfg, opts, n = self.cfg, req.options, len(req.prompt)
        if req.request_id in self._live:
            raise ValueError(f"request_id {req.request_id!r} is already queued or running")
        if n == 0:
            raise ValueError("prompt: is empty; give at least one token")
        if any(not isinstance(t, int) for t in req.prompt) or min(req.prompt) < 0 \
                or max(req.prompt) >= cfg.vocab_size:
            raise ValueError(f"prompt: token ids must be ints in [0, {cfg.vocab_size})")
        if req.num_samples < 1:
            raise ValueError(f"num_samples: must be >= 1, got {req.num_samples}")
        if req.topk_prompt_logprobs < 0:
            raise ValueError(f"topk_prompt_logprobs: must be >= 0, got {req.topk_prompt_logprobs}")
        if (req.adapter is None) != (req.weights.adapter is None):
            raise ValueError("adapter: must be given exactly when weights.adapter names one")
        max_new = 0
        if req.generate:
            max_new = opts.max_tokens
            if opts.max_tokens is None or opts.max_tokens <= 0:
                raise ValueError(f"max_tokens: must be >= 1, got {opts.max_tokens}")
            if not (math.isfinite(opts.temperature) and opts.temperature >= 0):
                raise ValueError(f"temperature: must be a finite number >= 0, got {opts.temperature}")
            if not (0 < opts.top_p <= 1):
                raise ValueError(f"top_p: must be in (0, 1], got {opts.top_p}")
            if opts.top_k < -1:
                raise ValueError(f"top_k: must be -1 (off) or >= 1, got {opts.top_k}")
            if not 0 <= opts.top_logprobs <= cfg.vocab_size:
                raise ValueError(f"top_logprobs: must be in [0, {cfg.vocab_size}], got {opts.top_logprobs}")
            if any(not isinstance(t, int) or not 0 <= t < cfg.vocab_size for t in opts.stop_token_ids):
                raise ValueError(f"stop_token_ids: must be ints in [0, {cfg.vocab_size})")
            if any(not isinstance(s, str) or not s for s in opts.stop_strings):
                raise ValueError("stop_strings: must be non-empty strings")
            opts.check_stops()
        if n + max_new > cfg.max_position_embeddings:
            raise ValueError(f"prompt + max_tokens: {n} + {max_new} tokens exceed the model context "
                             f"of {cfg.max_position_embeddings}; shorten the prompt or lower max_tokens")
        need = self._blocks_needed(n, max_new, req.num_samples if req.generate else 0)
        if need > self.kv.num_blocks:
            raise ValueError(f"prompt + max_tokens: {n} + {max_new} tokens x {req.num_samples} samples "
                             f"need {need} KV blocks, the pool has {self.kv.num_blocks}; lower "
                             f"max_tokens or num_samples, or give the sampler a larger kv_cache_bytes")

    def _blocks_needed(self, n: int, max_new: int, samples: int) -> int:
        """Worst-case blocks of one request: shared full prompt blocks + each sample's own."""
        bs = self.block_size
        if samples == 0:
            return -(-n // bs)
        per_sample = -(-(n + max_new - 1) // bs) - n // bs  # the last token's KV is never computed
        return n // bs + samples * per_sample

    # ------------------------------------------------------------------ admission
    def _admit(self) -> list[_Request]:
        """Waiting requests (FIFO) whose KV blocks fit, with their blocks allocated."""
        bs, kv = self.block_size, self.kv
        admitted: list[_Request] = []
        # keys of blocks still being prefilled: a request whose uncached prefix starts there waits
        pending = {k for r in self._prefilling for k in r.keys[r.done // bs:]}
        running = len(self._running) + sum(r.req.num_samples for r in self._prefilling if r.req.generate)
        while self._waiting:
            r = self._waiting[0]
            req, n = r.req, len(r.req.prompt)
            k = req.num_samples if req.generate else 0
            if (admitted or self._running or self._prefilling) and running + k > self.max_running:
                break
            if self.enable_prefix_cache:
                r.keys = chain_hashes(req.weights, req.prompt, bs)
            matched = [] if r.full or not self.enable_prefix_cache else \
                kv.match(req.weights, req.prompt[:n - 1], r.keys[:(n - 1) // bs])
            if not r.full and r.keys[len(matched):len(matched) + 1] and r.keys[len(matched)] in pending:
                kv.release(matched)  # the next block is being computed now: hit it when it is done
                break
            max_new = req.options.max_tokens if req.generate else 0
            partial = int(n % bs != 0)
            now = -(-n // bs) - len(matched) + (max(k - 1, 0) * partial)
            later = self._blocks_needed(n, max_new, k) - n // bs - k * partial if k else 0
            if kv.num_free - self._reserved < now + later:
                kv.release(matched)
                break
            self._waiting.popleft()
            r.blocks = matched + kv.allocate(-(-n // bs) - len(matched))
            r.copies = kv.allocate(max(k - 1, 0) * partial)
            self._reserved += later
            r.reserved = later
            r.cached = r.done = len(matched) * bs
            pending.update(r.keys[len(matched):])
            running += k
            admitted.append(r)
        return admitted

    def _chunks(self, ready: list[_Request], budget: int) -> list[tuple[_Request, int]]:
        """This step's prefill rows (request, tokens to compute) from `ready`: fewest tokens left
        first, while rows x the longest chunk <= budget; the last row may take a partial chunk."""
        rows: list[tuple[_Request, int]] = []
        for r in sorted(ready, key=lambda r: len(r.req.prompt) - r.done):  # stable: FIFO ties
            cap = budget // (len(rows) + 1)
            if cap < 1:
                break
            left = len(r.req.prompt) - r.done
            rows.append((r, min(left, cap)))
            if left > cap:
                break
        return rows

    # ------------------------------------------------------------------ forwards
    def _slots(self, block_lists: list[list[int]], length: int) -> torch.Tensor:
        """[B, length] pool slots of positions 0..length-1 of each row's blocks (padding: slot 0)."""
        width = max(len(b) for b in block_lists)
        table = torch.tensor([b + [0] * (width - len(b)) for b in block_lists], dtype=torch.long,
                             device=self.device).view(len(block_lists), width)
        slots = (table[:, :, None] * self.block_size + self._arange).view(len(block_lists), -1)
        return slots[:, :length]

    def _prefill(self, rows: list[tuple[_Request, int]]) -> list[SampleResult]:
        """One forward over the next `take` prompt tokens of each row's request; requests whose
        prompt is then complete fork their samples (or finish, for compute_logprobs)."""
        dev, bs = self.device, self.block_size
        batch = [r for r, _ in rows]
        B = len(batch)
        starts = [r.done for r in batch]
        ends = [r.done + take for r, take in rows]
        T, L = max(take for _, take in rows), max(ends)
        tokens = torch.zeros(B, T, dtype=torch.long)
        for i, r in enumerate(batch):
            tokens[i, :ends[i] - starts[i]] = torch.tensor(r.req.prompt[starts[i]:ends[i]])
        start = torch.tensor(starts)[:, None]
        positions = (start + torch.arange(T)[None]).to(dev)  # padded queries: past the end
        read = self._slots([r.blocks for r in batch], L)
        real = torch.arange(T)[None] < (torch.tensor(ends)[:, None] - start)
        write = torch.where(real.to(dev), read.gather(1, positions.clamp(max=L - 1)), -1)
        mask = (torch.arange(L, device=dev)[None, None] <= positions[:, :, None])[:, None]
        adapters = AdapterBatch.from_rows([r.req.adapter for r in batch], dev)
        kvc = KVContext(self.kv.k_pool, self.kv.v_pool, write, read, mask)
        hidden = self.model.hidden_states(tokens.to(dev), positions, adapters, kv=kvc)
        self._counters["prefill_forwards"] += 1

        finished, forked, last = [], [], []
        for i, r in enumerate(batch):
            req, n = r.req, len(r.req.prompt)
            if r.full:
                self._prompt_logprobs(r, hidden[i:i + 1, :ends[i] - starts[i]], starts[i],
                                      AdapterBatch.single(req.adapter))
            if self.enable_prefix_cache:
                for b in range(starts[i] // bs, ends[i] // bs):
                    self.kv.register(r.blocks[b], r.keys[b], r.keys[b - 1] if b else req.weights,
                                     req.weights, req.prompt[b * bs:(b + 1) * bs])
            r.done = ends[i]
            if r.done < n:
                continue
            self._prefilling.remove(r)
            r.usage.prompt_tokens, r.usage.cached_tokens = n, r.cached
            r.usage.prefill_tokens = n - r.cached
            c = self._counters
            c["requests"] += 1
            c["prompt_tokens"] += n
            c["cached_tokens"] += r.cached
            c["prefill_tokens"] += n - r.cached
            if not req.generate:
                self.kv.release(r.blocks)
                finished.append(self._result(r))
                continue
            seqs = self._fork(r)
            forked += seqs
            last.append((i, ends[i] - starts[i] - 1, req, len(seqs)))
        if forked:
            idx = torch.tensor([p for _, p, _, _ in last], device=dev)
            rows_ = torch.tensor([i for i, _, _, _ in last], device=dev)
            last_adapters = AdapterBatch.from_rows([req.adapter for _, _, req, _ in last], dev)
            logits = self.model.logits(hidden[rows_, idx], last_adapters)
            per_seq = torch.repeat_interleave(torch.arange(len(last), device=dev),
                                              torch.tensor([k for _, _, _, k in last], device=dev))
            finished += self._advance(forked, logits.index_select(0, per_seq))
            self._running += [s for s in forked if s.stop_reason is None]
        return finished

    def _fork(self, r: _Request) -> list[_Seq]:
        """The request's sequences: sample 0 takes the prompt blocks, the others share the full
        ones and get a copy of the partial last block."""
        req, bs, n = r.req, self.block_size, len(r.req.prompt)
        full, partial = n // bs, n % bs
        max_new = req.options.max_tokens
        seed = req.options.seed if req.options.seed is not None else secrets.randbits(63)
        reserve = self._blocks_needed(n, max_new, 1) - full - (1 if partial else 0)
        seqs = []
        for j in range(req.num_samples):
            if j == 0:
                blocks = list(r.blocks)
            else:
                self.kv.incref(r.blocks[:full])
                blocks = r.blocks[:full]
                if partial:
                    self.kv.copy_tokens(r.blocks[full], [r.copies[j - 1]], partial)
                    blocks = blocks + [r.copies[j - 1]]
            gen = torch.Generator().manual_seed(sample_seed(seed, j))
            seqs.append(_Seq(r, list(req.prompt), blocks, list(r.keys[:full]), gen, reserve, j))
        r.seqs, r.running, r.shared = seqs, len(seqs), full
        return seqs

    def _decode(self, seqs: list[_Seq]) -> list[SampleResult]:
        dev, bs, kv = self.device, self.block_size, self.kv
        for s in seqs:
            if (len(s.tokens) - 1) // bs == len(s.blocks):
                s.blocks += kv.allocate(1)
                s.reserve -= 1
                self._reserved -= 1
        lens = [len(s.tokens) for s in seqs]
        pos = torch.tensor(lens, device=dev)[:, None] - 1
        groups: dict[int, list[int]] = {}
        for i, s in enumerate(seqs):
            groups.setdefault(id(s.req), []).append(i)
        if max(len(g) for g in groups.values()) == 1:
            read = self._slots([s.blocks for s in seqs], max(lens))
            write, packed = read.gather(1, pos), None
            mask = (torch.arange(read.shape[1], device=dev)[None] <= pos)[:, None, None]
        else:
            write, read, mask, packed = self._packed_context(seqs, lens, list(groups.values()))
        tokens = torch.tensor([[s.tokens[-1]] for s in seqs], device=dev)
        adapters = AdapterBatch.from_rows([s.req.req.adapter for s in seqs], dev)
        kvc = KVContext(kv.k_pool, kv.v_pool, write, read, mask, packed)
        hidden = self.model.hidden_states(tokens, pos, adapters, kv=kvc)
        logits = self.model.logits(hidden[:, 0], adapters)
        self._counters["decode_forwards"] += 1
        if self.enable_prefix_cache:
            for s in seqs:  # the block holding the token just computed may now be full
                if len(s.tokens) % bs == 0:
                    b = len(s.tokens) // bs - 1
                    w = s.req.req.weights
                    parent = s.keys[b - 1] if b else w
                    toks = s.tokens[b * bs:]
                    s.keys.append(block_key(parent, toks))
                    kv.register(s.blocks[b], s.keys[-1], parent, w, toks)
        finished = self._advance(seqs, logits)
        self._running = [s for s in self._running if s.stop_reason is None]
        return finished

    def _packed_context(self, seqs: list[_Seq], lens: list[int], groups: list[list[int]]):
        """Decode attention packed by request: one row per request holds the prompt's shared full
        blocks once, then each sample's own blocks; sample t's query sees the shared keys and
        its own. Returns write [B, 1], read [P, L], mask [P, 1, Q, L], query_index [P, Q]."""
        dev, bs = self.device, self.block_size
        P, Q = len(groups), max(len(g) for g in groups)
        shared = [seqs[g[0]].req.shared for g in groups]  # identical first blocks of the group
        own = [seqs[i].req.shared for g in groups for i in g]
        order = [i for g in groups for i in g]
        own_len = torch.tensor([lens[i] - f * bs for i, f in zip(order, own)], device=dev)
        own_slots = self._slots([seqs[i].blocks[f:] for i, f in zip(order, own)], int(own_len.max()))
        S = own_slots.shape[1]
        rows = torch.full((P, Q), -1, dtype=torch.long)  # packed query -> index into `order`
        start = 0
        for p, g in enumerate(groups):
            rows[p, :len(g)] = torch.arange(start, start + len(g))
            start += len(g)
        rows = rows.to(dev)
        k = rows.clamp(min=0)  # padding queries borrow a real sequence's keys: never all-masked
        pre_len = max(shared) * bs
        pre = self._slots([seqs[g[0]].blocks[:f] for g, f in zip(groups, shared)], pre_len)
        read = torch.cat([pre, own_slots[k].view(P, Q * S)], 1)
        pre_mask = torch.arange(pre_len, device=dev)[None] < torch.tensor(shared, device=dev)[:, None] * bs
        own_mask = torch.arange(S, device=dev)[None] < own_len[:, None]  # [B, S] in `order`
        eye = torch.eye(Q, dtype=torch.bool, device=dev)
        own_mask = (eye[None, :, :, None] & own_mask[k][:, None]).view(P, Q, Q * S)
        mask = torch.cat([pre_mask[:, None].expand(P, Q, pre_len), own_mask], -1)[:, None]
        # query_index refers to the batch rows (the order of `seqs`), write slots likewise
        inv = torch.tensor(order, device=dev)
        query_index = torch.where(rows >= 0, inv[k], -1)
        write = torch.empty(len(seqs), 1, dtype=torch.long, device=dev)
        write[inv] = own_slots.gather(1, own_len[:, None] - 1)
        return write, read, mask, query_index

    # ------------------------------------------------------------------ sampling
    def _advance(self, seqs: list[_Seq], logits: torch.Tensor) -> list[SampleResult]:
        """Sample one token per sequence from `logits` [B, V], apply stops, retire finished ones."""
        tokens, logprobs, tops = self._sample(seqs, logits)
        finished = []
        for s, tok, lp, top in zip(seqs, tokens, logprobs, tops):
            r = s.req
            s.tokens.append(tok)
            s.out.append(tok)
            s.logprobs.append(lp)
            if top is not None:
                s.top.append(top)
            r.usage.sample_tokens += 1
            self._counters["sample_tokens"] += 1
            opts = r.req.options
            if tok in r.stop_ids:
                s.stop_reason = "stop"
            elif opts.stop_strings and self._hit_stop_string(s, opts.stop_strings):
                s.stop_reason = "stop"
            elif len(s.out) >= opts.max_tokens:
                s.stop_reason = "length"
            if s.stop_reason is not None:
                self._retire(s)
            if r.req.stream:
                self._deltas.append(SampleDelta(r.req.request_id, s.index, [tok], [lp],
                                                None if top is None else [top], s.stop_reason,
                                                s.text if s.stop_reason else None))
            if r.running == 0:
                finished.append(self._result(r))
        return finished

    def _hit_stop_string(self, s: _Seq, stops: tuple[str, ...]) -> bool:
        """Did the newest token complete a stop string? Decodes only a window of recent tokens
        (wide enough for the longest stop string), then the whole text once, to cut it."""
        window = 2 * max(len(x) for x in stops) + 8
        if not any(x in self.tokenizer.decode(s.out[-window:]) for x in stops):
            return False
        text = self.tokenizer.decode(s.out)
        hits = [i for i in (text.find(x) for x in stops) if i >= 0]
        if not hits:
            return False
        s.text = text[:min(hits)]
        return True

    def _retire(self, s: _Seq) -> None:
        self.kv.release(s.blocks)
        self._reserved -= s.reserve
        s.reserve = 0
        s.blocks = []
        s.req.running -= 1
        if s.text is None:
            out = s.out[:-1] if s.stop_reason == "stop" else s.out
            s.text = self.tokenizer.decode(out)

    def _sample(self, seqs: list[_Seq], logits: torch.Tensor):
        """(tokens, their logprobs, each row's top-k (token, logprob) list or None)."""
        logits = logits.float()
        logp = torch.log_softmax(logits, dim=-1)
        opts = [s.req.req.options for s in seqs]
        greedy = [o.greedy for o in opts]
        if all(greedy):
            tok = logits.argmax(-1)
        else:
            x = logits / torch.tensor([1.0 if g else o.temperature for o, g in zip(opts, greedy)],
                                      device=logits.device)[:, None]
            ks = [o.top_k if o.top_k > 0 else 0 for o in opts]
            if any(ks):
                kmax = min(max(ks), x.shape[-1])
                top = x.topk(kmax, dim=-1).values
                idx = torch.tensor([min(k, kmax) - 1 if k else kmax - 1 for k in ks], device=x.device)
                thr = top.gather(1, idx[:, None])
                thr = torch.where(torch.tensor(ks, device=x.device)[:, None] > 0, thr, -math.inf)
                x = x.masked_fill(x < thr, -math.inf)
            if any(o.top_p < 1 for o in opts):
                top_p = torch.tensor([o.top_p if o.top_p < 1 else math.inf for o in opts],
                                     device=x.device)[:, None]
                sx, si = x.sort(dim=-1, descending=True)
                sp = sx.softmax(-1)
                drop = (sp.cumsum(-1) - sp) > top_p  # keep the smallest prefix reaching top_p
                x = x.masked_fill(torch.zeros_like(drop).scatter(1, si, drop), -math.inf)
            cdf = x.softmax(-1).double().cumsum(-1)
            u = torch.tensor([float(torch.rand((), generator=s.gen)) if not g else 0.0
                              for s, g in zip(seqs, greedy)], dtype=torch.float64, device=x.device)
            tok = torch.searchsorted(cdf, (u * cdf[:, -1])[:, None], right=True)[:, 0]
            tok = tok.clamp(max=x.shape[-1] - 1)
            if any(greedy):
                tok = torch.where(torch.tensor(greedy, device=x.device), logits.argmax(-1), tok)
        lp = logp.gather(1, tok[:, None])[:, 0]
        ks = [o.top_logprobs for o in opts]
        tops: list[list[tuple[int, float]] | None] = [None] * len(seqs)
        if any(ks):
            v, i = logp.topk(max(ks), dim=-1)
            v, i = v.tolist(), i.tolist()
            tops = [list(zip(i[b][:k], v[b][:k])) if k else None for b, k in enumerate(ks)]
        return tok.tolist(), lp.tolist(), tops

    def _prompt_logprobs(self, r: _Request, hidden: torch.Tensor, start: int, adapters: AdapterBatch) -> None:
        """Extend the prompt logprobs with this chunk's positions `start`.. (hidden [1, len, H]):
        entry i = log p(prompt[i] | prompt[:i]) from a full forward; entry 0 is None."""
        prompt, k = r.req.prompt, r.req.topk_prompt_logprobs
        n = len(prompt)
        if start == 0:
            r.prompt_logprobs = [None]
            r.topk_prompt_logprobs = [None]
        stop = min(start + hidden.shape[1], n - 1)  # the last prompt position predicts no prompt token
        targets = torch.tensor(prompt[start + 1:stop + 1], device=hidden.device)
        for a in range(start, stop, LOGITS_CHUNK):
            b = min(a + LOGITS_CHUNK, stop)
            logp = torch.log_softmax(self.model.logits(hidden[:, a - start:b - start], adapters)[0], dim=-1)
            r.prompt_logprobs += logp.gather(1, targets[a - start:b - start, None])[:, 0].tolist()
            if k:
                v, i = logp.topk(min(k, logp.shape[-1]), dim=-1)
                r.topk_prompt_logprobs += [list(zip(ii, vv)) for ii, vv in zip(i.tolist(), v.tolist())]

    def _result(self, r: _Request) -> SampleResult:
        self._live.pop(r.req.request_id, None)
        if r.full:  # computed for every full forward; returned only when asked for
            if not (r.req.prompt_logprobs or not r.req.generate):
                r.prompt_logprobs = None
            if not r.req.topk_prompt_logprobs:
                r.topk_prompt_logprobs = None
        k = r.req.options.top_logprobs
        seqs = [SampledSequence(s.out, s.logprobs, s.text, s.stop_reason, s.top if k else None)
                for s in r.seqs]
        return SampleResult(r.req.request_id, seqs, r.prompt_logprobs, r.usage, r.topk_prompt_logprobs)
