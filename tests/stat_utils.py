"""Shared machinery of the statistical losslessness tests.

The joint distribution of the first two generated tokens under speculative sampling is compared
with the target's exact joint p(x1) * p(x2 | x1) (after the same temperature / top-k / top-p
processing) by a chi-square goodness-of-fit test. Seeds are fixed, so each test's outcome is
deterministic; the level is 1e-3.
"""

import numpy as np
import torch
from scipy.stats import chisquare

from cascade import generate
from cascade.types import SamplingConfig
from cascade.verify import EXACT, Verifier

LEVEL = 1e-3


def exact_joint(target, cfg: SamplingConfig, prompt: list[int]) -> np.ndarray:
    """[V, V] the target's exact law of its first two sampled tokens, from the deep harness's
    independent reference (the Hugging Face module's own uncached forward and transformers'
    warpers; never ``cascade.sampling`` or ``CausalLM.forward``)."""
    from deep_stats import exact_law  # (deep_stats imports this module's chi-square)

    return exact_law(target.model, prompt, 2, cfg.temperature, cfg.top_k, cfg.top_p)


def empirical_counts(target, drafter, cfg: SamplingConfig, prompt: list[int], n: int, seed: int = 1234,
                     verifier: Verifier = EXACT) -> np.ndarray:
    """Alternates max_new_tokens=2 (one draft position, so the second token is often the bonus
    token) and 3 (two: accepted, or recovered at either position). Both are lossless, so the
    pooled counts follow the same joint distribution."""
    V = target.vocab_size
    counts = np.zeros((V, V))
    gen = torch.Generator().manual_seed(seed)
    for i in range(n):
        out = generate(
            target, prompt, drafter=drafter, max_new_tokens=2 + i % 2, sampling=cfg, generator=gen, stop_on_eos=False, verifier=verifier,
        )
        counts[out.tokens[0], out.tokens[1]] += 1
    return counts


def chi_square_pvalue(counts: np.ndarray, joint: np.ndarray) -> float:
    """Cells with expected count < 5 are pooled into one; any count in a zero-probability cell
    gives p = 0."""
    expected = joint.ravel() * counts.sum()
    observed = counts.ravel()
    if observed[expected == 0].sum() > 0:
        return 0.0
    big = expected >= 5
    small = ~big & (expected > 0)
    obs = np.append(observed[big], observed[small].sum())
    exp = np.append(expected[big], expected[small].sum())
    keep = exp > 0
    if keep.sum() < 2:  # everything in one cell: nothing to compare (and no count outside it)
        return 1.0
    return float(chisquare(obs[keep], exp[keep]).pvalue)


def lossless_pvalue(target, drafter, cfg: SamplingConfig, prompt: list[int], n: int, verifier: Verifier = EXACT) -> float:
    joint = exact_joint(target, cfg, prompt)
    # A near-deterministic joint (e.g. a tight top-p) would make the test unable to fail.
    assert (joint > 0.01).sum() >= 4, f"degenerate test setting {cfg}: {(joint > 0.01).sum()} likely cells"
    return chi_square_pvalue(empirical_counts(target, drafter, cfg, prompt, n, verifier=verifier), joint)
