"""What the sampler does each step: which requests it admits, which prompts it prefills how far,
which sequences it decodes. No model and no tensors: it reads token counts, KV block counts and
the seconds the step loop measured.

Admission. Waiting requests are tried in the order of the admission policy (admission.py;
`FairAdmission`: fair by tokens across tenants, arrival order within one); the first that does not
fit stops admission for this step. A tenant that already holds work may hold at most
`tenant_share` of `max_running` and of the KV pool while another tenant has been active within
`tenant_window` seconds: its further requests wait (they are never refused), so one tenant's flood
leaves room for another active tenant's request to start at once. A tenant alone (no other one
seen within the window) may use the whole engine: the share costs a single user nothing. A
request fits when its worst-case KV blocks (the prompt's, plus every sample decoding to
`max_tokens`) fit the pool: free + evictable blocks minus what admitted requests have reserved. So a
running sequence never runs out of blocks and nothing is ever preempted. At admission a request
looks up the longest cached prefix of `prompt[:-1]` (the last prompt token is always computed: its
logits give the first sampled token): full blocks, then the first tokens it shares with a block
cached after the last of them (copied: kv_cache.py); a request whose uncached prefix starts with
blocks another request is still computing waits, then hits them. A request that scores its prompt
reads only the blocks before the first position it scores (`Request.cacheable`: none for
whole-prompt logprobs), unless it reuses cached prompt scores: then the blocks that carry them
(prompt_scores.py). A hybrid model's request also takes a state slot per sample (one at least) and
is served only the longest prefix that ends at a state snapshot (state_cache.py: `StateCache.hit`).

Prefill chunks. At most one prefill forward a step, over at most `max_batch_tokens` positions
(padding included), so a long prompt is prefilled over several steps. Every chunk is sized by
time, scaled from the last prefill's tokens and seconds: while sequences decode, to take about
`prefill_step_seconds` (at most twice as many tokens as last time, and never fewer than
`min_prefill_tokens`: a GEMM of fewer rows runs well below the CPU's peak, and on a slow or busy
machine time alone shrinks chunks to a few dozen tokens, each paying a whole step; a floor that
falls as 1 / (1 + key_cost x position), since deep in a long prompt attention is most of a row's
work); a short prompt that samples, ready beside a long one while nothing decodes, is prefilled
alone, and the long one's next chunk is one the new sequence decodes beside; when
nothing decodes, or only sequences of one tenant's requests that arrived within `burst_seconds` of
every prompt still to prefill, none of them longer than `max_batch_tokens` (one batch sent together:
its decoding waits on no one else's, and it finishes soonest prefilled in large chunks, as vLLM
does), about `idle_prefill_seconds` (scaled from the last chunk of at least `RATE_POSITIONS`, or
of half those seconds: a small quick one is mostly a forward's fixed cost), longer,
since one large forward is the most efficient and nobody else waits on decode steps (whole prompts
in one forward while that fits, e.g. a GRPO step; the whole `max_batch_tokens` before anything was
measured). When every prompt left to prefill samples, such a batch's first sequences also wait
for those prompts' chunks (which will decode beside them), up to `burst_stall_seconds` since they
last decoded: each decode step streams every weight of the model for its few rows, so decoding
them between the chunks made a 64-prompt batch take 13 extra decode forwards (3-5 % of its time).
A prompt that only scores (no samples) never holds them. Either way a request arriving meanwhile
starts within one bounded step, even beside a prompt of many thousand tokens that alone holds the
engine. Prompts are ordered fairly by tokens across tenants (`fair_order`: each tenant's
prompts fewest tokens left first, tenants interleaved by the prefill tokens computed for them), so
a tenant's long prompts cannot hold back another tenant's short one, nor its many short prompts
another tenant's long one; the last row may take a partial chunk.

Prefill share. While sequences decode, a prompt that arrived before one of them, or that has more
than `max_batch_tokens` tokens left, is held to `prefill_share` x the decode time: a chunk that may
hold such prompts leaves its seconds as a debt that the following decode steps pay off at
`prefill_share` x their own seconds, and only newer, short prompts prefill while the debt is
positive. So a long prompt adds about `prefill_share` to the per-token latency of those who came
after it however costly its chunks are, while a batch of requests sent together (a GRPO step) is
prefilled at full speed and decodes as one batch.
"""

