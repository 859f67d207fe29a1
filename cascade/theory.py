"""Closed forms for speculative decoding (Leviathan et al. 2023; CS Drafting, Chen et al. 2023).

Notation as in ``cascade.verify``: α acceptance rate, γ draft length, c = drafter step time /
target step time. Pure functions on floats.

Where the independence assumption enters: the formulas with a single α assume every draft
position is accepted with the same probability, independently of the others. In real text
acceptance varies with context and depth. :func:`expected_tokens_per_position` is exact for
any per-depth rates *if* ``alphas[i]`` is the conditional rate P(position i accepted | positions
before it accepted) — which is what a run measures as accepted-at-depth-i / reached-depth-i —
because E[accepted] = Σ_i P(first i accepted) = Σ_i Π_{j≤i} α_j (chain rule, no independence).
"""

from __future__ import annotations

import math
from collections.abc import Sequence


def expected_tokens(alpha: float, gamma: int) -> float:
    """E[L] = (1 - α^(γ+1)) / (1 - α): tokens per target forward, bonus included."""
    _check_alpha(alpha)
    if alpha == 1.0:
        return gamma + 1.0
    return (1.0 - alpha ** (gamma + 1)) / (1.0 - alpha)


def speedup(alpha: float, gamma: int, c: float) -> float:
    """Expected walltime improvement of a γ-token chain: E[L] / (1 + γ c)."""
    return expected_tokens(alpha, gamma) / (1.0 + gamma * c)


def optimal_gamma_approx(alpha: float, c: float) -> float:
    """The seed's approximation γ* ≈ α / ((1-α)√c) - 1/(1-α) (valid for 0 < α < 1, c > 0)."""
    _check_alpha(alpha)
    if not 0.0 < alpha < 1.0 or c <= 0:
        raise ValueError("optimal_gamma_approx needs 0 < alpha < 1 and c > 0")
    return alpha / ((1.0 - alpha) * math.sqrt(c)) - 1.0 / (1.0 - alpha)


def optimal_gamma(alpha: float, c: float, max_gamma: int = 64) -> int:
    """The integer γ in [0, max_gamma] maximising :func:`speedup` (0 = do not speculate)."""
    return max(range(max_gamma + 1), key=lambda g: speedup(alpha, g, c))


def gamma_one_pays_off(alpha: float, c: float) -> bool:
    """γ = 1 beats autoregressive decoding iff α > c: (1 + α) / (1 + c) > 1."""
    return alpha > c


def expected_tokens_per_position(alphas: Sequence[float]) -> float:
    """1 + Σ_i Π_{j≤i} α_j for per-position conditional acceptance rates (see module docstring)."""
    total, prod = 1.0, 1.0
    for a in alphas:
        _check_alpha(a)
        prod *= a
        total += prod
    return total


def round_length_pgf(x: float, beta: float, k: int) -> float:
    """E[x^L] for the tokens L one speculative round of a middle model emits when its own
    drafter proposes k tokens, each accepted with probability β: L = 1 + min(G, k) with
    P(G ≥ j) = β^j."""
    _check_alpha(beta)
    pgf = sum(beta**j * (1.0 - beta) * x ** (j + 1) for j in range(k))
    return pgf + beta**k * x ** (k + 1)


def ewif_two_level(alpha: float, beta: float, n: int, k: int, c_d1: float, c_d2: float) -> float:
    """Two-level vertical cascade (CS Drafting): EWIF = (1 - α φ^n(α)) / ((1-α)(1 + n c_d1 + n k c_d2)).

    The middle model d1 runs ``n`` speculative rounds per target round, each over ``k`` tokens
    from the lower drafter d2 (accepted by d1 with probability β); the target accepts each
    token with probability α. φ(α) = E[α^L] is the probability generating function of the tokens
    one d1 round emits (:func:`round_length_pgf`), so φ^n(α) = E[α^(tokens drafted)] and the
    numerator is the expected tokens per target forward.
    """
    _check_alpha(alpha)
    if alpha == 1.0:  # every drafted token accepted: E[L] = n E[tokens per d1 round] + 1
        numerator = n * (1.0 + sum(beta**j for j in range(1, k + 1))) + 1.0
    else:
        numerator = (1.0 - alpha * round_length_pgf(alpha, beta, k) ** n) / (1.0 - alpha)
    return numerator / (1.0 + n * c_d1 + n * k * c_d2)


def predicted_speedup(alpha: float | None, gamma: float, c: float, verify_cost: float = 1.0) -> float | None:
    """Speedup predicted from a run's measured α, mean draft length γ and c (relative to one
    autoregressive target step), with ``verify_cost`` = verification forward time / one
    autoregressive step (1.0 in the seed formula). Non-integer γ is interpolated by the formula."""
    if alpha is None:
        return None
    alpha = min(alpha, 1.0 - 1e-12)
    el = (1.0 - alpha ** (gamma + 1)) / (1.0 - alpha)
    return el / (verify_cost + gamma * c)


def forward_floor_s(k: int, weight_bytes: float, flops_per_token: float, bandwidth: float, peak_flops: float,
                    overlap: bool = True) -> float:
    """Roofline lower bound on one forward over ``k`` new tokens, in seconds: the weights are
    streamed from memory once (``weight_bytes / bandwidth``, bytes/s) and the arithmetic runs at
    ``peak_flops`` (``k * flops_per_token / peak_flops``); at best the two overlap completely.
    Small k is bandwidth-bound (flat in k), large k compute-bound (linear in k): the ratio of a
    k-token to a 1-token forward cannot fall below ``forward_floor_s(k) / forward_floor_s(1)``
    on a machine whose 1-token forward runs at the bandwidth bound. ``overlap=False`` gives the
    time of a kernel that streams and computes one after the other (the sum of the two)."""
    if k < 1 or weight_bytes <= 0 or flops_per_token <= 0 or bandwidth <= 0 or peak_flops <= 0:
        raise ValueError("forward_floor_s needs k >= 1 and positive bytes, flops, bandwidth and peak")
    stream, compute = weight_bytes / bandwidth, k * flops_per_token / peak_flops
    return max(stream, compute) if overlap else stream + compute


def _check_alpha(alpha: float) -> None:
    if not 0.0 <= alpha <= 1.0:
        raise ValueError(f"acceptance rate must lie in [0, 1], got {alpha}")
