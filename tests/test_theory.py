"""Closed forms pinned to hand-computed values and to Monte-Carlo simulation."""

import math
import random

import pytest

from cascade import theory


def test_hand_computed_values():
    assert theory.expected_tokens(0.8, 4) == pytest.approx((1 - 0.8**5) / 0.2) == pytest.approx(3.3616)
    assert theory.expected_tokens(1.0, 4) == 5.0
    assert theory.expected_tokens(0.0, 4) == 1.0
    assert theory.speedup(0.8, 4, 0.1) == pytest.approx(3.3616 / 1.4)
    assert theory.optimal_gamma_approx(0.8, 0.04) == pytest.approx(15.0)
    assert theory.expected_tokens_per_position([0.9, 0.5, 0.2]) == pytest.approx(2.44)
    # phi(0.8) = 0.5*0.8 + 0.25*0.64 + 0.25*0.512 = 0.688; numerator (1 - 0.8*0.688^2)/0.2
    assert theory.round_length_pgf(0.8, 0.5, 2) == pytest.approx(0.688)
    assert theory.ewif_two_level(0.8, 0.5, 2, 2, 0.2, 0.05) == pytest.approx(3.106624 / 1.6)


@pytest.mark.parametrize("alpha,c", [(0.5, 0.4), (0.3, 0.4), (0.9, 0.05), (0.2, 0.1)])
def test_gamma_one_pays_off_iff_alpha_above_c(alpha, c):
    assert theory.gamma_one_pays_off(alpha, c) == (theory.speedup(alpha, 1, c) > 1.0)


def test_optimal_gamma_and_the_seed_approximation():
    """The seed's approximation never undershoots the best integer γ: 12.9 vs 8 at α=0.8, c=0.05
    (speedup within 10% of the optimum: the curve is flat near its top), but 53.6 vs 19 at
    α=0.9, c=0.02 (25% below the optimum). Use optimal_gamma() to choose γ."""
    for alpha, c, close in [(0.8, 0.05, True), (0.7, 0.1, True), (0.9, 0.02, False)]:
        best = theory.optimal_gamma(alpha, c)
        assert theory.speedup(alpha, best, c) >= max(theory.speedup(alpha, g, c) for g in range(65))
        approx = round(theory.optimal_gamma_approx(alpha, c))
        assert approx >= best
        ratio = theory.speedup(alpha, approx, c) / theory.speedup(alpha, best, c)
        assert (ratio >= 0.9) == close, ratio


def _simulate_chain(alphas, rng):
    """Tokens per target forward: accepted prefix of iid Bernoulli(alpha_i) draws, plus one."""
    n = 0
    for a in alphas:
        if rng.random() >= a:
            break
        n += 1
    return n + 1


@pytest.mark.parametrize("alphas", [[0.8] * 4, [0.6] * 7, [0.95, 0.7, 0.4, 0.9, 0.5]])
def test_expected_tokens_matches_monte_carlo(alphas):
    rng = random.Random(0)
    trials = 40_000
    samples = [_simulate_chain(alphas, rng) for _ in range(trials)]
    mean = sum(samples) / trials
    sd = math.sqrt(sum((s - mean) ** 2 for s in samples) / trials)
    expected = theory.expected_tokens_per_position(alphas)
    assert abs(mean - expected) < 4 * sd / math.sqrt(trials)
    if len(set(alphas)) == 1:
        assert expected == pytest.approx(theory.expected_tokens(alphas[0], len(alphas)))


@pytest.mark.parametrize("alpha,beta,n,k", [(0.8, 0.6, 2, 3), (0.5, 0.9, 3, 2), (0.9, 0.3, 1, 4)])
def test_two_level_numerator_matches_monte_carlo(alpha, beta, n, k):
    rng = random.Random(1)
    trials = 40_000
    samples = []
    for _ in range(trials):
        drafted = 0
        for _ in range(n):  # one d1 round: its drafter's accepted prefix (<= k) plus one token
            drafted += _simulate_chain([beta] * k, rng)
        samples.append(_simulate_chain([alpha] * drafted, rng))
    mean = sum(samples) / trials
    sd = math.sqrt(sum((s - mean) ** 2 for s in samples) / trials)
    numerator = theory.ewif_two_level(alpha, beta, n, k, 0.0, 0.0)
    assert abs(mean - numerator) < 4 * sd / math.sqrt(trials)


def test_bad_alpha():
    with pytest.raises(ValueError, match="acceptance rate"):
        theory.expected_tokens(1.2, 3)


def test_forward_floor_is_bandwidth_then_compute_bound():
    # 3 GB of weights at 30 GB/s = 0.1 s; 3 GFLOP per token at 150 GFLOP/s = 0.02 s per token
    floor = [theory.forward_floor_s(k, 3e9, 3e9, 30e9, 150e9) for k in (1, 5, 6, 10)]
    assert floor == pytest.approx([0.1, 0.1, 0.12, 0.2])
    assert theory.forward_floor_s(5, 3e9, 3e9, 30e9, 150e9, overlap=False) == pytest.approx(0.2)
    with pytest.raises(ValueError):
        theory.forward_floor_s(0, 3e9, 3e9, 30e9, 150e9)
