"""Block and traversal verification (cascade.verify) checked exactly on tiny vocabularies.

A toy "language" over V tokens: the target's and each drafter's next-token law depend on the whole
prefix (random Dirichlet tables, float64). For a tree shape whose nodes are drawn from given
drafters (or fixed deterministically), every possible draft is enumerated with its probability;
for each, the rule's exact law of (accepted node, next token) is combined with the target's law of
the tokens after it, and the result must equal the target's own law of the first L tokens. This
is losslessness without sampling error. The paper's formulas are written here a second time,
independently (numpy, a forward loop), and the implementation's (accepted length, next token)
law must equal them; the expected accepted length is compared with the token-wise rule's (block:
optimal, hence >= token-wise; traversal >= recursive rejection), and the sampling code itself is
checked draw for draw (block = traversal on a chain) and by a chi-square against the exact law.
"""

from __future__ import annotations

import itertools
from fractions import Fraction

import numpy as np
import pytest
import torch
from scipy.stats import chisquare

from cascade.tree_structure import chain_parents, children_of, depths_of, path_to
from cascade.verify import (VERIFIERS, accept_block, accept_sampled, accept_traversal, expected_accepted,
                            traversal_plan, verifier_named)


class ToyLM:
    """Next-token laws over ``vocab`` tokens that depend on the whole prefix (drawn lazily)."""

    def __init__(self, vocab: int, seed: int, concentration: float = 0.7) -> None:
        self.vocab, self.rng, self.alpha, self.table = vocab, np.random.default_rng(seed), concentration, {}

    def __call__(self, prefix: tuple) -> np.ndarray:
        if prefix not in self.table:
            self.table[prefix] = self.rng.dirichlet(np.full(self.vocab, self.alpha))
        return self.table[prefix]


def drafts(parents: list[int], kinds: list, drafters: dict[str, ToyLM], vocab: int):
    """Every draft of the tree ``parents``: yields (tokens, q [n, V] or None, probability).
    kinds[i] is a drafter's name (node i sampled from it below its parent's path) or an int (a
    deterministic node with that token, one-hot q)."""
    free = [i for i, k in enumerate(kinds) if isinstance(k, str)]
    for values in itertools.product(range(vocab), repeat=len(free)):
        tokens = [k if isinstance(k, int) else None for k in kinds]
        for i, v in zip(free, values):
            tokens[i] = v
        q = np.zeros((len(tokens), vocab))
        prob = 1.0
        for i, kind in enumerate(kinds):
            before = tuple(tokens[j] for j in path_to(parents[i], parents))
            if isinstance(kind, int):
                q[i, kind] = 1.0
            else:
                q[i] = drafters[kind](before)
                prob *= q[i, tokens[i]]
        yield tokens, q, prob


def target_rows(target: ToyLM, tokens: list[int], parents: list[int]) -> torch.Tensor:
    """[n + 1, V] the target's law at [root] + nodes."""
    rows = [target(())] + [target(tuple(tokens[j] for j in path_to(i, parents))) for i in range(len(tokens))]
    return torch.tensor(np.array(rows))


def target_law(target: ToyLM, length: int) -> dict[tuple, float]:
    out = {}
    for seq in itertools.product(range(target.vocab), repeat=length):
        out[seq] = float(np.prod([target(seq[:i])[seq[i]] for i in range(length)]))
    return out


def continue_with_target(target: ToyLM, start: tuple, length: int, mass: float, into: dict) -> None:
    for rest in itertools.product(range(target.vocab), repeat=length - len(start)):
        seq = start + rest
        into[seq] = into.get(seq, 0.0) + mass * float(np.prod([target(seq[:i])[seq[i]] for i in range(len(start), length)]))


