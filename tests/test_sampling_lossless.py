"""Statistical losslessness of chain speculative sampling, per drafter, under temperature,
top-k and top-p (tiny float64 models, vocabulary 6, 1,000 generations; see stat_utils), and a
deliberately broken verifier that fails the same test."""

import pytest
import torch

from cascade.drafters import NGramDrafter, SmallLMDrafter
from cascade.models import tiny_llama
from cascade.types import SamplingConfig, VerifyResult
from cascade.verify import Verifier
from stat_utils import LEVEL, lossless_pvalue

V = 6
N = 1000
PROMPT = [1, 4, 1]  # prompt lookup proposes [4, 1] after the final 1
SETTINGS = {
    "temperature": SamplingConfig(temperature=1.0),
    "top_k": SamplingConfig(temperature=1.5, top_k=3),
    "top_p": SamplingConfig(temperature=1.5, top_p=0.9),
}


@pytest.fixture(scope="module")
def models():
    return tiny_llama(vocab_size=V, seed=11, init_range=0.4), tiny_llama(vocab_size=V, seed=12, init_range=0.4)


def make_drafter(kind, drafter_lm):
    return NGramDrafter(k=3, max_ngram=2) if kind == "ngram" else SmallLMDrafter(drafter_lm, k=3)


@pytest.mark.parametrize("setting", list(SETTINGS))
@pytest.mark.parametrize("kind", ["small_lm", "ngram"])
def test_speculative_sampling_is_lossless(kind, setting, models):
    target, drafter_lm = models
    assert lossless_pvalue(target, make_drafter(kind, drafter_lm), SETTINGS[setting], PROMPT, N) > LEVEL


def _accept_always(tokens, parents, q, p, gen):
    k = len(tokens)
    return VerifyResult(k, int(torch.multinomial(p[k], 1, generator=gen)), True, list(range(k)))


def _recover_from_p(tokens, parents, q, p, gen):
    """Rejection is right, but the recovered token comes from p instead of norm(max(0, p-q))."""
    draft = torch.tensor(tokens)
    k = len(tokens)
    qx = torch.ones(k, dtype=p.dtype) if q is None else q[torch.arange(k), draft]
    u = torch.rand(k, generator=gen, dtype=p.dtype)
    for i in range(k):
        if u[i] * qx[i] >= p[i, draft[i]]:
            return VerifyResult(i, int(torch.multinomial(p[i], 1, generator=gen)), False, list(range(i)))
    return VerifyResult(k, int(torch.multinomial(p[k], 1, generator=gen)), True, list(range(k)))


@pytest.mark.parametrize("broken", [_accept_always, _recover_from_p])
def test_broken_verifier_fails(broken, models):
    target, drafter_lm = models
    verifier = Verifier(sampled=broken)
    assert lossless_pvalue(target, SmallLMDrafter(drafter_lm, k=3), SETTINGS["temperature"], PROMPT, N, verifier=verifier) < LEVEL
