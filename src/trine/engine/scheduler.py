"""What the sampler does each step: which requests it admits, which prompts it prefills how far,
which sequences it decodes. No model and no tensors: it reads token counts, KV block counts and
the seconds the step loop measured.

Admission. Waiting requests are tried in the order of the admission policy (`FifoAdmission`:
arrival order); the first that does not fit stops admission for this step. A request fits when its
worst-case KV blocks (the prompt's, plus every sample decoding to `max_tokens`) fit the pool: free
+ evictable blocks minus what admitted requests have reserved. So a running sequence never runs
out of blocks and nothing is ever preempted. At admission a request looks up the longest cached
full-block prefix of `prompt[:-1]` (the last prompt token is always computed: its logits give the
first sampled token); a request whose uncached prefix starts with blocks another request is still
computing waits, then hits them. Requests with prompt logprobs never read the cache.

Prefill chunks. At most one prefill forward a step, over at most `max_batch_tokens` positions
(padding included), so a long prompt is prefilled over several steps. When nothing decodes the
chunk is the whole `max_batch_tokens`: whole prompts in one forward. Otherwise it is sized by time:
scaled from the last prefill's tokens and seconds (at least one block, at most twice as many as
last time) to take about `prefill_step_seconds`, which bounds how long a request arriving
meanwhile waits. Prompts with the fewest tokens left go first (they start decoding at once); the
longest takes what is left of the budget.

Prefill share. While sequences decode, a prompt that arrived before one of them, or that has more
than `max_batch_tokens` tokens left, is held to `prefill_share` x the decode time: a chunk that may
hold such prompts leaves its seconds as a debt that the following decode steps pay off at
`prefill_share` x their own seconds, and only newer, short prompts prefill while the debt is
positive. So a long prompt adds about `prefill_share` to the per-token latency of those who came
after it however costly its chunks are, while a batch of requests sent together (a GRPO step) is
prefilled at full speed and decodes as one batch.
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from typing import Protocol

from .kv_cache import BlockManager, chain_hashes
from .sequence import Request, Sequence


class AdmissionPolicy(Protocol):
    """The order in which waiting requests are admitted. The scheduler tries `peek()` and, when it
    fits, admits it with `pop()`; when it does not, admission stops for this step."""

    def push(self, r: Request) -> None: ...
    def peek(self) -> Request | None: ...
    def pop(self) -> Request: ...
    def remove(self, r: Request) -> bool: ...  # False if `r` is not waiting
    def __len__(self) -> int: ...


class FifoAdmission:
    """First come, first admitted."""

    def __init__(self) -> None:
        self._queue: deque[Request] = deque()

    def push(self, r: Request) -> None:
        self._queue.append(r)

    def peek(self) -> Request | None:
        return self._queue[0] if self._queue else None

    def pop(self) -> Request:
        return self._queue.popleft()

    def remove(self, r: Request) -> bool:
        """Take `r` out of the queue; False if it is not there."""
        try:
            self._queue.remove(r)
        except ValueError:
            return False
        return True

    def __len__(self) -> int:
        return len(self._queue)


@dataclass
class StepPlan:
    """One step's work: decode `decode` (the sequences running when the step began) and prefill
    `prefill` (request, prompt tokens to compute); `charged`: the prefill's seconds become debt."""

    decode: list[Sequence]
    prefill: list[tuple[Request, int]]
    charged: bool


def chunk_rows(ready: list[Request], budget: int) -> list[tuple[Request, int]]:
    """Prefill rows (request, tokens to compute) from `ready`: fewest tokens left first, each whole
    but the last, which may take a partial chunk; rows x the longest chunk <= budget."""
    rows: list[tuple[Request, int]] = []
    for r in sorted(ready, key=lambda r: r.prompt_left):  # stable: arrival order on ties
        cap = budget // (len(rows) + 1)
        if cap < 1 or (rows and rows[-1][1] > cap):  # takes ascend: the last row is the longest
            break
        rows.append((r, min(r.prompt_left, cap)))
        if r.prompt_left > cap:
            break
    return rows


