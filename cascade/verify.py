"""Lossless verification: the one place where drafts are judged and the target's cache committed.

Notation (used throughout the framework)
----------------------------------------
``p``
    target distribution at a position, after the run's temperature / top-k / top-p.
``q``
    the distribution a draft token was *actually sampled from*, after the same processing;
    ``None`` for a deterministic drafter (argmax, n-gram), which the verifier treats as one-hot.
``k`` (``γ``)
    draft length: tokens proposed in one round.
``α``
    acceptance rate, P(draft token accepted); per drafter, per depth.
``c``
    cost ratio: drafter step time / target step time, measured.
``τ``
    tokens emitted per target forward (accepted + one recovered-or-bonus token).
accepted / recovered / bonus
    draft tokens kept / the token resampled from ``norm(max(0, p - q))`` at the first rejection /
    the extra token drawn from ``p`` after the last accepted draft token when it is a leaf (for a
    chain of ``k``: ``p[k]``, 0-based, when all ``k`` are kept).

Every draft is a token tree (``cascade.tree``); a chain is the tree with parents ``[-1, 0, 1,
...]``, so one rule serves chains, trees and the inner rounds of a vertical cascade.

Greedy (:func:`accept_greedy`): walk down from the root, following the child equal to the
target's argmax; the token after the last accepted node is the target's argmax there. The output
equals greedy decoding token for token.

Sampled (:func:`accept_sampled`, Leviathan et al. 2023 / Chen et al. 2023, recursive rejection
for trees as in SpecInfer): at the current node, try its children in order; child ``x`` drawn
from ``q_i`` is accepted with probability ``min(1, p(x) / q_i(x))``; on rejection
``p <- norm(max(0, p - q_i))`` and the next child is tried. A deterministic child has a one-hot
``q_i`` (on rejection ``p(x)`` is zeroed). When no child is accepted the next token is drawn from
the current (residual) ``p``; below a leaf it is the bonus token drawn from ``p`` at the leaf.
Each sampled child must be an independent draw from its ``q_i``. The emitted tokens are then
distributed exactly as the target's.

:class:`Verifier` bundles the two rules; ``cascade.generate(..., verifier=...)`` and
``VerticalCascade(..., verifier=...)`` take one, which is how the tests run deliberately broken
rules through the real loop; ``Verifier.forward`` is the verification forward. :func:`commit`
keeps the accepted path in the target's cache.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from cascade.models.lm import CausalLM
from cascade.sampling import logits_to_probs, sample
from cascade.tree import children_of, tree_inputs
from cascade.types import ACCEPTED, REJECTED, UNJUDGED, DraftBlock, SamplingConfig, VerifyResult


def residual_distribution(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """``norm(max(0, p - q))``. p, q: [V] probabilities -> [V].

    The residual is zero only when p <= q everywhere, and then a rejection has probability zero;
    the fallback to ``p`` only guards against round-off.
    """
    residual = torch.clamp(p - q, min=0.0)
    total = residual.sum()
    if total <= 0:
        return p
    return residual / total


def accept_greedy(tokens: list[int], parents: list[int], argmax: torch.Tensor) -> VerifyResult:
    """tokens, parents: [n]. argmax: [n + 1] the target's argmax at [root] + nodes."""
    if argmax.shape[0] != len(tokens) + 1:
        raise ValueError(f"argmax must have n+1={len(tokens) + 1} entries, got {argmax.shape[0]}")
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
            return VerifyResult(len(path), want, not kids[j], path, judgements)
        path.append(nxt)
        j = nxt + 1


def _uniform(generator: torch.Generator | None) -> float:
    device = generator.device if generator is not None else "cpu"
    return float(torch.rand((), generator=generator, dtype=torch.float64, device=device))


def _one_hot(token: int, like: torch.Tensor) -> torch.Tensor:
    row = torch.zeros_like(like)
    row[token] = 1.0
    return row