def output_law(rule_law, target: ToyLM, parents, kinds, drafters, length: int) -> tuple[dict, float]:
    """The law of the first ``length`` tokens when every step is this one rule's (then the
    target's own sampling), and the expected accepted length. ``rule_law(tokens, parents, q, p)``
    yields (end node or -1, probability, next-token law [V])."""
    out, expected = {}, 0.0
    depths = [0] + depths_of(parents)
    for tokens, q, prob in drafts(parents, kinds, drafters, target.vocab):
        p = target_rows(target, tokens, parents)
        for end, mass, law in rule_law(tokens, parents, torch.tensor(q), p):
            expected += prob * mass * depths[end + 1]
            kept = tuple(tokens[j] for j in path_to(end, parents))
            for y in range(target.vocab):
                if mass * float(law[y]) > 0:
                    continue_with_target(target, kept + (y,), length, prob * mass * float(law[y]), out)
    return out, expected


def traversal_law(tokens, parents, q, p):
    plan = traversal_plan(tokens, parents, q, p)
    return zip(plan.order, plan.end_probabilities(), plan.law)


def recursive_rejection_law(tokens, parents, q, p):
    """The token-wise rule's exact (end node, probability, law), written out here (SpecInfer's
    recursive rejection), to compare expected lengths with."""
    kids, out = children_of(parents), []

    def go(j, reached):
        residual = p[j].clone()
        for c in kids[j]:
            x = tokens[c]
            accept = min(1.0, float(residual[x] / q[c, x])) if q[c, x] > 0 else 0.0
            go(c + 1, reached * accept)
            reached *= 1 - accept
            r = torch.clamp(residual - q[c], min=0)
            residual = r / r.sum() if r.sum() > 0 else residual
        out.append((j - 1, reached, residual))

    go(0, 1.0)
    return out


def paper_block_law(tokens, q, p):
    """Sun et al.'s block verification, from the paper's formulas in a forward loop (numpy):
    P(tau = i) = h_i prod_{j > i} (1 - h_j) with h_0 = 1, and the next token's law at tau."""
    p, q = np.asarray(p), np.asarray(q)
    k = len(tokens)
    w = [1.0]
    for i in range(1, k + 1):
        w.append(min(w[i - 1] * p[i - 1, tokens[i - 1]] / q[i - 1, tokens[i - 1]], 1.0))
    h, law = [], []
    for i in range(k + 1):
        if i == k:
            h.append(w[k] if k else 1.0)
            law.append(p[k])
            continue
        mass = np.maximum(w[i] * p[i] - q[i], 0.0)
        s = mass.sum()
        h.append(1.0 if i == 0 else s / (s + 1.0 - w[i]))
        law.append(mass / s if s > 0 else mass)  # s = 0: h = 0, the law is never used
    out = []
    for i in range(k + 1):
        out.append((i, h[i] * np.prod([1 - h[j] for j in range(i + 1, k + 1)]), law[i]))
    return out


CHAIN = chain_parents(3)
TREES = {  # (parents, kinds): sampled nodes from drafters "a"/"b", deterministic ones as ints
    "chain_sampled": (CHAIN, ["a", "a", "a"]),
    "chain_mixed": (CHAIN, ["a", 1, "b"]),
    "siblings_iid": ([-1, -1, 0, 1], ["a", "a", "a", "b"]),
    "mixed_tree": ([-1, -1, 0, 0, 1, 2, -1], ["a", "b", "a", "a", "b", "a", 2]),
    "deterministic_first": ([-1, -1, 1, 2], [0, "a", "b", "a"]),
}


@pytest.mark.parametrize("shape", list(TREES))
@pytest.mark.parametrize("seed", [0, 1])
def test_traversal_is_exactly_lossless(shape, seed):
    """Every draft enumerated: the output law equals the target's, to round-off."""
    parents, kinds = TREES[shape]
    vocab = 3
    target = ToyLM(vocab, seed)
    drafters = {"a": ToyLM(vocab, seed + 100), "b": ToyLM(vocab, seed + 200, concentration=2.0)}
    length = max(depths_of(parents)) + 1
    got, _ = output_law(traversal_law, target, parents, kinds, drafters, length)
    want = target_law(target, length)
    assert abs(sum(got.values()) - 1) < 1e-12
    assert max(abs(want[s] - got.get(s, 0.0)) for s in want) < 1e-12


