"""EAGLE-2's dynamic draft tree: instead of one chain of K guesses, the drafter expands its `topk` most
likely continuations at each of `depth` levels, and the `total` nodes with the highest path
probability go to the target in one verification (a tree attention mask lets every node see only its
ancestors). More candidates per position raise τ for the same number of verified tokens when the
drafter's second guess is often right (docs/PERFORMANCE.md has chain vs tree on the demo drafter).

Node i has a token (target vocab), a parent (-1: a child of the root, the newest accepted token),
a depth (1 for the root's children: target position m + depth) and a score (the sum of the drafter's
log-probabilities along its path). Parents always come before their children in node order.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from core.drafters.drafter import DraftCache, Eagle3Drafter
from core.run.errors import UserError


@dataclass
class TreeSpec:
    depth: int  # levels below the root
    topk: int  # children per expanded node, and nodes expanded per level
    total: int  # nodes verified (root excluded): the drafted tokens per verification

    def __post_init__(self):
        if min(self.depth, self.topk, self.total) < 1:
            raise UserError(f"draft tree depth/topk/total = {self.depth}/{self.topk}/{self.total}: all must be >= 1")
        grown = self.topk + (self.depth - 1) * self.topk**2  # nodes draft_tree creates
        if self.total > grown:  # else fewer tokens are verified than the report says
            raise UserError(f"draft tree total = {self.total}: a tree of depth {self.depth} and top-{self.topk} "
                             f"has at most {grown} nodes")


@dataclass
class DraftTree:
    tokens: list[int] = field(default_factory=list)
    parents: list[int] = field(default_factory=list)
    depths: list[int] = field(default_factory=list)
    scores: list[float] = field(default_factory=list)

    def add(self, token: int, parent: int, score: float) -> None:
        self.tokens.append(token)
        self.parents.append(parent)
        self.depths.append(1 if parent < 0 else self.depths[parent] + 1)
        self.scores.append(score)

    def path(self, i: int) -> list[int]:
        """Node i's ancestors and itself, root side first."""
        out = []
        while i >= 0:
            out.append(i)
            i = self.parents[i]
        return out[::-1]

    def top(self, n: int) -> DraftTree:
        """The n best nodes by score, renumbered in node order. A child never scores above its parent
        (log-probs <= 0) and ties go to the earlier node, so the kept set holds every kept node's parent."""
        keep = sorted(sorted(range(len(self.tokens)), key=lambda i: (-self.scores[i], i))[:n])
        new = {old: j for j, old in enumerate(keep)}
        out = DraftTree()
        for old in keep:
            out.add(self.tokens[old], new[self.parents[old]] if self.parents[old] >= 0 else -1, self.scores[old])
        return out

    def visible(self) -> torch.Tensor:
        """[N, N] bool: row i sees node j iff j is i or one of i's ancestors."""
        n = len(self.tokens)
        mask = torch.zeros(n, n, dtype=torch.bool)
        for i in range(n):
            mask[i, self.path(i)] = True
        return mask


def draft_tree(drafter: Eagle3Drafter, logits: torch.Tensor, hidden: torch.Tensor, m: int, spec: TreeSpec,
               cache: DraftCache) -> DraftTree:
    """Grow the tree from the drafter's output at position m-1 (logits [1,Vd], hidden [1,1,H]); a node at
    depth d is fed back at drafter position m+d-1, as chain draft d is (core.engine.speculative.draft_chain).
    Returns the `spec.total` best nodes. The cache holds the expanded nodes afterwards: roll it back."""
    device = hidden.device
    tree = DraftTree()
    base = cache.length
    slots: dict[int, int] = {}  # expanded node -> its draft-cache slot
    logp = torch.log_softmax(logits[0].float(), -1)
    values, ids = logp.topk(min(spec.topk, logp.numel()))
    for v, t in zip(values.tolist(), drafter.draft_to_target(ids).tolist(), strict=True):
        tree.add(t, -1, v)
    frontier, frontier_hidden = list(range(len(tree.tokens))), hidden.expand(1, len(tree.tokens), -1)
    for depth in range(1, spec.depth):
        start = cache.length
        visible = torch.zeros(len(frontier), cache.max_len, dtype=torch.bool, device=device)
        visible[:, :base] = True
        for row, node in enumerate(frontier):
            slots[node] = start + row
            visible[row, [slots[a] for a in tree.path(node)]] = True
        step_logits, h = drafter(frontier_hidden, torch.tensor([[tree.tokens[i] for i in frontier]], device=device),
                                 torch.full((1, len(frontier)), m + depth - 1, device=device), cache, visible)
        logp = torch.log_softmax(step_logits[0].float(), -1)
        values, ids = logp.topk(min(spec.topk, logp.shape[-1]), dim=-1)
        scores = (values + torch.tensor([tree.scores[i] for i in frontier], device=device)[:, None]).tolist()
        targets = drafter.draft_to_target(ids).tolist()
        children = []
        for row, node in enumerate(frontier):
            for v, t in zip(scores[row], targets[row], strict=True):
                children.append((v, len(tree.tokens), row))
                tree.add(t, node, v)
        best = sorted(children, key=lambda c: (-c[0], c[1]))[: spec.topk]
        frontier = [c[1] for c in best]
        frontier_hidden = h[:, [c[2] for c in best]]
    return tree.top(spec.total)
