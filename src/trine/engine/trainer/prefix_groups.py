"""Which datums of one training call share a token prefix, and the plan that computes each shared token once.

Input: every datum's tokens and its run key (datums of different runs, i.e. different adapters,
never share: their hidden states differ from the first token). Datums of one key are put in a
compressed trie ("tree"): a segment is a run of positions [start, end) whose tokens every datum
passing through it has in common; its children continue it with different next tokens. Both shapes
of post-training data land here: a GRPO group (one prompt, several completions) is a prompt segment
with one child per completion; a multi-turn chain (turn k+1's datum extends turn k's) is one
segment, each turn's datum reading a prefix of it.

Grouping rule (`plan`)
- A datum's end never splits a segment: a datum may end inside one (it reads positions [0, len)).
- A segment with >= 2 children is shared only if it holds at least `min_shared` tokens; a shorter
  one is copied into each child (sharing it would cost one more pass of the body than it saves).
  The value is measured (benchmarks/prefix_threshold.py), see `MIN_SHARED_TOKENS`.
- A tree with a single datum is not shared: it goes to the plain path with the unrelated datums.
- A tree's computed tokens stay within `budget` (the trainer's micro_batch_tokens; a single
  segment may exceed it, as one long sequence does in the plain path): a larger tree is split into
  several trees by its root's children, each recomputing the root. Trees are then packed into
  micro-batches whose padded token count (rows x longest segment, per depth) fits the budget,
  each row's context (its ancestors' positions, whose keys and values it gathers and attention
  keeps for backward) counted at `context_cost` of a token, so peak memory stays within what a
  plain micro-batch of `budget` tokens holds (the trainer derives it from the model's shapes).

Metering: each computed token is charged to the first datum (in call order) that reads it, so the
charges of a call add up to the tokens it computed (`Plan.charged`).

Invariant: pure Python on token lists (no torch); the plan depends only on the tokens, the keys,
`min_shared` and `budget`, so it is deterministic.
"""

from __future__ import annotations

from dataclasses import dataclass, field

# MIN_SHARED_TOKENS (the trainer's default, TrainerConfig.min_shared_tokens) was measured with
# benchmarks/prefix_threshold.py (docs/serving.md, "Where the engine's constants come from").
from ..config import MIN_SHARED_TOKENS


@dataclass
class Segment:
    start: int  # first position
    end: int  # one past the last position
    parent: int  # index in Tree.segments, -1 for the root
    source: int  # a datum whose tokens[start:end] are this segment's tokens
    depth: int  # number of ancestors


@dataclass
class Tree:
    """Segments in parent-before-child order; members: (datum index, index of the segment holding
    its last position). A member's positions are its path's segments, the last one cut at its length."""

    key: int
    segments: list[Segment]
    members: list[tuple[int, int]]

    @property
    def computed(self) -> int:
        return sum(s.end - s.start for s in self.segments)

    def path(self, seg: int) -> list[int]:
        """Segment indices from the root to `seg`."""
        out = []
        while seg >= 0:
            out.append(seg)
            seg = self.segments[seg].parent
        return out[::-1]


@dataclass
class Plan:
    batches: list[list[Tree]]  # shared micro-batches, each a list of trees (trees of one key adjacent)
    plain: list[int]  # datums for the plain (unshared) path, in call order
    charged: list[int]  # per datum: the computed tokens charged to it


@dataclass
class _Node:
    start: int
    end: int
    source: int
    ended: list[int]  # datums whose last position lies in [start, end)
    children: list[_Node] = field(default_factory=list)

    def cost(self) -> int:
        return self.end - self.start + sum(c.cost() for c in self.children)

    def size(self) -> int:  # datums in the subtree
        return len(self.ended) + sum(c.size() for c in self.children)


def plan(
    seqs: list[list[int]],
    keys: list[int],
    *,
    min_shared: int = MIN_SHARED_TOKENS,
    budget: int = 4096,
    context_cost: float = 0.25,
) -> Plan:
    """Group datums `seqs` (token lists, each non-empty) of run `keys[i]` into shared trees."""
    if min_shared < 1 or budget < 1:
        raise ValueError("min_shared and budget must be >= 1")
    by_key: dict[int, list[int]] = {}
    for i, k in enumerate(keys):
        by_key.setdefault(k, []).append(i)
    trees: list[Tree] = []
    plain: list[int] = []
    for key, ids in by_key.items():
        for root in _fold(_build(seqs, ids, 0), min_shared):
            for part in _fit(root, budget):
                if part.size() < 2:
                    plain.extend(_datums(part))
                else:
                    trees.append(_tree(key, part))
    charged = [len(s) for s in seqs]
    for tree in trees:
        for i, n in _charges(tree, seqs).items():
            charged[i] = n
    return Plan(_pack(trees, budget, list(by_key), context_cost), sorted(plain), charged)


# ----------------------------------------------------------------------------- the trie
def _lcp(a: list[int], b: list[int], lo: int, hi: int) -> int:
    """The first position in [lo, hi) where a and b differ (hi if none)."""
    if a[lo:hi] == b[lo:hi]:
        return hi
    while a[lo] == b[lo]:
        lo += 1
    return lo


