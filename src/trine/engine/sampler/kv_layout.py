"""Where the sampler's tokens live in the paged KV pool: block tables -> pool slots, the attention
context (`KVContext`) of a prefill chunk and of a decode step, forking a prompt's blocks for its
samples, and keying computed blocks in the prefix cache.

Invariants
- Slot of position p of a sequence = blocks[p // block_size] * block_size + p % block_size.
- A prompt's samples share its full blocks by reference; each gets its own copy of the partial last
  block (sample 0 keeps the original). A decode step attends the samples of one request as one
  packed row (`KVContext.query_index`): the prompt KV they share is gathered once per step, not
  once per sample; every query's keys stay tile aligned in position order (invariant.py).
- Only blocks whose KV is computed are keyed: full ones as they fill, a sequence's partial last
  block (a tail) when it stops, a prompt's when a request without samples is done. A block's key
  chains its parent's key (the `WeightsIdentity` for block 0), so KV is only ever served to the
  same weights and tokens. Keys are of `Request.key` and a sequence's `tokens`, where an image's
  positions are its content hash and offset, not placeholder ids. Blocks a `mixed` request (an
  inflight one whose weights changed under it) computes are never keyed.
"""

from __future__ import annotations

import torch

from ..model.attention import KVContext
from ..model.invariant import KEY_TILE
from .kv_cache import BlockManager, block_key
from .sequence import Request, Sequence


