"""Token trees: buffers for one tree-attention forward, lossless tree acceptance, cache compaction.

Node convention. A tree of n drafted nodes hangs below the root, the last committed token (the
one the target has not yet processed). Node i has ``tokens[i]`` and ``parents[i]`` (-1: a
child of the root); parents come before children (``parents[i] < i``). The verification forward
feeds ``[root] + tokens`` (n + 1 inputs) on top of a cache holding the P committed positions
before the root; input 0 is the root, input i + 1 is node i:

    positions  P + depth            (root depth 0, node depth = parent depth + 1)
    mask       input j attends to the P cached positions, to itself and to its ancestors

and the target's logits at input j are its next-token distribution after the path to j.

Acceptance (``verify_tree_greedy`` / ``verify_tree_sampled``) walks down from the root. Greedy:
follow the child equal to the target's argmax. Sampled: recursive rejection over the children
of the current node in order: child x drawn from q_i is accepted with probability
min(1, p(x) / q_i(x)); on rejection p <- norm(max(0, p - q_i)) and the next child is tried; a
deterministic child (top-k rank, n-gram) has a one-hot q_i. Children may come from different
drafters; each sampled child must be an independent draw from its q_i. When no child is
accepted, the next token is drawn from the current (residual) p; below a leaf it is the bonus
token drawn from p at the leaf.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from cascade.types import VerifyResult

ACCEPTED, REJECTED, UNJUDGED = 1, 0, -1


# ---- pure buffer functions --------------------------------------------------------------------
def depths_of(parents: list[int]) -> list[int]:
    """Depth of every node (children of the root have depth 1)."""
    depths: list[int] = []
    for i, p in enumerate(parents):
        if not -1 <= p < i:
            raise ValueError(f"node {i} has parent {p}: parents must precede their children (-1 = root)")
        depths.append(1 if p < 0 else depths[p] + 1)
    return depths


def children_of(parents: list[int]) -> list[list[int]]:
    """children[j] for j = 0 (root) .. n (node j - 1), in insertion order."""
    kids: list[list[int]] = [[] for _ in range(len(parents) + 1)]
    for i, p in enumerate(parents):
        kids[p + 1].append(i)
    return kids


def path_to(node: int, parents: list[int]) -> list[int]:
    """Node indices from the first level down to ``node`` (inclusive); [] for the root (-1)."""
    path = []
    while node >= 0:
        path.append(node)
        node = parents[node]
    return path[::-1]


def tree_positions(parents: list[int], past: int) -> torch.Tensor:
    """[n + 1] position ids of [root] + nodes."""
    return torch.tensor([past] + [past + d for d in depths_of(parents)], dtype=torch.long)


def tree_mask(parents: list[int], past: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """[1, 1, n + 1, past + n + 1] additive mask (0 = attend, -inf = not) for [root] + nodes."""
    n = len(parents) + 1
    allowed = torch.zeros(n, n, dtype=torch.bool)  # input j may attend to input i
    allowed[:, 0] = True  # everyone sees the root
    for i, p in enumerate(parents):
        j = i + 1
        allowed[j] = allowed[p + 1]
        allowed[j, j] = True
    allowed[0, 1:] = False
    full = torch.cat([torch.ones(n, past, dtype=torch.bool), allowed], dim=1)  # [n, past + n]
    mask = torch.zeros(n, past + n, dtype=dtype)
    mask.masked_fill_(~full, torch.finfo(dtype).min)
    return mask[None, None]


# ---- acceptance ---------------------------------------------------------------------------------
@dataclass
class TreeVerifyResult(VerifyResult):
    path: list[int] = field(default_factory=list)  # accepted node indices, root's child first
    judgements: list[int] = field(default_factory=list)  # per node: ACCEPTED, REJECTED or UNJUDGED
    verify_time_s: float | None = None  # set by the decode loop: the tree forward's time


def verify_tree_greedy(tokens: list[int], parents: list[int], argmax: torch.Tensor) -> TreeVerifyResult:
    """argmax: [n + 1] the target's argmax at [root] + nodes."""
    kids = children_of(parents)
    judgements = [UNJUDGED] * len(tokens)
    path, j = [], 0  # j: input index of the current node (0 = root)
    while True:
        want = int(argmax[j])
        nxt = None
        for c in kids[j]:
            if nxt is None and tokens[c] == want:
                judgements[c] = ACCEPTED
                nxt = c
            else:
                judgements[c] = REJECTED  # greedy judges every child of a reached node
        if nxt is None:
            return TreeVerifyResult(len(path), want, not kids[j], path, judgements)
        path.append(nxt)
        j = nxt + 1


def _uniform(generator: torch.Generator | None) -> float:
    device = generator.device if generator is not None else "cpu"
    return float(torch.rand((), generator=generator, dtype=torch.float64, device=device))


def verify_tree_sampled(
    tokens: list[int],
    parents: list[int],
    q: list[torch.Tensor | None],  # per node: the distribution it was drawn from [V], or None (deterministic)
    p: torch.Tensor,  # [n + 1, V] the target's processed distributions at [root] + nodes
    generator: torch.Generator | None,
) -> TreeVerifyResult:
    kids = children_of(parents)
    judgements = [UNJUDGED] * len(tokens)
    path, j = [], 0
    while True:
        residual = p[j]
        nxt = None
        for c in kids[j]:
            x = tokens[c]
            qc = q[c]
            qx = 1.0 if qc is None else float(qc[x])
            px = float(residual[x])
            u = _uniform(generator)
            if qx > 0 and u * qx < px:  # accept with probability min(1, px / qx)
                judgements[c] = ACCEPTED
                nxt = c
                break
            judgements[c] = REJECTED
            one_hot = torch.zeros_like(residual)
            one_hot[x] = 1.0
            qfull = one_hot if qc is None else qc.to(residual.dtype)
            residual = torch.clamp(residual - qfull, min=0.0)
            total = residual.sum()
            if total <= 0:  # p was within q's support everywhere: cannot happen for a true rejection
                residual = p[j]
            else:
                residual = residual / total
        if nxt is None:
            token = int(torch.multinomial(residual, 1, generator=generator))
            return TreeVerifyResult(len(path), token, not kids[j], path, judgements)
        path.append(nxt)
        j = nxt + 1


# ---- cache compaction ---------------------------------------------------------------------------
def compact_cache(cache, past: int, keep: list[int]) -> None:
    """After a tree forward, keep the ``past`` committed positions plus the tree inputs ``keep``
    (indices into [root] + nodes, in order) in every layer; drop the rest."""
    idx = None
    for layer in cache.layers:
        if not getattr(layer, "is_initialized", True) or layer.keys is None or layer.keys.numel() == 0:
            continue
        if idx is None or idx.device != layer.keys.device:
            idx = torch.tensor(list(range(past)) + [past + k for k in keep], device=layer.keys.device)
        layer.keys = layer.keys.index_select(-2, idx)
        layer.values = layer.values.index_select(-2, idx)