from __future__ import annotations

import time
from collections import Counter
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable

from ..config import SamplerConfig
from .admission import AdmissionPolicy, FairAdmission, FifoAdmission
from .kv_cache import BlockManager, chain_hashes
from .prompt_scores import reads_cached_scores, serves_scores
from .sequence import Request, Sequence

if TYPE_CHECKING:
    from .state_cache import StateCache

# Positions a prefill chunk needs for its seconds to show the engine's prefill rate: a smaller one
# is mostly the fixed cost of a forward (every weight read once; docs/serving.md, "Where the
# engine's constants come from").
RATE_POSITIONS = 512


@dataclass
class StepPlan:
    """One step's work: decode `decode` (the sequences running when the step began) and prefill
    `prefill` (request, prompt tokens to compute); `charged`: the prefill's seconds become debt."""

    decode: list[Sequence]
    prefill: list[tuple[Request, int]]
    charged: bool


def _rate(chunk: tuple[int, float]) -> float:
    """Positions per second of a prefill chunk (positions, seconds)."""
    return chunk[0] / max(chunk[1], 1e-6)


def chunk_rows(ready: list[Request], budget: int) -> list[tuple[Request, int]]:
    """Prefill rows (request, tokens to compute) from `ready`, in that order: each whole but the
    last, which may take a partial chunk; rows x the longest chunk <= budget."""
    rows: list[tuple[Request, int]] = []
    longest = 0
    for r in ready:
        cap = budget // (len(rows) + 1)
        if cap < 1 or longest > cap:
            break
        rows.append((r, min(r.prompt_left, cap)))
        longest = max(longest, rows[-1][1])
        if r.prompt_left > cap:
            break
    return rows


def fair_order(ready: list[Request], served: dict[str, int]) -> list[Request]:
    """`ready` in prefill order: each tenant's prompts fewest tokens left first (arrival order on
    ties), and across tenants by the tokens the tenant would have been served once a prompt is
    done (`served[tenant]` + its prompts up to that one). With one tenant: fewest tokens left first."""
    finish: dict[int, int] = {}
    total = dict.fromkeys((r.tenant for r in ready), 0)
    for r in sorted(ready, key=lambda r: r.prompt_left):  # stable: arrival order on ties
        t = r.tenant
        total[t] += r.prompt_left
        finish[id(r)] = served.get(t, 0) + total[t]
    return sorted(ready, key=lambda r: (finish[id(r)], r.prompt_left, r.order))