def test_a_stale_parent_weight_is_not_lossless():
    """The same check fails for a traversal that keeps a parent's weight after a rejected child
    (only its law updated): the check can see a wrong rule."""
    parents, kinds = TREES["siblings_iid"]
    vocab = 3
    target, drafters = ToyLM(vocab, 0), {"a": ToyLM(vocab, 100), "b": ToyLM(vocab, 200, concentration=2.0)}

    def stale(tokens, parents, q, p):
        import cascade.verify as v

        original = v._after_rejection
        v._after_rejection = lambda w, law, q_row: (w if w < 1 else 1.0, original(w, law, q_row)[1])
        try:
            return list(traversal_law(tokens, parents, q, p))
        finally:
            v._after_rejection = original

    got, _ = output_law(stale, target, parents, kinds, drafters, 3)
    want = target_law(target, 3)
    assert max(abs(want[s] - got.get(s, 0.0)) for s in want) > 1e-3


@pytest.mark.parametrize("seed", range(4))
def test_block_law_equals_the_papers_formulas(seed):
    """Per draft, the implementation's law of (accepted length, next token) on a chain equals the
    paper's, computed independently."""
    vocab, k = 4, 3
    target, drafter = ToyLM(vocab, seed), ToyLM(vocab, seed + 50)
    for tokens, q, _ in drafts(chain_parents(k), ["a"] * k, {"a": drafter}, vocab):
        p = target_rows(target, tokens, chain_parents(k))
        want = {i: mass * law for i, mass, law in paper_block_law(tokens, q, p.numpy())}
        for end, mass, law in traversal_law(tokens, chain_parents(k), torch.tensor(q), p):
            np.testing.assert_allclose(mass * law.numpy(), want[end + 1], atol=1e-12)


def test_paper_example_ten_ninths_to_eleven_ninths():
    """The paper's motivating example: two tokens, target (1/3, 2/3), drafter (2/3, 1/3), context
    free, k = 2: token-wise keeps 10/9 tokens per draft on average, block verification 11/9."""
    p_row, q_row = torch.tensor([1 / 3, 2 / 3], dtype=torch.float64), torch.tensor([2 / 3, 1 / 3], dtype=torch.float64)
    expected = {"token": 0.0, "block": 0.0, "traversal": 0.0}
    for tokens in itertools.product(range(2), repeat=2):
        prob = float(q_row[tokens[0]] * q_row[tokens[1]])
        q, p = q_row.expand(2, 2), p_row.expand(3, 2)
        for rule in expected:
            expected[rule] += prob * expected_accepted(rule, list(tokens), chain_parents(2), q, p)
    assert Fraction(expected["token"]).limit_denominator(100) == Fraction(10, 9)
    assert Fraction(expected["block"]).limit_denominator(100) == Fraction(11, 9)
    assert expected["traversal"] == pytest.approx(expected["block"], abs=1e-12)


@pytest.mark.parametrize("shape", list(TREES))
def test_expected_accepted_is_at_least_token_wise(shape):
    """Averaged over drafts (the papers' claims: block is optimal for one draft, traversal accepts
    at least what recursive rejection does), on random tables; and strictly more somewhere."""
    parents, kinds = TREES[shape]
    vocab, gains = 3, []
    for seed in range(6):
        target = ToyLM(vocab, seed, concentration=1.0)
        drafters = {"a": ToyLM(vocab, seed + 100), "b": ToyLM(vocab, seed + 200, concentration=2.0)}
        token = traversal = exact_token = 0.0
        for tokens, q, prob in drafts(parents, kinds, drafters, vocab):
            q_t, p = torch.tensor(q), target_rows(target, tokens, parents)
            token += prob * expected_accepted("token", tokens, parents, q_t, p)
            traversal += prob * expected_accepted("traversal", tokens, parents, q_t, p)
            depths = [0] + depths_of(parents)
            exact_token += prob * sum(m * depths[e + 1] for e, m, _ in recursive_rejection_law(tokens, parents, q_t, p))
        assert token == pytest.approx(exact_token, abs=1e-12)  # expected_accepted("token") is right
        assert traversal >= token - 1e-12, (seed, traversal, token)
        gains.append(traversal - token)
    if any(isinstance(k, str) for k in kinds[1:]) or len(kinds) > 1:
        assert max(gains) > 1e-3, gains


