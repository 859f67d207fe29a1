"""Statistical losslessness: the joint distribution of the first two generated tokens under
speculative sampling equals the target's exact joint distribution.

Tiny float64 models with a vocabulary of 6 (36 cells). The exact joint is computed from the
target (p(x1) * p(x2 | x1), after the same temperature / top-k / top-p processing). A
chi-square goodness-of-fit test over N generations (fixed seeds, so the outcome is
deterministic) must not reject at level 1e-3; a deliberately broken verifier, run the same
way, must be rejected at that level — the test can fail.
"""

import numpy as np
import pytest
import torch
from scipy.stats import chisquare

import cascade.decode as decode_mod
from cascade import generate
from cascade.drafters import NGramDrafter, SmallLMDrafter
from cascade.models import tiny_llama
from cascade.sampling import logits_to_probs
from cascade.types import SamplingConfig, VerifyResult

V = 6
N = 1000
PROMPT = [1, 4, 1]  # prompt lookup proposes [4, 1] after the final 1
LEVEL = 1e-3
SETTINGS = {
    "temperature": SamplingConfig(temperature=1.0),
    "top_k": SamplingConfig(temperature=0.8, top_k=3),
    "top_p": SamplingConfig(temperature=1.2, top_p=0.7),
}


@pytest.fixture(scope="module")
def models():
    target = tiny_llama(vocab_size=V, seed=11, init_range=0.4)
    drafter = tiny_llama(vocab_size=V, seed=12, init_range=0.4)
    return target, drafter


def exact_joint(target, cfg: SamplingConfig) -> np.ndarray:
    cache = target.new_cache()
    p1 = logits_to_probs(target.forward(PROMPT, cache)[-1], cfg)
    joint = np.zeros((V, V))
    for x1 in range(V):
        if p1[x1] == 0:
            continue
        p2 = logits_to_probs(target.forward(PROMPT + [x1], target.new_cache())[-1], cfg)
        joint[x1] = (p1[x1] * p2).numpy()
    return joint


def empirical_counts(target, drafter, cfg: SamplingConfig) -> np.ndarray:
    """Alternates max_new_tokens=2 (one draft, so the second token is often the bonus token)
    and 3 (two drafts: accepted, or recovered at either position). Both are lossless, so the
    pooled counts follow the same joint distribution."""
    counts = np.zeros((V, V))
    gen = torch.Generator().manual_seed(1234)
    for i in range(N):
        out = generate(
            target, PROMPT, drafter=drafter, max_new_tokens=2 + i % 2, temperature=cfg.temperature,
            top_k=cfg.top_k, top_p=cfg.top_p, generator=gen, stop_on_eos=False,
        )
        counts[out.tokens[0], out.tokens[1]] += 1
    return counts


def chi_square_pvalue(counts: np.ndarray, joint: np.ndarray) -> float:
    """Cells with expected count < 5 are pooled into one; a count in a zero-probability cell
    gives p = 0."""
    expected = joint.ravel() * counts.sum()
    observed = counts.ravel()
    if observed[expected == 0].sum() > 0:
        return 0.0
    big = expected >= 5
    obs = np.append(observed[big], observed[~big & (expected > 0)].sum())
    exp = np.append(expected[big], expected[~big & (expected > 0)].sum())
    keep = exp > 0
    return float(chisquare(obs[keep], exp[keep]).pvalue)


def make_drafter(kind, drafter_lm):
    if kind == "ngram":
        return NGramDrafter(k=3, max_ngram=2)
    return SmallLMDrafter(drafter_lm, k=3)


@pytest.mark.parametrize("setting", list(SETTINGS))
@pytest.mark.parametrize("kind", ["small_lm", "ngram"])
def test_speculative_sampling_is_lossless(kind, setting, models):
    target, drafter_lm = models
    cfg = SETTINGS[setting]
    joint = exact_joint(target, cfg)
    counts = empirical_counts(target, make_drafter(kind, drafter_lm), cfg)
    assert chi_square_pvalue(counts, joint) > LEVEL


def _accept_always(draft, q, p, gen):
    k = int(draft.shape[0])
    return VerifyResult(k, int(torch.multinomial(p[k], 1, generator=gen)), True)


def _recover_from_p(draft, q, p, gen):
    """Rejection is right, but the recovered token comes from p instead of norm(max(0, p-q))."""
    k = int(draft.shape[0])
    rows = torch.arange(k)
    qx = torch.ones(k, dtype=p.dtype) if q is None else q[rows, draft]
    u = torch.rand(k, generator=gen, dtype=p.dtype)
    for i in range(k):
        if u[i] * qx[i] >= p[i, draft[i]]:
            return VerifyResult(i, int(torch.multinomial(p[i], 1, generator=gen)), False)
    return VerifyResult(k, int(torch.multinomial(p[k], 1, generator=gen)), True)


@pytest.mark.parametrize("broken", [_accept_always, _recover_from_p])
def test_broken_verifier_fails(broken, models, monkeypatch):
    target, drafter_lm = models
    cfg = SETTINGS["temperature"]
    joint = exact_joint(target, cfg)
    monkeypatch.setattr(decode_mod, "verify_chain_sampled", broken)
    counts = empirical_counts(target, SmallLMDrafter(drafter_lm, k=3), cfg)
    assert chi_square_pvalue(counts, joint) < LEVEL
