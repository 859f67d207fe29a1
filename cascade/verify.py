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

Every draft is a token tree (``cascade.tree_structure``); a chain is the tree with parents ``[-1, 0, 1,
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

Block (:func:`accept_block`, Sun et al., "Block Verification Accelerates Speculative Decoding",
ICLR 2025) judges a chain jointly instead of token by token. With ``p_j``, ``q_j`` the target's and
the drafter's distributions at input j (0 = root; ``q_j`` drew node j, i.e. input j + 1) and
``x_{j+1}`` the drafted token there, a *weight* is carried down the chain,

    w_0 = 1,    w_{j+1} = min(1, w_j p_j(x_{j+1}) / q_j(x_{j+1})),

and every input j gets a *stop probability* ``h_j`` and a *law* ``r_j`` of the token after it:

    h_k = w_k,  r_k = p_k                                         (the leaf: the bonus token)
    s_j = sum_x max(0, w_j p_j(x) - q_j(x)),
    h_j = s_j / (s_j + 1 - w_j),  r_j = norm(max(0, w_j p_j - q_j))   (j < k; h_0 = 1).

The kept length is the *largest* j with ``η_j <= h_j`` for independent uniforms ``η_j`` (a backward
pass from the leaf: j = k, k - 1, ..., 0, stopping at the first success), and the next token is
drawn from ``r_j``. For k = 1 this is the token-wise rule; for k > 1 it keeps at least as many
tokens in expectation, and the most of any valid rule for one draft (the paper's Theorem 2).

Traversal (:func:`accept_traversal`, Weng et al., "Traversal Verification for Speculative Tree
Decoding", 2025) is its tree form, visiting the nodes leaves first. Every node u carries a weight
and a law ``(w_u, r_u)``; below the root ``(1, p_root)``; a child c of u drawn from ``q_c`` starts
with ``(min(1, w_u r_u(x_c) / q_c(x_c)), p_c)``. Children are visited depth first in order; when
c's whole subtree is rejected, u's pair is updated as the chain's ``h`` / ``r`` above:

    (w_u, r_u) <- (s / (s + 1 - w_u), norm(max(0, w_u r_u - q_c))),   s = sum_x max(0, w_u r_u(x) - q_c(x)),

and after its last child u itself is tested: it stops the traversal with probability ``w_u``
(the path to u is accepted and the next token drawn from ``r_u``), else it is rejected in turn.
The tests run in post-order and the first success ends them; the root always succeeds. On a
chain the pairs are exactly block's ``(h_j, r_j)`` and the uniforms are drawn in the same order
(leaf first), so the two rules give the same result from the same generator. Sampled siblings
must, as for recursive rejection, each be an independent draw from its own ``q``.

Both rules use the same drafts, the same ``p`` and ``q`` and no extra target work; under greedy
decoding every rule is :func:`accept_greedy`. :func:`expected_accepted` gives each rule's exact
expected accepted length for one draft (what the tests and ``experiments/verify_rules.py``
compare).

:class:`Verifier` bundles a greedy and a sampled rule; :func:`verifier_named` gives the one a
config names (``verify=token|block|traversal``); ``cascade.generate(..., verifier=...)`` and
``VerticalCascade(..., verifier=...)`` take one, which is how the tests run deliberately broken
rules through the real loop; ``Verifier.forward`` is the verification forward and
``Verifier.commit`` keeps the accepted path in the target's cache.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import torch

from cascade.models.lm import CausalLM, HiddenLayers
from cascade.sampling import logits_to_probs, one_hot_rows, sample
from cascade.tree_structure import children_of, depths_of, is_chain, path_to, tree_inputs
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
            q_row = one_hot_rows([x], residual)[0] if q is None else q[c].to(residual.dtype)
            residual = residual_distribution(residual, q_row)
        if nxt is None:
            return VerifyResult(len(path), int(sample(residual, generator)), not kids[j], path, judgements)
        path.append(nxt)
        j = nxt + 1


def _q_row(q: torch.Tensor | None, node: int, token: int, like: torch.Tensor) -> torch.Tensor:
    """[V] the distribution ``node`` was drawn from (one-hot on its token when deterministic)."""
    return one_hot_rows([token], like)[0] if q is None else q[node].to(like.dtype)


def _start_weight(weight: float, law: torch.Tensor, q: torch.Tensor | None, node: int, token: int) -> float:
    """A child's weight ``min(1, w r(x) / q(x))`` below a parent with weight ``w`` and law ``r``.
    A token its own q gives no mass (a drafter breaking its promise) is never kept, as in the
    token-wise rule."""
    qx = 1.0 if q is None else float(q[node, token])
    if qx <= 0:
        return 0.0
    return min(1.0, weight * float(law[token]) / qx)


def _after_rejection(weight: float, law: torch.Tensor, q_row: torch.Tensor) -> tuple[float, torch.Tensor]:
    """The pair (stop probability, law) of a node whose child drawn from ``q_row`` was rejected with
    its whole subtree: ``s / (s + 1 - w)`` and ``norm(max(0, w r - q))`` (module docstring).

    A weight of 1 keeps 1 (then s / (s + 0) = 1; s = 0 as well cannot be reached exactly, and the
    law falls back to ``r`` against round-off); s = 0 with w < 1 gives 0 (the node never stops)."""
    residual = torch.clamp(weight * law - q_row, min=0.0)  # [V]
    total = float(residual.sum())
    if total <= 0:
        return (1.0 if weight >= 1.0 else 0.0), law
    stop = 1.0 if weight >= 1.0 else total / (total + 1.0 - weight)
    return stop, residual / total


def _block_weights(tokens: list[int], q: torch.Tensor | None, p: torch.Tensor) -> list[float]:
    """[k + 1] a chain's weights w_0 = 1, w_{j+1} = min(1, w_j p_j(x_{j+1}) / q_j(x_{j+1}))."""
    weights = [1.0]
    for j, x in enumerate(tokens):
        weights.append(_start_weight(weights[j], p[j], q, j, x))
    return weights


def accept_block(
    tokens: list[int],  # [k]
    parents: list[int],  # [k], a chain
    q: torch.Tensor | None,  # [k, V] or None (deterministic)
    p: torch.Tensor,  # [k + 1, V]
    generator: torch.Generator | None,
) -> VerifyResult:
    """Block verification of a chain (see the module docstring): weights forward, then a backward
    pass from the leaf keeps the largest j whose uniform falls below ``h_j``."""
    if not is_chain(parents):
        raise ValueError("block verification judges a chain; verify a token tree with accept_traversal "
                         "(verify=traversal), which is block verification on a chain")
    k = len(tokens)
    if p.shape[0] != k + 1:
        raise ValueError(f"p must have k+1={k + 1} rows, got {p.shape[0]}")
    # 1. forward: w_0 = 1, w_{j+1} = min(1, w_j p_j(x) / q_j(x))
    weights = _block_weights(tokens, q, p)  # [k + 1]
    # 2. backward: j = k, ..., 0; the first j with eta_j <= h_j is the kept length (h_0 = 1)
    for j in range(k, -1, -1):
        if j == k:
            stop, law = weights[k], p[k]
        else:
            stop, law = _after_rejection(weights[j], p[j], _q_row(q, j, tokens[j], p[j]))
        if j == 0 or _uniform(generator) < stop:
            break
    judgements = [ACCEPTED] * j + [REJECTED] * (j < k) + [UNJUDGED] * (k - j - 1)
    return VerifyResult(j, int(sample(law, generator)), j == k, list(range(j)), judgements)


@dataclass
class TraversalPlan:
    """Traversal verification of one tree, everything but the uniforms: the nodes in the order they
    are tested (post-order, -1 = the root, last), each one's stop probability and next-token law.
    A pure function of (tokens, parents, q, p): which node stops is decided by the uniforms alone."""

    order: list[int] = field(default_factory=list)  # node indices, children before their parent
    stop: list[float] = field(default_factory=list)  # P(the traversal stops at order[i] | it got there)
    law: list[torch.Tensor] = field(default_factory=list)  # [V] the next token's law when it stops there

    def end_probabilities(self) -> list[float]:
        """P(the traversal ends at order[i]) = prod_{earlier} (1 - stop) * stop."""
        out, alive = [], 1.0
        for s in self.stop:
            out.append(alive * s)
            alive *= 1.0 - s
        return out


def traversal_plan(
    tokens: list[int],  # [n]
    parents: list[int],  # [n]
    q: torch.Tensor | None,  # [n, V] or None (deterministic)
    p: torch.Tensor,  # [n + 1, V]
) -> TraversalPlan:
    """The pairs (w, r) of every node, updated as its children are rejected (module docstring)."""
    if p.shape[0] != len(tokens) + 1:
        raise ValueError(f"p must have n+1={len(tokens) + 1} rows, got {p.shape[0]}")
    kids = children_of(parents)
    plan = TraversalPlan()

    def visit(j: int, weight: float, law: torch.Tensor) -> None:  # j: input index (0 = root, i + 1 = node i)
        for c in kids[j]:
            visit(c + 1, _start_weight(weight, law, q, c, tokens[c]), p[c + 1])
            weight, law = _after_rejection(weight, law, _q_row(q, c, tokens[c], law))  # c's subtree rejected
        plan.order.append(j - 1)
        plan.stop.append(1.0 if j == 0 else weight)
        plan.law.append(law)

    visit(0, 1.0, p[0])
    return plan


def _judged_path(end: int, parents: list[int], kids: list[list[int]]) -> tuple[list[int], list[int]]:
    """The accepted path to ``end`` (-1: the root) and the judgements of a rule that tried the
    children (``kids``: ``children_of(parents)``) of each node on it in order: earlier siblings
    rejected, later ones unjudged, all children of ``end`` rejected (as recursive rejection's)."""
    path = path_to(end, parents)
    judgements = [UNJUDGED] * len(parents)
    for j, nxt in zip([0] + [i + 1 for i in path], path + [None]):
        for c in kids[j]:
            if c == nxt:
                judgements[c] = ACCEPTED
                break
            judgements[c] = REJECTED
    return path, judgements


def accept_traversal(
    tokens: list[int],  # [n]
    parents: list[int],  # [n]
    q: torch.Tensor | None,  # [n, V] or None (deterministic)
    p: torch.Tensor,  # [n + 1, V]
    generator: torch.Generator | None,
) -> VerifyResult:
    """Traversal verification of a token tree (see the module docstring); block verification on a
    chain, draw for draw."""
    plan = traversal_plan(tokens, parents, q, p)
    for end, stop, law in zip(plan.order, plan.stop, plan.law):
        if end < 0 or _uniform(generator) < stop:
            break
    kids = children_of(parents)
    path, judgements = _judged_path(end, parents, kids)
    return VerifyResult(len(path), int(sample(law, generator)), not kids[end + 1], path, judgements)


def expected_accepted(rule: str, tokens: list[int], parents: list[int], q: torch.Tensor | None, p: torch.Tensor) -> float:
    """A rule's exact expected number of accepted draft tokens for one draft (``p``, ``q`` as for
    the rules): ``token`` (recursive rejection), ``block`` or ``traversal``."""
    depths = [0] + depths_of(parents)  # by input index
    if rule in ("block", "traversal"):
        if rule == "block" and not is_chain(parents):
            raise ValueError("block verification judges a chain")
        plan = traversal_plan(tokens, parents, q, p)
        return sum(e * depths[u + 1] for u, e in zip(plan.order, plan.end_probabilities()))
    if rule != "token":
        raise ValueError(f"unknown rule {rule!r}: one of {sorted(VERIFIERS)}")
    kids = children_of(parents)

    def reach_sum(j: int, reached: float) -> float:  # expected accepted nodes below input j, reached w.p. `reached`
        total, residual = 0.0, p[j]
        for c in kids[j]:
            x = tokens[c]
            qx = 1.0 if q is None else float(q[c, x])
            accept = 0.0 if qx <= 0 else min(1.0, float(residual[x]) / qx)
            total += reached * accept * (1 + reach_sum(c + 1, 1.0))
            reached *= 1.0 - accept
            residual = residual_distribution(residual, _q_row(q, c, x, residual))
        return total

    return reach_sum(0, 1.0)


def committed_inputs(result: VerifyResult) -> list[int]:
    """Indices into [root] + nodes of the inputs the cache keeps: the root and the accepted path."""
    return [0] + [i + 1 for i in result.path]


@dataclass(frozen=True)
class Verifier:
    """How a draft is shown to the target and judged: ``inputs(parents, past, dtype)`` (tree
    positions and mask, ``cascade.tree_structure.tree_inputs``), and the acceptance rules
    ``greedy(tokens, parents, argmax)`` and ``sampled(tokens, parents, q, p, generator)``.
    Replace one to study (or test) another rule. ``kept(result)``: the inputs the target's cache
    keeps after the forward (:func:`committed_inputs`), applied by :meth:`commit`. ``trees``:
    whether the sampled rule judges token trees (block verification judges chains only;
    ``generate`` refuses it a tree drafter)."""

    greedy: Callable[..., VerifyResult] = accept_greedy
    sampled: Callable[..., VerifyResult] = accept_sampled
    inputs: Callable[..., tuple] = tree_inputs
    trees: bool = True
    kept: Callable[[VerifyResult], list[int]] = committed_inputs

    def forward(self, target: CausalLM, cache, last: int, block: DraftBlock, return_hidden: HiddenLayers = None):
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

    def commit(self, target: CausalLM, cache, past: int, result: VerifyResult) -> list[int]:
        """After the verification forward, keep the ``past`` committed positions plus the inputs
        ``kept(result)`` (the root and the accepted path) in ``cache``, compacted in place (a
        chain's is a crop). Returns the kept input indices (to select, e.g., hidden states of the
        committed positions)."""
        keep = self.kept(result)
        target.compact(cache, past, keep)
        return keep


EXACT = Verifier()

# The sampled rules a config may name (``verify=...``); greedy decoding is the same under each.
VERIFIERS: dict[str, Verifier] = {
    "token": EXACT,
    "block": Verifier(sampled=accept_block, trees=False),
    "traversal": Verifier(sampled=accept_traversal),
}


def verifier_named(name: "str | Verifier") -> Verifier:
    """The verifier a config names (a ``Verifier`` passes through)."""
    if isinstance(name, Verifier):
        return name
    if name not in VERIFIERS:
        raise ValueError(f"unknown verification rule {name!r}: one of {', '.join(VERIFIERS)}")
    return VERIFIERS[name]