def test_recursive_rejection_reference_is_lossless():
    """The written-out token-wise law used above is itself exact (same enumeration)."""
    parents, kinds = TREES["mixed_tree"]
    target, drafters = ToyLM(3, 5), {"a": ToyLM(3, 105), "b": ToyLM(3, 205, concentration=2.0)}
    got, _ = output_law(recursive_rejection_law, target, parents, kinds, drafters, 4)
    want = target_law(target, 4)
    assert max(abs(want[s] - got.get(s, 0.0)) for s in want) < 1e-12


def _random_case(gen, vocab, parents, deterministic=False):
    n = len(parents)
    p = torch.softmax(torch.randn(n + 1, vocab, generator=gen, dtype=torch.float64) * 2, -1)
    q = torch.softmax(torch.randn(n, vocab, generator=gen, dtype=torch.float64) * 2, -1)
    tokens = torch.multinomial(q, 1, generator=gen)[:, 0].tolist()
    return tokens, (None if deterministic else q), p


@pytest.mark.parametrize("deterministic", [False, True])
def test_block_equals_traversal_on_chains_draw_for_draw(deterministic):
    gen = torch.Generator().manual_seed(0)
    for trial in range(200):
        k = trial % 6
        tokens, q, p = _random_case(gen, 7, chain_parents(k), deterministic)
        a = accept_block(tokens, chain_parents(k), q, p, torch.Generator().manual_seed(trial))
        b = accept_traversal(tokens, chain_parents(k), q, p, torch.Generator().manual_seed(trial))
        assert (a.num_accepted, a.next_token, a.all_accepted, a.path, a.judgements) == \
               (b.num_accepted, b.next_token, b.all_accepted, b.path, b.judgements)


def _draws_against_law(rule, tokens, parents, q, p, law, seed, n=20_000) -> tuple[int, float]:
    """``n`` draws of ``rule``'s (end node, next token) against ``law`` (end node, mass, next-token
    law) triples: (draws the law gives no mass, chi-square p-value of the others)."""
    vocab = p.shape[-1]
    cells = {(end, y): mass * float(next_law[y]) for end, mass, next_law in law for y in range(vocab)}
    counts = dict.fromkeys(cells, 0)
    draw = torch.Generator().manual_seed(seed)
    for _ in range(n):
        r = rule(tokens, parents, q, p, draw)
        key = (r.path[-1] if r.path else -1, r.next_token)
        counts[key] = counts.get(key, 0) + 1
    keys = [c for c in cells if cells[c] > 0]
    inside = sum(counts[c] for c in keys)
    return n - inside, chisquare([counts[c] for c in keys], [inside * cells[c] for c in keys]).pvalue


def test_sampling_matches_the_exact_law():
    """accept_block / accept_traversal's draws of (end node, next token) for one fixed tree follow
    the plan's exact law (chi-square, 20,000 draws each)."""
    gen = torch.Generator().manual_seed(1)
    for rule, parents in ((accept_block, chain_parents(3)), (accept_traversal, [-1, -1, 0, 1, 2])):
        tokens, q, p = _random_case(gen, 4, parents)
        plan = traversal_plan(tokens, parents, q, p)
        law = zip(plan.order, plan.end_probabilities(), plan.law)
        outside, pvalue = _draws_against_law(rule, tokens, parents, q, p, law, seed=2)
        assert outside == 0, rule.__name__
        assert pvalue > 1e-3, rule.__name__


