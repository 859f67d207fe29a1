"""Pure verifier tests on chains (the tree whose parents are -1, 0, 1, ...): greedy rules and a
Monte-Carlo check that sampled verification emits exactly p (and that a broken verifier does
not)."""

import pytest
import torch

from cascade.tree_structure import chain_parents
from cascade.types import ACCEPTED, REJECTED, UNJUDGED, VerifyResult
from cascade.verify import accept_greedy, accept_sampled, residual_distribution


def verify_chain_greedy(draft: torch.Tensor, argmax: torch.Tensor) -> VerifyResult:
    return accept_greedy(draft.tolist(), chain_parents(draft.shape[0]), argmax)


def verify_chain_sampled(draft: torch.Tensor, q, p, gen) -> VerifyResult:
    return accept_sampled(draft.tolist(), chain_parents(draft.shape[0]), q, p, gen)


def test_greedy_longest_matching_prefix_plus_one():
    argmax = torch.tensor([5, 6, 7, 8])
    A, R, U = ACCEPTED, REJECTED, UNJUDGED
    assert verify_chain_greedy(torch.tensor([5, 6, 9]), argmax) == VerifyResult(2, 7, False, [0, 1], [A, A, R])
    assert verify_chain_greedy(torch.tensor([5, 6, 7]), argmax) == VerifyResult(3, 8, True, [0, 1, 2], [A, A, A])
    assert verify_chain_greedy(torch.tensor([1, 6, 7]), argmax) == VerifyResult(0, 5, False, [], [R, U, U])
    assert verify_chain_greedy(torch.tensor([], dtype=torch.long), argmax[:1]) == VerifyResult(0, 5, True)
    with pytest.raises(ValueError):
        verify_chain_greedy(torch.tensor([5]), argmax)


def test_residual_is_normalised_positive_part():
    p = torch.tensor([0.5, 0.3, 0.2], dtype=torch.float64)
    q = torch.tensor([0.2, 0.6, 0.2], dtype=torch.float64)
    torch.testing.assert_close(residual_distribution(p, q), torch.tensor([1.0, 0.0, 0.0], dtype=torch.float64))


def _first_token_frequencies(verify, p, q, deterministic, n, seed=0):
    """Empirical distribution of the first emitted token when drafts are drawn from q."""
    gen = torch.Generator().manual_seed(seed)
    k, V = q.shape
    counts = torch.zeros(V, dtype=torch.float64)
    for _ in range(n):
        draft = torch.multinomial(q, 1, generator=gen).squeeze(-1)  # [k]
        res = verify(draft, None if deterministic else q, p, gen)
        first = int(draft[0]) if res.num_accepted > 0 else res.next_token
        counts[first] += 1
    return counts / n


def _accept_always(draft, q, p, gen):
    return VerifyResult(int(draft.shape[0]), 0, True)


def _residual_from_p(draft, q, p, gen):
    """A classic mistake: resample the rejected position from p instead of norm(max(0, p - q))."""
    k = int(draft.shape[0])
    qx = torch.ones(k, dtype=p.dtype) if q is None else q[torch.arange(k), draft]
    u = torch.rand(k, generator=gen, dtype=p.dtype)
    for i in range(k):
        if u[i] * qx[i] >= p[i, draft[i]]:
            return VerifyResult(i, int(torch.multinomial(p[i], 1, generator=gen)), False)
    return VerifyResult(k, int(torch.multinomial(p[k], 1, generator=gen)), True)


P = torch.tensor([[0.45, 0.25, 0.15, 0.1, 0.05], [0.2, 0.2, 0.2, 0.2, 0.2], [0.1, 0.2, 0.3, 0.2, 0.2]], dtype=torch.float64)
Q = torch.tensor([[0.1, 0.15, 0.5, 0.05, 0.2], [0.3, 0.3, 0.2, 0.1, 0.1]], dtype=torch.float64)
N = 20_000
# With N draws the total-variation distance of an unbiased estimate from p stays under 0.02
# except with probability far below 1e-6 (sum of 5 binomial standard errors is ~0.013 max).
TV_BOUND = 0.02


@pytest.mark.parametrize("deterministic", [False, True])
def test_sampled_verification_emits_p(deterministic):
    freq = _first_token_frequencies(verify_chain_sampled, P, Q, deterministic, N)
    assert 0.5 * (freq - P[0]).abs().sum() < TV_BOUND


@pytest.mark.parametrize("broken", [_accept_always, _residual_from_p])
def test_broken_verifiers_fail_the_same_check(broken):
    freq = _first_token_frequencies(broken, P, Q, False, N)
    assert 0.5 * (freq - P[0]).abs().sum() > TV_BOUND
