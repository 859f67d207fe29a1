"""Greedy speculative decoding returns exactly the autoregressive greedy tokens (float64)."""

import random

import pytest

from cascade import generate
from cascade.drafters import NGramDrafter, SmallLMDrafter


def _drafters(close, far):
    return {
        "ngram": lambda: NGramDrafter(k=4, max_ngram=3),
        "ngram_k1": lambda: NGramDrafter(k=1, max_ngram=1),
        "small_lm_close": lambda: SmallLMDrafter(close, k=4),
        "small_lm_close_k7_conf": lambda: SmallLMDrafter(close, k=7, stop_below=0.5),
        "small_lm_far": lambda: SmallLMDrafter(far, k=3),
    }


def _prompts(n, seed=0):
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        motif = [rng.randrange(32) for _ in range(rng.randint(1, 4))]
        out.append((motif * 6)[: rng.randint(1, 20)])  # repetitive: prompt lookup finds matches
    return out


@pytest.mark.parametrize("name", ["ngram", "ngram_k1", "small_lm_close", "small_lm_close_k7_conf", "small_lm_far"])
def test_greedy_equals_autoregressive(name, tiny_target, tiny_close_drafter, tiny_far_drafter):
    make = _drafters(tiny_close_drafter, tiny_far_drafter)[name]
    drafter = make()  # one drafter reused across generations: reset() must clear its state
    accepted = 0
    for i, prompt in enumerate(_prompts(12, seed=hash(name) % 1000)):
        for max_new in (1, 2, 5, 17, 40) if i < 3 else (23,):
            ar = generate(tiny_target, prompt, max_new_tokens=max_new, stop_on_eos=False)
            sp = generate(tiny_target, prompt, drafter=drafter, max_new_tokens=max_new, stop_on_eos=False)
            assert sp.tokens == ar.tokens, (prompt, max_new)
            assert len(sp.tokens) == max_new
            accepted += sum(s.accepted for s in sp.steps)
    assert accepted > 0, "the test must exercise accepted drafts"


@pytest.mark.parametrize("name", ["ngram", "small_lm_close"])
def test_eos_inside_a_draft(name, tiny_target, tiny_close_drafter, tiny_far_drafter):
    drafter = _drafters(tiny_close_drafter, tiny_far_drafter)[name]()
    hits_inside_draft = 0
    for prompt in _prompts(10, seed=3):
        ref = generate(tiny_target, prompt, max_new_tokens=30, stop_on_eos=False).tokens
        for pos in (3, 9, 20):
            eos = ref[pos]
            ar = generate(tiny_target, prompt, max_new_tokens=30, eos_token_id=eos)
            sp = generate(tiny_target, prompt, drafter=drafter, max_new_tokens=30, eos_token_id=eos)
            assert sp.tokens == ar.tokens
            assert sp.tokens[-1] == eos and sp.stop_reason == "eos"
            hits_inside_draft += any(eos in s.draft_tokens for s in sp.steps)
    assert hits_inside_draft > 0, "no case had EOS inside a draft"


def test_max_new_tokens_reached_mid_draft(tiny_target, tiny_close_drafter):
    drafter = SmallLMDrafter(tiny_close_drafter, k=8)
    for max_new in range(1, 12):
        ar = generate(tiny_target, [3, 4, 5], max_new_tokens=max_new, stop_on_eos=False)
        sp = generate(tiny_target, [3, 4, 5], drafter=drafter, max_new_tokens=max_new, stop_on_eos=False)
        assert sp.tokens == ar.tokens and len(sp.tokens) == max_new
        assert all(s.drafted <= 8 for s in sp.steps)