class Scheduler:
    """The sampler's queues (waiting -> prefilling -> running) and its KV block accounting.

    Invariant: `reserved` is the sum of the prefilling requests' `reserved` and the running
    sequences' `reserve`, and never exceeds the pool's free + evictable blocks, so `grow` never
    runs out of blocks."""

    def __init__(self, kv: BlockManager, *, max_batch_tokens: int = 2048, max_running: int = 64,
                 prefix_cache: bool = True, prefill_share: float = 0.5, prefill_step_seconds: float = 0.25,
                 admission: AdmissionPolicy | None = None):
        if max_batch_tokens < 1 or max_running < 1:
            raise ValueError("max_batch_tokens and max_running must be >= 1")
        if not (prefill_share > 0 and prefill_step_seconds > 0):
            raise ValueError("prefill_share and prefill_step_seconds must be > 0")
        self.kv = kv
        self.block_size = kv.block_size
        self.max_batch_tokens = max_batch_tokens
        self.max_running = max_running
        self.prefix_cache = prefix_cache
        self.prefill_share = prefill_share
        self.prefill_step_seconds = prefill_step_seconds
        self.waiting: AdmissionPolicy = admission if admission is not None else FifoAdmission()
        self.prefilling: list[Request] = []  # admitted, prompt KV not complete yet
        self.running: list[Sequence] = []
        self.reserved = 0  # blocks promised to admitted requests' samples, not yet allocated
        self.debt = 0.0  # held-back prefill seconds run while decoding, not yet paid by decode steps
        self.last_prefill: tuple[int, float] | None = None  # (positions, seconds) of the last prefill
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
        n = len(r.req.prompt)
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
        """A sequence stopped: its blocks and what is left of its reservation go back."""
        self.kv.release(s.blocks)
        self.reserved -= s.reserve
        s.reserve = 0
        s.blocks = []

    # ------------------------------------------------------------------ request lifecycle
    def add(self, r: Request) -> None:
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
            newest = max(s.req.order for s in decoding)
            ready = [r for r in ready if r.order > newest and r.prompt_left <= self.max_batch_tokens]
        rows = chunk_rows(ready, self._prefill_budget(bool(decoding))) if ready else []
        return StepPlan(decoding, rows, charged=bool(decoding) and not unpaid)

    def prefilled(self, plan: StepPlan, seconds: float) -> None:
        """The step loop ran `plan.prefill` in `seconds`."""
        self.last_prefill = (len(plan.prefill) * max(take for _, take in plan.prefill), seconds)
        if plan.charged:  # a chunk that may hold held-back prompts: they owe its time
            self.debt += seconds

    def decoded(self, seconds: float) -> None:
        """The step loop ran a decode step in `seconds`: it pays `prefill_share` of them off the debt."""
        self.debt = max(0.0, self.debt - self.prefill_share * seconds)

    def _prefill_budget(self, decoding: bool) -> int:
        """Prefill positions for this step: max_batch_tokens when nothing decodes (nobody waits on
        the step, and one large forward is the most efficient); else what should take
        `prefill_step_seconds`, scaled from the last prefill step, between one block and
        max_batch_tokens."""
        if not decoding:
            return self.max_batch_tokens
        low = min(self.block_size, self.max_batch_tokens)
        if self.last_prefill is None:
            return min(self.max_batch_tokens, 4 * self.block_size)
        tokens, seconds = self.last_prefill
        scaled = int(tokens * min(2.0, self.prefill_step_seconds / max(seconds, 1e-6)))
        return max(low, min(scaled, self.max_batch_tokens))

    # ------------------------------------------------------------------ admission
    def _admit(self) -> list[Request]:
        """Waiting requests, in the admission policy's order, whose KV blocks fit; allocated."""
        admitted: list[Request] = []
        # keys of blocks still being prefilled: a request whose uncached prefix starts there waits
        pending = {k for r in self.prefilling for k in r.keys[r.done // self.block_size:]}
        running = len(self.running) + sum(r.samples for r in self.prefilling)
        while (r := self.waiting.peek()) is not None:
            if (admitted or self.running or self.prefilling) and running + r.samples > self.max_running:
                break
            if not self._allocate(r, pending):
                break
            self.waiting.pop()
            pending.update(r.keys[r.done // self.block_size:])
            running += r.samples
            admitted.append(r)
        return admitted

    def _allocate(self, r: Request, pending: set[int]) -> bool:
        """Allocate `r`'s prompt blocks (cache hits first) and partial-block copies, and reserve
        its samples' decode blocks; False, holding nothing, if they do not fit or the next block
        it needs is `pending` (being computed by another request)."""
        bs, kv, req, n, k = self.block_size, self.kv, r.req, len(r.req.prompt), r.samples
        if self.prefix_cache:
            r.keys = chain_hashes(req.weights, req.prompt, bs)
        matched = [] if r.full or not self.prefix_cache else \
            kv.match(req.weights, req.prompt[:n - 1], r.keys[:(n - 1) // bs])
        if not r.full and r.keys[len(matched):len(matched) + 1] and r.keys[len(matched)] in pending:
            kv.release(matched)  # the next block is being computed now: hit it when it is done
            return False
        prompt_blocks = -(-n // bs)
        copies = max(k - 1, 0) * int(n % bs != 0)
        later = k * self.sample_reserve(r)
        if kv.num_free - self.reserved < prompt_blocks - len(matched) + copies + later:
            kv.release(matched)
            return False
        r.blocks = matched + kv.allocate(prompt_blocks - len(matched))
        r.copies = kv.allocate(copies)
        r.reserved = later
        self.reserved += later
        r.cached = r.done = len(matched) * bs
        return True