def test_judgements_and_results_on_a_tree():
    """Greedy-like extremes: q = p everywhere keeps the first path to its leaf (every weight 1)."""
    parents = [-1, 0, 0, -1]
    gen = torch.Generator().manual_seed(0)
    p = torch.softmax(torch.randn(5, 6, generator=gen, dtype=torch.float64), -1)
    q = torch.stack([p[0], p[1], p[1], p[0]])
    tokens = [int(torch.multinomial(row, 1, generator=gen)) for row in q]
    r = accept_traversal(tokens, parents, q, p, gen)
    assert r.path == [0, 1] and r.all_accepted and r.judgements == [1, 1, -1, -1]


def test_block_refuses_a_tree_and_names_are_checked():
    p = torch.full((3, 4), 0.25, dtype=torch.float64)
    with pytest.raises(ValueError, match="accept_traversal"):
        accept_block([0, 1], [-1, -1], None, p, None)
    with pytest.raises(ValueError, match="token, block, traversal"):
        verifier_named("blockwise")
    assert verifier_named("token").sampled is accept_sampled
    assert set(VERIFIERS) == {"token", "block", "traversal"}


def test_deterministic_drafts_gain_nothing():
    """With one-hot q (argmax drafts, prompt lookup, ranked tree children) block and traversal
    keep exactly what the token-wise rule keeps, in expectation and in law: on a chain
    w_j = p_0(x_1) ... p_{j-1}(x_j) and the h_j telescope to the token-wise stopping law."""
    gen = torch.Generator().manual_seed(5)
    for parents in (chain_parents(5), [-1, -1, 0, 0, 1, 3]):
        for _ in range(20):
            tokens, _, p = _random_case(gen, 6, parents, deterministic=True)
            token = expected_accepted("token", tokens, parents, None, p)
            assert expected_accepted("traversal", tokens, parents, None, p) == pytest.approx(token, abs=1e-12)
            want = {e: m for e, m, _ in recursive_rejection_law(tokens, parents, torch.nn.functional.one_hot(
                torch.tensor(tokens), 6).double(), p)}
            plan = traversal_plan(tokens, parents, None, p)
            for end, mass in zip(plan.order, plan.end_probabilities()):
                assert mass == pytest.approx(want[end], abs=1e-12)


@pytest.mark.parametrize("rule", ["exact", "shared_uniform", "stale_sibling"])
def test_recursive_rejection_draws_follow_its_exact_law(rule):
    """accept_sampled's draws of (end node, next token) on one fixed tree with three sampled
    siblings at the root and two below the first follow the written-out law (chi-square, 20,000
    draws); one uniform shared by a node's children, or a residual left stale after a sibling's
    rejection in 25% of rejections (tests/broken_doubles.py), fails the same check. Exact per
    draft, so neither is diluted as in the deep tests' tiny models."""
    from broken_doubles import VERIFIERS as DOUBLES

    parents = [-1, -1, -1, 0, 0]
    _, q, p = _random_case(torch.Generator().manual_seed(3), 4, parents)
    q[1], q[2], q[4] = q[0], q[0], q[3]  # siblings drawn from their parent's one q
    # distinct siblings, the least likely to be kept first (so rejections, and the residual after
    # them, are frequent); the law is conditional on the draft
    root = torch.argsort(p[0] / q[0])[:3].tolist()
    below = torch.argsort(p[1] / q[3])[:2].tolist()
    tokens = root + below
    sampled = accept_sampled if rule == "exact" else DOUBLES[rule].sampled
    law = recursive_rejection_law(tokens, parents, q, p)
    outside, pvalue = _draws_against_law(sampled, tokens, parents, q, p, law, seed=4)
    if rule == "exact":
        assert outside == 0 and pvalue > 1e-3, (pvalue, outside)
    else:
        assert outside > 0 or pvalue < 1e-3, (rule, pvalue)
