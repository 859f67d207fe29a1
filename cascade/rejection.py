"""Lossless verification of a drafted chain. Pure functions on tensors; no models.

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
    the extra token drawn from ``p[k]`` (0-based: the position after the last draft) when all
    ``k`` draft tokens are kept.

Sampled verification is Leviathan et al. (2023) / Chen et al. (2023): token ``x_i`` is accepted
with probability ``min(1, p_i(x_i) / q_i(x_i))``; the emitted sequence is then distributed exactly
as the target's. Greedy verification keeps the longest prefix equal to the target's argmax and
appends the target's argmax after it, so the output equals greedy decoding token for token.
"""

from __future__ import annotations

import torch

from cascade.sampling import sample
from cascade.types import VerifyResult


def verify_chain_greedy(draft_tokens: torch.Tensor, target_argmax: torch.Tensor) -> VerifyResult:
    """Greedy verification.

    draft_tokens: [k] int64. target_argmax: [k+1] int64, the target's argmax at each drafted
    position and the one after.
    """
    k = int(draft_tokens.shape[0])
    if target_argmax.shape[0] != k + 1:
        raise ValueError(f"target_argmax must have k+1={k + 1} entries, got {target_argmax.shape[0]}")
    mismatch = (draft_tokens != target_argmax[:k]).nonzero()
    n = int(mismatch[0, 0]) if mismatch.numel() else k
    return VerifyResult(num_accepted=n, next_token=int(target_argmax[n]), all_accepted=n == k)


def residual_distribution(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """``norm(max(0, p - q))``. p, q: [V] probabilities -> [V].

    The residual is zero only when p == q, and then a rejection has probability zero; the
    fallback to ``p`` only guards against round-off.
    """
    residual = torch.clamp(p - q, min=0.0)
    total = residual.sum()
    if total <= 0:
        return p
    return residual / total


def verify_chain_sampled(
    draft_tokens: torch.Tensor,
    q: torch.Tensor | None,
    p: torch.Tensor,
    generator: torch.Generator | None,
) -> VerifyResult:
    """Speculative-sampling verification of a chain.

    draft_tokens: [k] int64. q: [k, V] (or None = one-hot on each draft token). p: [k+1, V].
    """
    k = int(draft_tokens.shape[0])
    if p.shape[0] != k + 1:
        raise ValueError(f"p must have k+1={k + 1} rows, got {p.shape[0]}")
    if k:
        rows = torch.arange(k, device=p.device)
        p_x = p[rows, draft_tokens]  # [k]
        q_x = torch.ones_like(p_x) if q is None else q[rows, draft_tokens].to(p.dtype)  # [k]
        u = torch.rand(k, generator=generator, device=p.device, dtype=p.dtype)  # [k]
        # u < p/q  <=>  u*q < p  (accepts with probability min(1, p/q); no division by zero)
        rejected = (u * q_x >= p_x).nonzero()
        if rejected.numel():
            n = int(rejected[0, 0])
            q_n = _q_row(q, draft_tokens, n, p)
            token = sample(residual_distribution(p[n], q_n), generator)
            return VerifyResult(num_accepted=n, next_token=int(token), all_accepted=False)
    bonus = sample(p[k], generator)
    return VerifyResult(num_accepted=k, next_token=int(bonus), all_accepted=True)


def _q_row(q: torch.Tensor | None, draft_tokens: torch.Tensor, n: int, p: torch.Tensor) -> torch.Tensor:
    """Row n of q, or the one-hot distribution of a deterministic draft token. -> [V]"""
    if q is not None:
        return q[n].to(p.dtype)
    one_hot = torch.zeros_like(p[n])
    one_hot[draft_tokens[n]] = 1.0
    return one_hot