def _build(seqs, ids: list[int], depth: int) -> _Node:
    """The compressed trie of datums `ids`, which all share seqs[i][:depth] (and are longer)."""
    first = seqs[ids[0]]
    end = min(len(seqs[i]) for i in ids)
    for i in ids[1:]:
        end = _lcp(first, seqs[i], depth, end)
    node = _Node(depth, end, ids[0], [i for i in ids if len(seqs[i]) == end])
    groups: dict[int, list[int]] = {}
    for i in ids:
        if len(seqs[i]) > end:
            groups.setdefault(seqs[i][end], []).append(i)
    node.children = [_build(seqs, g, end) for g in groups.values()]
    if len(node.children) == 1:  # a datum's end does not split a segment: merge into the child
        child = node.children[0]
        child.start, child.ended = node.start, node.ended + child.ended
        return child
    return node


def _fold(node: _Node, min_shared: int) -> list[_Node]:
    """Copy each branching segment shorter than `min_shared` into its children; returns the nodes
    that replace `node`."""
    if len(node.children) >= 2 and node.end - node.start < min_shared:
        out = []
        for k, child in enumerate(node.children):
            child.start = node.start
            if k == 0:  # datums ending in the copied segment read a prefix of any child
                child.ended = node.ended + child.ended
            out += _fold(child, min_shared)
        return out
    node.children = [n for c in node.children for n in _fold(c, min_shared)]
    return [node]


def _fit(root: _Node, budget: int) -> list[_Node]:
    """Split a tree computing more than `budget` tokens by its root's children (each part recomputes
    the root); a single segment of any length is one part."""
    if root.cost() <= budget or not root.children:
        return [root]
    length = root.end - root.start
    nodes, group, cost = [], [], length
    for child in root.children:
        c = child.cost()
        if length + c > budget:  # this child with the root is already too big: go down
            nodes += _fit(_Node(root.start, child.end, child.source, child.ended, child.children), budget)
            continue
        if group and cost + c > budget:
            nodes.append(_join(root, group))
            group, cost = [], length
        group.append(child)
        cost += c
    if group:
        nodes.append(_join(root, group))
    nodes[0].ended = root.ended + nodes[0].ended  # they read a prefix of any part
    return nodes


def _join(root: _Node, children: list[_Node]) -> _Node:
    if len(children) == 1:
        child = children[0]
        return _Node(root.start, child.end, child.source, child.ended, child.children)
    return _Node(root.start, root.end, root.source, [], children)


def _datums(node: _Node) -> list[int]:
    return node.ended + [i for c in node.children for i in _datums(c)]


def _tree(key: int, root: _Node) -> Tree:
    segments: list[Segment] = []
    members: list[tuple[int, int]] = []
    stack = [(root, -1, 0)]
    while stack:
        node, parent, depth = stack.pop()
        index = len(segments)
        segments.append(Segment(node.start, node.end, parent, node.source, depth))
        members += [(i, index) for i in node.ended]
        stack += [(c, index, depth + 1) for c in reversed(node.children)]
    members.sort()
    return Tree(key, segments, members)


def _charges(tree: Tree, seqs) -> dict[int, int]:
    """Each computed token is charged to the first member (by datum index) that reads it."""
    readers: dict[int, list[int]] = {}
    for i, seg in tree.members:
        for s in tree.path(seg):
            readers.setdefault(s, []).append(i)
    out = {i: 0 for i, _ in tree.members}
    for s, users in readers.items():
        seg = tree.segments[s]
        covered = seg.start
        for i in sorted(users):
            reach = min(seg.end, len(seqs[i]))
            if reach > covered:
                out[i] += reach - covered
                covered = reach
    return out


# ----------------------------------------------------------------------------- micro-batches
def padded_tokens(trees: list[Tree], context_cost: float = 0.0) -> float:
    """Rows x longest segment, summed over depths: what one micro-batch of these trees computes;
    plus rows x longest context x `context_cost`: the keys and values its rows gather."""
    rows: dict[int, int] = {}
    longest: dict[int, int] = {}
    context: dict[int, int] = {}
    for tree in trees:
        for s in tree.segments:
            rows[s.depth] = rows.get(s.depth, 0) + 1
            longest[s.depth] = max(longest.get(s.depth, 0), s.end - s.start)
            context[s.depth] = max(context.get(s.depth, 0), s.start)
    return sum(rows[d] * (longest[d] + context_cost * context[d]) for d in rows)


def _pack(trees: list[Tree], budget: int, key_order: list[int], context_cost: float) -> list[list[Tree]]:
    """Largest trees first, each into the first micro-batch it fits (a tree alone always fits);
    within a micro-batch, trees of one key are adjacent (LoRA runs on row spans)."""
    batches: list[list[Tree]] = []
    for tree in sorted(trees, key=lambda t: -t.computed):
        for mb in batches:
            if padded_tokens(mb + [tree], context_cost) <= budget:
                mb.append(tree)
                break
        else:
            batches.append([tree])
    rank = {k: r for r, k in enumerate(key_order)}
    return [sorted(mb, key=lambda t: rank[t.key]) for mb in batches]