class KVLayout:
    def __init__(self, kv: BlockManager, prefix_cache: bool = True, key_prompt_tail: bool = False):
        self.kv = kv
        self.block_size = kv.block_size
        self.device = kv.k.device
        self.prefix_cache = prefix_cache
        self.key_prompt_tail = key_prompt_tail  # a hybrid model's: see `cache_prompt`
        self._arange = torch.arange(self.block_size, device=self.device)

    def slots(self, block_lists: list[list[int]], length: int) -> torch.Tensor:
        """[B, length] pool slots of positions 0..length-1 of each row's blocks (padding: slot 0)."""
        return self.slots_at(
            block_lists, torch.arange(length, device=self.device).expand(len(block_lists), length)
        )

    def slots_at(self, block_lists: list[list[int]], positions: torch.Tensor) -> torch.Tensor:
        """[B, n] pool slots of `positions` [B, n] of each row's blocks (past its blocks: in block 0)."""
        width = max(max(len(b) for b in block_lists), 1)
        table = torch.tensor(
            [b + [0] * (width - len(b)) for b in block_lists], dtype=torch.long, device=self.device
        ).view(len(block_lists), width)
        blocks = table.gather(1, (positions // self.block_size).clamp(max=width - 1))
        return blocks * self.block_size + positions % self.block_size

    # ------------------------------------------------------------------ attention contexts
    def prefill(self, rows: list[tuple[Request, int]]) -> tuple[torch.Tensor, torch.Tensor, KVContext]:
        """Tokens and positions [B, T] of the next `take` prompt tokens of each row's request (right
        padded) and their context: each attends its prompt up to itself, cached part included."""
        dev = self.device
        starts = [r.prefilled for r, _ in rows]
        ends = [r.prefilled + take for r, take in rows]
        T, L = max(take for _, take in rows), max(ends)
        tokens = torch.zeros(len(rows), T, dtype=torch.long)
        for i, (r, _) in enumerate(rows):
            tokens[i, : ends[i] - starts[i]] = torch.tensor(r.prompt[starts[i] : ends[i]])
        start = torch.tensor(starts)[:, None]
        positions = (start + torch.arange(T)[None]).to(dev)  # padded queries: past the end
        read = self.slots([r.blocks for r, _ in rows], L)
        real = torch.arange(T)[None] < (torch.tensor(ends)[:, None] - start)
        write = torch.where(real.to(dev), read.gather(1, positions.clamp(max=L - 1)), -1)
        mask = (torch.arange(L, device=dev)[None, None] <= positions[:, :, None])[:, None]
        return tokens.to(dev), positions, KVContext(self.kv.k_pool, self.kv.v_pool, write, read, mask)

    def decode(self, seqs: list[Sequence]) -> tuple[torch.Tensor, torch.Tensor, KVContext]:
        """Tokens and positions [B, 1] of each sequence's last token and their context (packed by
        request when a request has several sequences)."""
        dev = self.device
        lens = [len(s.tokens) for s in seqs]
        pos = torch.tensor(lens, device=dev)[:, None] - 1
        groups: dict[int, list[int]] = {}
        for i, s in enumerate(seqs):
            groups.setdefault(id(s.request), []).append(i)
        if max(len(g) for g in groups.values()) == 1:
            read = self.slots([s.blocks for s in seqs], max(lens))
            write, packed = read.gather(1, pos), None
            mask = (torch.arange(read.shape[1], device=dev)[None] <= pos)[:, None, None]
        else:
            write, read, mask, packed = self._packed(seqs, lens, list(groups.values()))
        tokens = torch.tensor([[s.tokens[-1]] for s in seqs], device=dev)
        return tokens, pos, KVContext(self.kv.k_pool, self.kv.v_pool, write, read, mask, packed)

    def _packed(self, seqs: list[Sequence], lens: list[int], groups: list[list[int]]):
        """Decode attention packed by request: one row per request holds the keys its samples share
        once, then each sample's own keys; sample t's query sees the shared keys and its own. The
        shared part is the prompt's full blocks cut down to whole key tiles, and each sample's part
        starts on a tile boundary, so every query's keys sit tile aligned in position order (the
        layout invariant.attention needs). Returns write [B, 1], read [P, L], mask [P, 1, Q, L],
        query_index [P, Q]."""
        dev, kt = self.device, KEY_TILE
        P, Q = len(groups), max(len(g) for g in groups)
        shared = [seqs[g[0]].request.shared * self.block_size // kt * kt for g in groups]  # positions
        order = [i for g in groups for i in g]
        own_from = torch.tensor([shared[p] for p, g in enumerate(groups) for _ in g], device=dev)
        own_len = torch.tensor([lens[i] for i in order], device=dev) - own_from
        S = -(-int(own_len.max()) // kt) * kt
        own_slots = self.slots_at(
            [seqs[i].blocks for i in order], own_from[:, None] + torch.arange(S, device=dev)
        )
        rows = torch.full((P, Q), -1, dtype=torch.long)  # packed query -> index into `order`
        start = 0
        for p, g in enumerate(groups):
            rows[p, : len(g)] = torch.arange(start, start + len(g))
            start += len(g)
        rows = rows.to(dev)
        k = rows.clamp(min=0)  # padding queries borrow a real sequence's keys: never all-masked
        pre_len = max(shared)
        pre = self.slots([seqs[g[0]].blocks for g in groups], pre_len)
        read = torch.cat([pre, own_slots[k].view(P, Q * S)], 1)
        pre_mask = torch.arange(pre_len, device=dev)[None] < torch.tensor(shared, device=dev)[:, None]
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

    # ------------------------------------------------------------------ forking and caching
    def fork(self, r: Request) -> list[list[int]]:
        """The block tables of `r`'s samples once its prompt is prefilled: sample 0 takes the prompt
        blocks, the others share the full ones and get a copy of the partial last block."""
        bs, n = self.block_size, len(r.prompt)
        full, partial = n // bs, n % bs
        tables = [list(r.blocks)]
        for j in range(1, r.samples):
            self.kv.incref(r.blocks[:full])
            own = []
            if partial:
                self.kv.copy_tokens(r.blocks[full], [r.copies[j - 1]], partial)
                own = [r.copies[j - 1]]
            tables.append(r.blocks[:full] + own)
        r.shared = full
        return tables

    def cache_prompt(self, r: Request, start: int, end: int) -> range:
        """Key the prompt blocks that prompt tokens start..end completed; returns their indexes
        (none when nothing is keyed: no prefix cache, or a `mixed` request). With
        `key_prompt_tail` (a hybrid model: its snapshot after len(prompt) - 1 tokens lives there),
        the prompt's partial last block is keyed as a tail as soon as the prompt is done; its first
        sample goes on filling the slots after it, and the key grows with them (kv_cache.py)."""
        if not self.prefix_cache or r.mixed:
            return range(0)
        bs, w = self.block_size, r.weights
        completed = range(start // bs, end // bs)
        for b in completed:
            self.kv.register(
                r.blocks[b], r.keys[b], r.keys[b - 1] if b else w, w, r.key[b * bs : (b + 1) * bs]
            )
        if self.key_prompt_tail and end == len(r.prompt):
            self.cache_tail(r, r.blocks, r.keys, r.key)
        return completed

    def cache_tail(self, r: Request, blocks: list[int], keys: list[int], tokens: list[int]) -> None:
        """Key the partial last block of a chain that stops growing: `blocks` hold the KV of
        `tokens` (a stopped sequence's tokens but its last; a finished prompt), `keys` the keys of
        its full blocks."""
        full, partial = divmod(len(tokens), self.block_size)
        if not self.prefix_cache or r.mixed or not partial or len(keys) < full or len(blocks) <= full:
            return
        w, rest = r.weights, tokens[full * self.block_size :]
        self.kv.register_tail(blocks[full], keys[full - 1] if full else w, w, rest)

    def cache_decoded(self, seqs: list[Sequence]) -> None:
        """Key each sequence's block that this decode step's input token (its last) filled."""
        if not self.prefix_cache:
            return
        bs = self.block_size
        for s in seqs:
            if len(s.tokens) % bs == 0 and not s.request.mixed:
                b = len(s.tokens) // bs - 1
                w = s.request.weights
                parent = s.keys[b - 1] if b else w
                toks = s.tokens[b * bs :]
                s.keys.append(block_key(parent, toks))
                self.kv.register(s.blocks[b], s.keys[-1], parent, w, toks)