class Scheduler:
    """The sampler's queues (waiting -> prefilling -> running) and its KV block accounting.

    Invariant: `reserved` is the sum of the prefilling requests' `reserved` and the running
    sequences' `reserve`, and never exceeds the pool's free + evictable blocks, so `grow` never
    runs out of blocks."""

    def __init__(
        self,
        kv: BlockManager,
        config: SamplerConfig = SamplerConfig(),
        *,
        key_cost: float = 0.0,
        admission: AdmissionPolicy | None = None,
        tenant_window: float = 60.0,
        clock: Callable[[], float] = time.monotonic,
        states: StateCache | None = None,
    ):
        """`config`: the sampler's knobs, checked where it was built (engine/config.py); `key_cost`:
        a prompt position's attention work per earlier key over its linear layers' (Sampler's
        `key_cost`); `admission`: the waiting queue's policy (default: `config.fair`'s)."""
        self.kv = kv
        self.states = states  # a hybrid model's state slots and snapshots
        self.block_size = kv.block_size
        self.max_batch_tokens = config.max_batch_tokens
        self.max_running = config.max_running
        self.prefix_cache = config.enable_prefix_cache
        self.prefill_share = config.prefill_share
        self.prefill_step_seconds = config.prefill_step_seconds
        self.idle_prefill_seconds = config.idle_prefill_seconds
        self.min_prefill_tokens = max(kv.block_size, config.min_prefill_tokens)
        self.key_cost = key_cost  # a position's attention work per earlier key / its linear layers'
        self.burst_seconds = config.burst_seconds
        self.burst_stall_seconds = config.burst_stall_seconds
        self._stalled_since: float | None = None  # when a batch's sequences last skipped a decode step
        if admission is None:
            admission = FairAdmission() if config.fair else FifoAdmission()
        self.waiting: AdmissionPolicy = admission
        share = config.tenant_share
        self.tenant_running = max(1, int(config.max_running * share))  # samples one tenant may hold
        self.tenant_blocks = max(1, int(kv.num_blocks * share))  # blocks one tenant may hold
        self.tenant_window = tenant_window  # seconds a tenant counts as active after its last work
        self.clock = clock
        self._seen: dict[str, float] = {}  # tenant -> when it last had work here (clock seconds)
        self.prefill_served: dict[str, int] = {}  # prompt tokens computed per tenant now prefilling
        self.prefilling: list[Request] = []  # admitted, prompt KV not complete yet
        self.running: list[Sequence] = []
        self.reserved = 0  # blocks promised to admitted requests' samples, not yet allocated
        self.debt = 0.0  # held-back prefill seconds run while decoding, not yet paid by decode steps
        self.last_prefill: tuple[int, float] | None = None  # (positions, seconds) of the last prefill
        # the same, of the last chunk of >= RATE_POSITIONS (or faster than it): idle chunks scale from it
        self.rate_prefill: tuple[int, float] | None = None
        self._arrivals = 0

    # ------------------------------------------------------------------ block accounting
    def blocks_needed(self, n: int, max_new: int, samples: int) -> int:
        """Worst-case blocks of a request: its `n` prompt tokens' full blocks, shared by every
        sample, plus each sample's own; with 0 samples (compute_logprobs), the prompt's blocks."""
        if samples == 0:
            return -(-n // self.block_size)
        return n // self.block_size + samples * self._own_blocks(n, max_new)

    def _own_blocks(self, n: int, max_new: int) -> int:
        """Blocks one sample holds beyond the shared full prompt blocks (its copy of the partial
        last prompt block included). The KV of its last token is never computed."""
        bs = self.block_size
        return -(-(n + max_new - 1) // bs) - n // bs

    def sample_reserve(self, r: Request) -> int:
        """Blocks each sample of `r` may still allocate once forked (beyond its partial copy)."""
        n = len(r.prompt)
        return self._own_blocks(n, r.max_new) - int(n % self.block_size != 0)

    def grow(self, seqs: list[Sequence]) -> None:
        """Give each sequence whose next token starts a new block that block, from its reservation."""
        bs = self.block_size
        for s in seqs:
            if (len(s.tokens) - 1) // bs == len(s.blocks):
                s.blocks += self.kv.allocate(1)
                s.reserve -= 1
                self.reserved -= 1

    def release(self, s: Sequence) -> None:
        """A sequence stopped: its blocks, state slot and what is left of its reservation go back."""
        self.kv.release(s.blocks)
        self.reserved -= s.reserve
        s.reserve = 0
        s.blocks = []
        if s.slot >= 0:
            self.states.release([s.slot])
            s.slot = -1

    # ------------------------------------------------------------------ request lifecycle
    def add(self, r: Request) -> None:
        r.arrived = self._seen[r.tenant] = self.clock()
        self._arrivals += 1
        r.order = self._arrivals
        self.waiting.push(r)

    def has_work(self) -> bool:
        return bool(len(self.waiting) or self.prefilling or self.running)

    def prompt_done(self, r: Request) -> None:
        """`r`'s prompt is prefilled: it leaves prefilling; without samples its blocks go back."""
        self.prefilling.remove(r)
        if not r.samples:
            self.kv.release(r.blocks)
            if r.slots:
                self.states.release(r.slots)

    def start(self, seqs: list[Sequence]) -> None:
        """Forked sequences join the running ones (they decode from the next step on)."""
        self.running += seqs

    def drop_stopped(self) -> None:
        self.running = [s for s in self.running if s.stop_reason is None]

    def cancel(self, r: Request) -> None:
        """Take `r` out of the queue, or give back its prompt blocks, copies and reservation if it
        is prefilling. Its running sequences are released one by one (`release`)."""
        if self.waiting.remove(r):
            return
        if r in self.prefilling:
            self.prefilling.remove(r)
            self.kv.release(r.blocks + r.copies)
            r.blocks, r.copies = [], []
            self.reserved -= r.reserved
            if r.slots:
                self.states.release(r.slots)
                self.states.forget(r.waiting_snapshots)
                r.slots, r.waiting_snapshots = [], []

    # ------------------------------------------------------------------ the step
    def schedule(self) -> StepPlan:
        """Admit what fits, then choose this step's prefill rows and decode sequences."""
        decoding = list(self.running)
        self.prefilling += self._admit()
        if not decoding:
            self.debt = 0.0  # nobody waits on decode steps: prefill takes the engine
        unpaid = bool(decoding) and self.debt > 0  # held-back prompts wait for it
        ready = self.prefilling
        if unpaid:  # only prompts newer than every decoding request, and short
            newest = max(s.request.order for s in decoding)
            ready = [r for r in ready if r.order > newest and r.prompt_left <= self.max_batch_tokens]
        # someone waits on this step's chunk: a sequence decoding, or a short prompt that samples as
        # soon as it is prefilled beside a long one; a batch sent together decodes waiting for
        # nobody else: its prompts prefill as if idle
        deepest = max((r.prefilled for r in ready), default=0)
        step = self._prefill_budget(True, deepest)  # a chunk sized for someone who waits on it
        others_wait = (bool(decoding) or self._short_beside_long(ready, step)) and not self._one_burst(
            decoding, ready
        )
        if not decoding and others_wait:  # the short ones alone: the long one's next chunk is
            # then one that sequences decode beside, held to prefill_share like any other
            ready = [r for r in ready if r.prompt_left <= step]
        budget = step if others_wait else self._prefill_budget(False, deepest)
        rows = chunk_rows(fair_order(ready, self._served()), budget) if ready else []
        if decoding and rows and not others_wait and all(r.samples for r in ready) and self._may_stall():
            return StepPlan([], rows, charged=False)  # the batch's sequences wait for its prompts' own
        self._stalled_since = None
        return StepPlan(decoding, rows, charged=bool(decoding) and not unpaid)

    def _may_stall(self) -> bool:
        """Whether a batch's decoding sequences may skip this step's decode (they have not waited
        `burst_stall_seconds` since they last decoded); starts their wait if not yet started."""
        now = self.clock()
        if self._stalled_since is None:
            self._stalled_since = now
        return now - self._stalled_since < self.burst_stall_seconds

    def _one_burst(self, decoding: list[Sequence], ready: list[Request]) -> bool:
        """Every decoding sequence's request and every prompt ready to prefill are one tenant's and
        arrived within `burst_seconds` of one another, and no prompt has more than
        `max_batch_tokens` left: one batch sent together (a GRPO step, an evaluation's requests),
        whose decoding sequences wait on no one else's prefill. A long prompt is never part of one:
        it is held to `prefill_share` like any other (a short request sent with it would otherwise
        decode a token per large chunk)."""
        reqs = [s.request for s in decoding] + ready
        times = [r.arrived for r in reqs]
        one_tenant = len({r.tenant for r in reqs}) == 1
        short = all(r.prompt_left <= self.max_batch_tokens for r in ready)
        return one_tenant and short and max(times) - min(times) <= self.burst_seconds

    def _short_beside_long(self, ready: list[Request], step: int) -> bool:
        """A prompt that samples and fits a `step`-sized chunk is ready beside one that does not: it
        decodes as soon as it is prefilled and then waits on the other's chunks as a decoding
        sequence does."""
        return any(r.samples and r.prompt_left <= step for r in ready) and any(
            r.prompt_left > step for r in ready
        )

    def _served(self) -> dict[str, int]:
        """`prefill_served` for the tenants now prefilling: one that starts prefilling starts at
        the lowest count among those already there (no credit banked while it was idle)."""
        tenants = {r.tenant for r in self.prefilling}
        kept = {t: n for t, n in self.prefill_served.items() if t in tenants}
        floor = min(kept.values(), default=0)
        self.prefill_served = {t: kept.get(t, floor) for t in tenants}
        return self.prefill_served

    def prefilled(self, plan: StepPlan, seconds: float) -> None:
        """The step loop ran `plan.prefill` in `seconds`."""
        for r, take in plan.prefill:
            t = r.tenant
            self.prefill_served[t] = self.prefill_served.get(t, 0) + take
        self.last_prefill = (len(plan.prefill) * max(take for _, take in plan.prefill), seconds)
        if (
            self.last_prefill[0] >= min(RATE_POSITIONS, self.max_batch_tokens)
            or seconds >= self.idle_prefill_seconds / 2
            or (self.rate_prefill is not None and _rate(self.last_prefill) > _rate(self.rate_prefill))
        ):  # large or long enough to show the rate (a forward's fixed cost is then a small part of
            # it: a long prompt's later chunks, slower as attention grows, are measured too), or
            # faster than it (it was a slow moment's)
            self.rate_prefill = self.last_prefill
        if plan.charged:  # a chunk that may hold held-back prompts: they owe its time
            self.debt += seconds

    def decoded(self, seconds: float) -> None:
        """The step loop ran a decode step in `seconds`: it pays `prefill_share` of them off the debt."""
        self.debt = max(0.0, self.debt - self.prefill_share * seconds)

    def _prefill_budget(self, decoding: bool, position: int = 0) -> int:
        """Prefill positions for this step, between `min_prefill_tokens` and max_batch_tokens: what
        should take `prefill_step_seconds` while sequences decode (at most twice the last chunk),
        else `idle_prefill_seconds`, scaled from the last prefill step of at least `RATE_POSITIONS`
        positions, or a smaller one that ran faster per position (a few dozen positions take most
        of a large chunk's time, and the first forward of a process pays one-time costs: scaled
        from them, the next chunk would be several times too short). Before any is measured: four
        blocks while decoding, max_batch_tokens when not. The floor is for the linear layers'
        GEMMs, whose rows run below the CPU's peak when few: a chunk that starts at `position`
        spends 1 + key_cost x position times their work on each of its rows, and its floor is
        that much lower (a block at least), so deep in a long prompt, where attention is most of
        the work, a chunk still ends in about its seconds."""
        low = min(self.min_prefill_tokens, self.max_batch_tokens)
        low = max(min(self.block_size, low), int(low / (1.0 + self.key_cost * position)))
        if decoding:
            if self.last_prefill is None:
                return min(self.max_batch_tokens, max(low, 4 * self.block_size))
            tokens, seconds = self.last_prefill
            scaled = int(tokens * min(2.0, self.prefill_step_seconds / max(seconds, 1e-6)))
        elif self.rate_prefill is None:
            return self.max_batch_tokens
        else:  # the measured rate; smaller chunks run slower per token, so this errs short
            scaled = int(_rate(self.rate_prefill) * self.idle_prefill_seconds)
        return max(low, min(scaled, self.max_batch_tokens))

    # ------------------------------------------------------------------ admission
    def _admit(self) -> list[Request]:
        """Waiting requests, in the admission policy's order, whose KV blocks fit; allocated. A
        tenant holding `tenant_running` samples or `tenant_blocks` blocks is held: its requests
        wait while other tenants' are admitted."""
        admitted: list[Request] = []
        # keys of blocks still being prefilled: a request whose uncached prefix starts there waits
        pending = {k for r in self.prefilling for k in r.keys[r.prefilled // self.block_size :]}
        running = len(self.running) + sum(r.samples for r in self.prefilling)
        samples, blocks = self._tenant_holdings()
        shared = self._sharing(samples)
        held = {
            t
            for t in samples
            if t in shared and (samples[t] >= self.tenant_running or blocks[t] >= self.tenant_blocks)
        }
        while (r := self.waiting.peek(held)) is not None:
            if (admitted or self.running or self.prefilling) and running + r.samples > self.max_running:
                break
            t = r.tenant
            if t in held:  # a policy that does not skip held tenants: nothing more this step
                break
            need = self.blocks_needed(len(r.prompt), r.max_new, r.samples)
            if (
                samples[t]
                and t in shared
                and (samples[t] + r.samples > self.tenant_running or blocks[t] + need > self.tenant_blocks)
            ):
                held.add(t)  # over its share with this one: it waits, other tenants go on
                continue
            if not self._allocate(r, pending):
                break
            self.waiting.pop(r)
            pending.update(r.keys[r.prefilled // self.block_size :])
            running += r.samples
            self._hold(samples, blocks, r)
            admitted.append(r)
        return admitted

    def _sharing(self, holding: Counter) -> set[str]:
        """The tenants held to `tenant_share`: every tenant seen within `tenant_window` seconds (it
        added a request, or holds samples or KV blocks now), when there is more than one; none
        otherwise. A tenant still waiting keeps its place through the admission order."""
        now = self.clock()
        for t in holding:
            self._seen[t] = now
        self._seen = {t: at for t, at in self._seen.items() if now - at <= self.tenant_window}
        return set(self._seen) if len(self._seen) > 1 else set()

    def _tenant_holdings(self) -> tuple[Counter, Counter]:
        """Per tenant: the samples (a compute_logprobs request counts 1) and the KV blocks (held
        and reserved) of its prefilling requests and running sequences."""
        samples, blocks = Counter(), Counter()
        for r in self.prefilling:
            self._hold(samples, blocks, r)
        shared = {}  # a running request's full prompt blocks, shared by its sequences: counted once
        for s in self.running:
            t = s.request.tenant
            samples[t] += 1
            blocks[t] += len(s.blocks) - s.request.shared + s.reserve
            shared[id(s.request)] = (t, s.request.shared)
        for t, n in shared.values():
            blocks[t] += n
        return samples, blocks

    @staticmethod
    def _hold(samples: Counter, blocks: Counter, r: Request) -> None:
        """Count admitted request `r` (prompt not done) in its tenant's holdings: its samples (a
        compute_logprobs request counts 1) and its KV blocks, held and reserved."""
        samples[r.tenant] += max(r.samples, 1)
        blocks[r.tenant] += len(r.blocks) + len(r.copies) + r.reserved

    def _allocate(self, r: Request, pending: set[int]) -> bool:
        """Allocate `r`'s prompt blocks (cache hits first) and partial-block copies, and reserve
        its samples' decode blocks (a hybrid model: and its state slots); False, holding nothing,
        if they do not fit or the next block it needs is `pending` (being computed by another
        request)."""
        bs, kv, req, n, k = self.block_size, self.kv, r.req, len(r.prompt), r.samples
        states = self.states
        if states is not None and states.num_free < max(k, 1):
            return False
        if self.prefix_cache:
            r.keys = chain_hashes(r.weights, r.key, bs)
        reads = r.cacheable
        serves = None
        if reads_cached_scores(req):
            serves = lambda j, block: serves_scores(req, j, block.scores, bs)  # noqa: E731
        matched = (
            []
            if not reads or not self.prefix_cache
            else kv.match(r.weights, r.key[:reads], r.keys[: reads // bs], serves)
        )
        if reads and r.keys[len(matched) : len(matched) + 1] and r.keys[len(matched)] in pending:
            kv.release(matched)  # the next block is being computed now: hit it when it is done
            return False
        # A request that reads cached scores is served whole blocks (they carry the scores); a
        # hybrid model's that scores nothing also a partial block (its prompt's snapshot is in one).
        whole_blocks = serves is not None and (states is None or r.scores_prompt)
        part = None  # (block, m): a cached block's first m slots continue the matched blocks
        if reads > len(matched) * bs and self.prefix_cache and not whole_blocks:
            parent = r.keys[len(matched) - 1] if matched else r.weights
            usable = None if states is None else states.usable
            part = kv.match_partial(r.weights, parent, r.key[len(matched) * bs : reads], usable)
        snapshot = None  # a hybrid model's: the state after the served prefix
        if states is not None:
            matched, part, snapshot = states.hit(matched, part, whole_blocks)
        prompt_blocks = -(-n // bs)
        copies = max(k - 1, 0) * int(n % bs != 0)
        later = k * self.sample_reserve(r)
        need = prompt_blocks - len(matched) + copies + later
        if part and kv.num_free - self.reserved < need:
            kv.release([part[0]])  # its block may be the one this request needs: compute its tokens
            part = None
            if states is not None:  # the snapshot was at the partial block's: serve nothing
                kv.unmatch(matched)
                matched, snapshot = [], None
                need = prompt_blocks + copies + later
        if kv.num_free - self.reserved < need:
            kv.release(matched)
            return False
        r.blocks = matched + kv.allocate(prompt_blocks - len(matched))
        r.copies = kv.allocate(copies)
        r.reserved = later
        self.reserved += later
        r.cached = r.prefilled = len(matched) * bs
        if part:
            kv.copy_tokens(part[0], [r.blocks[len(matched)]], part[1])
            kv.release([part[0]])
            r.cached = r.prefilled = r.cached + part[1]
        if states is not None:
            r.slots = states.acquire(max(k, 1))
            states.load(r.slots[0], snapshot)
        return True
