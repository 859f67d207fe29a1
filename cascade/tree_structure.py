"""Token-tree shapes: pure buffer functions for one tree-attention forward. No models, no records.

Node convention. A draft of n nodes hangs below the root, the last committed token (the one the
target has not yet processed). Node i has a token and ``parents[i]`` (-1: a child of the root);
parents come before children (``parents[i] < i``). A chain is the tree whose parents are
``[-1, 0, 1, ...]`` (:func:`chain_parents`). The verification forward feeds ``[root] + tokens``
(n + 1 inputs) on top of a cache holding the P committed positions before the root; input 0 is
the root, input i + 1 is node i:

    positions  P + depth            (root depth 0, node depth = parent depth + 1)
    mask       input j attends to the P cached positions, to itself and to its ancestors

and the target's logits at input j are its next-token distribution after the path to j. For a
chain that mask is the ordinary causal mask, so :func:`tree_inputs` returns no mask for it.
"""

from __future__ import annotations

import torch


def chain_parents(n: int) -> list[int]:
    """Parents of a chain of n nodes: [-1, 0, 1, ..., n - 2]."""
    return list(range(-1, n - 1))


def is_chain(parents: list[int]) -> bool:
    return all(p == i - 1 for i, p in enumerate(parents))


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


def level_inputs(parents: list[int], past: int, width: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """Positions [width] and 4D mask [1, 1, width, past + 1 + n] for the last ``width`` nodes of
    the tree ``parents`` (n nodes), fed on top of a cache that holds the ``past`` positions
    before the root, the root, and the first n - width nodes (a drafter growing a tree level by
    level). The rows of :func:`tree_positions` / :func:`tree_mask`: one mask builder for the
    target's verification and the drafters' level forwards."""
    if not 1 <= width <= len(parents):
        raise ValueError(f"width must lie in [1, {len(parents)}], got {width}")
    return tree_positions(parents, past)[-width:], tree_mask(parents, past, dtype)[:, :, -width:, :]


def tree_inputs(parents: list[int], past: int, dtype: torch.dtype) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """Position ids [n + 1] and 4D mask for a forward over [root] + nodes; (None, None) for a chain,
    whose positions and mask are the model's defaults (contiguous, causal)."""
    if is_chain(parents):
        return None, None
    return tree_positions(parents, past), tree_mask(parents, past, dtype)