def accept_sampled(
    tokens: list[int],  # [n]
    parents: list[int],  # [n]
    q: torch.Tensor | None,  # [n, V] the distribution each node was drawn from, or None (all deterministic)
    p: torch.Tensor,  # [n + 1, V] the target's processed distributions at [root] + nodes
    generator: torch.Generator | None,
) -> VerifyResult:
    """Recursive rejection sampling over the tree (see the module docstring)."""
    if p.shape[0] != len(tokens) + 1:
        raise ValueError(f"p must have n+1={len(tokens) + 1} rows, got {p.shape[0]}")
    kids = children_of(parents)
    judgements = [UNJUDGED] * len(tokens)
    path, j = [], 0
    while True:
        residual = p[j]  # [V]
        nxt = None
        for c in kids[j]:
            x = tokens[c]
            qx = 1.0 if q is None else float(q[c, x])
            if qx > 0 and _uniform(generator) * qx < float(residual[x]):  # accept w.p. min(1, p(x)/q(x))
                judgements[c] = ACCEPTED
                nxt = c
                break
            judgements[c] = REJECTED
            q_row = _one_hot(x, residual) if q is None else q[c].to(residual.dtype)
            residual = residual_distribution(residual, q_row)
        if nxt is None:
            return VerifyResult(len(path), int(sample(residual, generator)), not kids[j], path, judgements)
        path.append(nxt)
        j = nxt + 1


@dataclass(frozen=True)
class Verifier:
    """How a draft is shown to the target and judged: ``inputs(parents, past, dtype)`` (tree
    positions and mask, ``cascade.tree.tree_inputs``), and the acceptance rules
    ``greedy(tokens, parents, argmax)`` and ``sampled(tokens, parents, q, p, generator)``.
    Replace one to study (or test) another rule."""

    greedy: Callable[..., VerifyResult] = accept_greedy
    sampled: Callable[..., VerifyResult] = accept_sampled
    inputs: Callable[..., tuple] = tree_inputs

    def forward(self, target: CausalLM, cache, last: int, block: DraftBlock, return_hidden: int | None = None):
        """One target forward over ``[last] + block.tokens`` on top of ``cache`` (which holds the
        committed prefix before ``last``), with tree positions and mask when the block is a tree.
        Returns logits [n + 1, V], or (logits, hidden [n + 1, H]) with ``return_hidden``."""
        past = target.cache_len(cache)
        positions, mask = self.inputs(block.parents, past, target.dtype)
        return target.forward([last] + block.tokens.tolist(), cache, position_ids=positions,
                              attention_mask=None if mask is None else mask.to(target.device), return_hidden=return_hidden)

    def accept(self, block: DraftBlock, logits: torch.Tensor, sampling: SamplingConfig,
               generator: torch.Generator | None) -> VerifyResult:
        """Judge ``block`` against ``logits`` [n + 1, V] (the verifying model's logits at [root] + nodes).

        ``sampling.greedy`` selects the greedy rule; otherwise the logits are processed with
        ``sampling`` into ``p`` and the sampled rule runs."""
        tokens = block.tokens.tolist()
        if sampling.greedy:
            return self.greedy(tokens, block.parents, logits.argmax(-1))
        p = logits_to_probs(logits, sampling)  # [n + 1, V]
        q = None if block.q is None else block.q.to(p.device)
        return self.sampled(tokens, block.parents, q, p, generator)


EXACT = Verifier()


def committed_inputs(result: VerifyResult) -> list[int]:
    """Indices into [root] + nodes of the inputs the cache keeps: the root and the accepted path."""
    return [0] + [i + 1 for i in result.path]


def commit(target: CausalLM, cache, past: int, result: VerifyResult) -> list[int]:
    """After a verification forward, keep the ``past`` committed positions plus the root and the
    accepted path in ``cache`` (compacted in place; a chain's is a crop). Returns the kept input
    indices (to select, e.g., hidden states of the committed positions)."""
    keep = committed_inputs(result)
    target.compact(cache, past, keep)
    return keep
