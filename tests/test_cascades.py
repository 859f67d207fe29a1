"""Vertical and horizontal cascades: greedy equality (float64), statistical losslessness under
sampling, a lenient middle level that the test catches, and per-level statistics."""

import random

import pytest
import torch

from cascade import generate
from cascade.cascades import HorizontalCascade, VerticalCascade
from cascade.drafters import NGramDrafter, SmallLMDrafter
from cascade.models import perturbed_copy, tiny_llama
from cascade.types import SamplingConfig, VerifyResult
from cascade.verify import Verifier
from cascade.drafters.base import DraftStart
from stat_utils import LEVEL, lossless_pvalue


def _greedy_cascades(close, mid, far):
    return {
        "2level_lm_ngram": lambda: VerticalCascade([SmallLMDrafter(close, k=5), NGramDrafter(k=3)]),
        "2level_lm_lm": lambda: VerticalCascade([SmallLMDrafter(close, k=5), SmallLMDrafter(mid, k=2)]),
        "3level": lambda: VerticalCascade([SmallLMDrafter(close, k=6), SmallLMDrafter(mid, k=3), NGramDrafter(k=2)]),
        "horizontal": lambda: HorizontalCascade([(SmallLMDrafter(close, k=2), 2), (NGramDrafter(k=4), 3), (SmallLMDrafter(far, k=2), 1)]),
        "vertical_in_horizontal": lambda: HorizontalCascade(
            [(VerticalCascade([SmallLMDrafter(close, k=3), NGramDrafter(k=2)]), 3), (NGramDrafter(k=3), 2)]
        ),
        "horizontal_in_vertical": lambda: VerticalCascade(
            [SmallLMDrafter(close, k=5), HorizontalCascade([(SmallLMDrafter(mid, k=1), 1), (NGramDrafter(k=2), 2)])]
        ),
    }


@pytest.fixture(scope="module")
def lms(tiny_target):
    return perturbed_copy(tiny_target, 0.05, seed=1), perturbed_copy(tiny_target, 0.1, seed=2), tiny_llama(vocab_size=32, seed=7)


@pytest.mark.parametrize("name", list(_greedy_cascades(None, None, None)))
def test_cascade_greedy_equals_autoregressive(name, tiny_target, lms):
    drafter = _greedy_cascades(*lms)[name]()
    rng = random.Random(5)
    accepted = 0
    for _ in range(6):
        motif = [rng.randrange(32) for _ in range(rng.randint(1, 3))]
        prompt = (motif * 5)[: rng.randint(2, 12)]
        for max_new in (1, 4, 19):
            ar = generate(tiny_target, prompt, max_new_tokens=max_new, stop_on_eos=False)
            sp = generate(tiny_target, prompt, drafter=drafter, max_new_tokens=max_new, stop_on_eos=False)
            assert sp.tokens == ar.tokens, (prompt, max_new)
            accepted += sum(s.accepted for s in sp.steps)
    assert accepted > 0


def test_middle_level_output_is_its_own_greedy_output(tiny_target, lms):
    close, mid, _ = lms
    cascade = VerticalCascade([SmallLMDrafter(close, k=7), SmallLMDrafter(mid, k=3)])
    context = [3, 1, 4, 1, 5]
    cascade.start(DraftStart(tiny_target, None, context, SamplingConfig(), None))
    block = cascade.propose(context, 7)
    alone = generate(close, context, max_new_tokens=7, stop_on_eos=False)
    assert block.tokens.tolist() == alone.tokens and block.q is None
    assert block.cascade.lower[cascade.lower.name].drafted > 0


def test_cascade_records_per_level_alpha_and_c(tiny_target, lms):
    close, mid, _ = lms
    cascade = VerticalCascade([SmallLMDrafter(close, k=6), SmallLMDrafter(mid, k=3), NGramDrafter(k=2)])
    levels = generate(tiny_target, [1, 2, 3, 1, 2], drafter=cascade, max_new_tokens=30, stop_on_eos=False).summary().levels
    assert set(levels) == {cascade.top.name, cascade.lower.top.name, "ngram"}
    for stats in levels.values():
        assert 0.0 <= stats.alpha <= 1.0 and stats.c >= 0.0


# ---- sampling -----------------------------------------------------------------------------------
V = 6
N = 900
PROMPT = [1, 4, 1]


@pytest.fixture(scope="module")
def small_models():
    return [tiny_llama(vocab_size=V, seed=s, init_range=0.4) for s in (11, 12, 13, 14)]


def _sampled_cascades(mid, low, low2):
    return {
        "2level": lambda: VerticalCascade([SmallLMDrafter(mid, k=3), SmallLMDrafter(low, k=2)]),
        "3level": lambda: VerticalCascade([SmallLMDrafter(mid, k=3), SmallLMDrafter(low, k=2), NGramDrafter(k=1, max_ngram=2)]),
        "horizontal": lambda: HorizontalCascade([(SmallLMDrafter(mid, k=1), 1), (SmallLMDrafter(low2, k=2), 2)]),
        "combined": lambda: HorizontalCascade(
            [(VerticalCascade([SmallLMDrafter(mid, k=2), SmallLMDrafter(low, k=1)]), 1), (NGramDrafter(k=2, max_ngram=2), 2)]
        ),
    }


@pytest.mark.parametrize("name", ["2level", "3level", "horizontal", "combined"])
def test_cascade_sampling_is_lossless(name, small_models):
    target, mid, low, low2 = small_models
    cfg = SamplingConfig(temperature=1.0) if name != "3level" else SamplingConfig(temperature=1.5, top_p=0.9)
    assert lossless_pvalue(target, _sampled_cascades(mid, low, low2)[name](), cfg, PROMPT, N) > LEVEL


def _lenient_inner_verify(tokens, parents, q, p, gen):
    """A lenient middle level: keeps every token its drafter proposed."""
    k = len(tokens)
    return VerifyResult(k, int(torch.multinomial(p[k], 1, generator=gen)), True, list(range(k)))


def test_lenient_middle_level_fails(small_models):
    target, mid, low, _ = small_models
    cascade = VerticalCascade([SmallLMDrafter(mid, k=3), SmallLMDrafter(low, k=2)], verifier=Verifier(sampled=_lenient_inner_verify))
    assert lossless_pvalue(target, cascade, SamplingConfig(temperature=1.0), PROMPT, N) < LEVEL


def test_horizontal_cascade_records_per_segment_alpha(tiny_target, lms):
    close, _, far = lms
    first, second = SmallLMDrafter(close, k=2), SmallLMDrafter(far, k=3)
    cascade = HorizontalCascade([(first, 2), (second, 3)])
    out = generate(tiny_target, [1, 2, 3, 1, 2], drafter=cascade, max_new_tokens=30, stop_on_eos=False)
    levels = out.summary().levels
    assert set(levels) == {first.name, second.name}
    accepted = sum(s.accepted for s in out.steps)
    kept = sum(round(lv.alpha * lv.drafted) for lv in levels.values())
    assert kept == accepted and levels[first.name].alpha >= levels[second.name].alpha
