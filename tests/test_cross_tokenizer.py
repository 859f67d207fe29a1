"""Cross-tokenizer drafting (cascade.drafters.cross_tokenizer): the vocabulary bridge, greedy
equality in every role on float64 tiny models with two different byte-level BPE tokenizers, deep
chi-square tests of the sampled rules with a broken double caught, refusals, and (-m slow) the
real pair SmolLM2-135M -> Qwen2.5-Coder-1.5B."""

import pytest
import torch
from tokenizers import Tokenizer
from tokenizers import models as token_models
from transformers import PreTrainedTokenizerFast

from broken_doubles import UnrenormalisedIntersectionDrafter
from cascade import generate
from cascade.cascades import HorizontalCascade, VerticalCascade
from cascade.drafters import ConfidenceStop, NGramDrafter, SmallLMDrafter, ThompsonStop, TokenRecyclingDrafter
from cascade.drafters.cross_tokenizer import CrossTokenizerDrafter
from cascade.models.vocabulary import ByteVocabulary, VocabularyBridge, complete_utf8_prefix
from cascade.models import CausalLM, perturbed_copy, tiny_llama
from cascade.models.tiny import text_aligned_copy, tiny_bpe_tokenizer
from cascade.trees.drafter import TreeDrafter
from cascade.trees import DynamicTreePolicy, RerankedTreePolicy, StaticTreePolicy
from cascade.types import SamplingConfig
from deep_stats import LEVEL, exact_law, lossless_pvalue, sample_outputs

# ---- the bridge ---------------------------------------------------------------------------------


def test_bytes_and_encoding_round_trip_on_byte_level_tokenizers():
    tok = tiny_bpe_tokenizer(300, seed=0)
    vocab = ByteVocabulary.of_tokenizer(tok)
    text = "def fibonacci(n):\n    return n  # 中文 ok".encode()
    ids = vocab.encode(text)
    assert vocab.bytes_of(ids) == text
    assert ids == tok(text.decode(), add_special_tokens=False)["input_ids"]
    # bytes that are not UTF-8 (a byte-level model may emit any byte) encode byte by byte
    odd = b"ab\xff\xfe cd\xe4\xb8"
    assert vocab.bytes_of(vocab.encode(odd)) == odd


def test_complete_utf8_prefix_drops_only_an_unfinished_character():
    data = "a中b€".encode()
    assert [complete_utf8_prefix(data[:i]) for i in range(len(data) + 1)] == [
        b"", b"a", b"a", b"a", "a中".encode(), "a中b".encode(), "a中b".encode(), "a中b".encode(), data]


def test_bridge_maps_shared_tokens_and_masks_the_rest():
    a, b = tiny_bpe_tokenizer(300, seed=0), tiny_bpe_tokenizer(296, seed=1)
    va, vb = ByteVocabulary.of_tokenizer(a), ByteVocabulary.of_tokenizer(b)
    bridge = VocabularyBridge(va, vb)
    # every drafter token is a target token here (296 merges are a prefix of 300's), 4 target tokens are not shared
    assert bridge.shared == 296
    for t, d in zip(bridge.target_ids.tolist(), bridge.drafter_ids.tolist()):
        assert va.token_bytes[t] == vb.token_bytes[d]
    assert bridge.target_ids.tolist() != bridge.drafter_ids.tolist()  # the same strings under other ids
    logits = torch.randn(3, len(b), dtype=torch.float64)
    mapped = bridge.target_logits(logits)  # [3, 300]
    assert mapped.shape == (3, len(a))
    assert torch.equal(mapped[:, bridge.target_ids], logits[:, bridge.drafter_ids])
    outside = torch.ones(len(a), dtype=torch.bool)
    outside[bridge.target_ids] = False
    assert outside.sum() == 4 and torch.isinf(mapped[:, outside]).all()
    q = torch.softmax(mapped, -1)  # the restricted, renormalised distribution
    torch.testing.assert_close(q[:, bridge.target_ids], torch.softmax(logits[:, bridge.drafter_ids], -1))


def test_special_tokens_match_only_special_tokens():
    base = {"a": 0, "b": 1, "<s>": 2}
    plain = PreTrainedTokenizerFast(tokenizer_object=Tokenizer(token_models.BPE(vocab=dict(base), merges=[])))
    special = PreTrainedTokenizerFast(tokenizer_object=Tokenizer(token_models.BPE(vocab={"b": 0, "a": 1}, merges=[])))
    special.add_special_tokens({"additional_special_tokens": ["<s>"]})
    bridge = VocabularyBridge(ByteVocabulary.of_tokenizer(plain), ByteVocabulary.of_tokenizer(special))
    assert bridge.drafter_of_target == {0: 1, 1: 0}  # "<s>" is text in one, a special token in the other


def test_target_continuation_aligns_with_the_context_tail():
    tok = tiny_bpe_tokenizer(300, seed=0)
    va = ByteVocabulary.of_tokenizer(tok)
    bridge = VocabularyBridge(va, ByteVocabulary.of_tokenizer(tiny_bpe_tokenizer(296, seed=1)))
    context = va.encode(b"def fibonacci(n):\n   ")
    whole = va.encode(b"def fibonacci(n):\n    return n")
    # the draft's text continues the context: the ids after the context's tail are the whole text's
    assert context + bridge.target_continuation(context, b" return n") == whole
    assert bridge.target_continuation(context, b"") == []


def test_non_byte_level_tokenizers_are_refused():
    wordpiece = PreTrainedTokenizerFast(tokenizer_object=Tokenizer(token_models.WordPiece(
        vocab={"[UNK]": 0, "ab": 1, "##c": 2}, unk_token="[UNK]")))
    with pytest.raises(ValueError, match="not byte-level BPE"):
        ByteVocabulary.of_tokenizer(wordpiece)
    with pytest.raises(ValueError, match="no tokenizer and 64 < 256"):
        ByteVocabulary.of_model(tiny_llama(vocab_size=64))
    with pytest.raises(ValueError, match="rule must be one of"):
        CrossTokenizerDrafter(tiny_llama(vocab_size=256), rule="fuzzy")


def test_a_drafter_that_shares_no_token_is_refused():
    only_x = PreTrainedTokenizerFast(tokenizer_object=Tokenizer(token_models.BPE(vocab={"x": 0, "y": 1}, merges=[])))
    only_a = PreTrainedTokenizerFast(tokenizer_object=Tokenizer(token_models.BPE(vocab={"a": 0, "b": 1}, merges=[])))
    target = CausalLM(tiny_llama(vocab_size=2).model, only_a, "ab")
    drafter = CrossTokenizerDrafter(CausalLM(tiny_llama(vocab_size=2, seed=1).model, only_x, "xy"))
    with pytest.raises(ValueError, match="share no token"):
        generate(target, [0, 1], drafter=drafter, max_new_tokens=2)


# ---- greedy equality: every role -----------------------------------------------------------------


@pytest.fixture(scope="module")
def bpe_pair():
    """A float64 target with a 300-token BPE tokenizer; drafters with 296- and 304-token ones
    (fewer / more merges, ids shuffled), close to the target on the text they share."""
    target = tiny_llama(tokenizer=tiny_bpe_tokenizer(300, seed=0), num_layers=2, seed=0, init_range=0.25)
    fewer = text_aligned_copy(target, tiny_bpe_tokenizer(296, seed=1), noise=0.05, seed=3, name="drafter-296")
    more = text_aligned_copy(target, tiny_bpe_tokenizer(304, seed=2), noise=0.05, seed=4, name="drafter-304")
    same = text_aligned_copy(target, target.tokenizer, noise=0.05, seed=5, name="same-vocab")
    return target, fewer, more, same


PROMPTS = ["def fibonacci(n):\n    return", "The quick brown fox", "for i in range(10):\n"]


def _roles(fewer, more, same):
    dytc = dict(t_min=0.05, max_nodes=16, max_depth=5, max_rank=2, prior_drafter_cost=0.01,
                prior_verify_slope=0.005, measure_costs=False)
    return {
        "chain_string": lambda: CrossTokenizerDrafter(fewer, k=4, rule="string"),
        "chain_string_more_merges": lambda: CrossTokenizerDrafter(more, k=5, rule="string"),
        "chain_intersection": lambda: CrossTokenizerDrafter(fewer, k=4, rule="intersection"),
        "chain_confidence_stop": lambda: CrossTokenizerDrafter(more, k=6, stop=ConfidenceStop(0.3)),
        "chain_thompson_stop": lambda: CrossTokenizerDrafter(fewer, k=6, stop=ThompsonStop(0.3)),
        "cascade_lower": lambda: VerticalCascade([SmallLMDrafter(same, k=6), CrossTokenizerDrafter(fewer, k=3)]),
        "cascade_top": lambda: VerticalCascade([CrossTokenizerDrafter(more, k=6), NGramDrafter(k=3)]),
        "cascade_three_levels": lambda: VerticalCascade([SmallLMDrafter(same, k=6), CrossTokenizerDrafter(more, k=4),
                                                          NGramDrafter(k=2)]),
        "horizontal": lambda: HorizontalCascade([(CrossTokenizerDrafter(fewer, k=3), 3), (NGramDrafter(k=2), 2)]),
        "static_tree": lambda: TreeDrafter([CrossTokenizerDrafter(more)], StaticTreePolicy((2, 2, 1, 1))),
        "reranked_tree": lambda: TreeDrafter([CrossTokenizerDrafter(fewer)], RerankedTreePolicy(top_k=2, depth=4, max_nodes=10)),
        "dytc": lambda: TreeDrafter([SmallLMDrafter(same), CrossTokenizerDrafter(fewer), NGramDrafter(k=1),
                                     TokenRecyclingDrafter(r=2, k=1)], DynamicTreePolicy(**dytc)),
    }


@pytest.mark.parametrize("role", list(_roles(None, None, None)))
def test_greedy_equals_autoregressive_in_every_role(role, bpe_pair):
    target, fewer, more, same = bpe_pair
    make = _roles(fewer, more, same)[role]
    drafter = make()
    accepted = drafted = 0
    for text in PROMPTS:
        ids = target.tokenizer(text, add_special_tokens=False)["input_ids"]
        ar = generate(target, ids, max_new_tokens=32)
        sp = generate(target, ids, drafter=drafter, max_new_tokens=32)
        assert sp.tokens == ar.tokens, (role, text)
        accepted += sum(s.accepted for s in sp.steps)
        drafted += sum(s.drafted for s in sp.steps)
    assert accepted >= 10 and drafted > accepted, (role, accepted, drafted)  # drafts are judged both ways


def test_string_match_reports_what_re_tokenization_lost(bpe_pair):
    target, fewer, more, _ = bpe_pair
    drafter = CrossTokenizerDrafter(more, k=5)  # greedy: auto -> string-level match
    ids = target.tokenizer(PROMPTS[0], add_special_tokens=False)["input_ids"]
    generate(target, ids, drafter=drafter, max_new_tokens=32)
    r = drafter.describe().retokenization
    assert r.drafts > 0 and r.drafted > 0 and r.proposed > 0 and r.shared_rows == 0
    assert 0 <= r.lost_bytes_frac < 1
    sampled = CrossTokenizerDrafter(fewer, k=4)  # sampling: auto -> the intersection
    generate(target, ids, drafter=sampled, max_new_tokens=16, sampling=SamplingConfig(temperature=1.0), seed=0)
    r = sampled.describe().retokenization
    assert r.drafted == r.proposed > 0 and r.drafted_bytes == 0 and 0 < r.mean_shared_mass <= 1


def test_byte_id_targets_take_drafters_with_a_tokenizer():
    """A target without a tokenizer (ids are bytes, the tiny:SEED convention) and a BPE drafter."""
    target = tiny_llama(vocab_size=256, num_layers=2, seed=0)
    drafter = CrossTokenizerDrafter(tiny_llama(tokenizer=tiny_bpe_tokenizer(320, seed=1), num_layers=2, seed=1), k=4)
    ids = list(b"def f(x):")
    assert generate(target, ids, drafter=drafter, max_new_tokens=16).tokens == generate(target, ids, max_new_tokens=16).tokens


# ---- sampling: deep chi-square against the exact law ---------------------------------------------
# The deep suite's damped float64 target (V = 5) given a character BPE tokenizer
# {a, b, c, ab, ca}; the drafter's tokenizer {c, ab, a, cc, b} lacks "ca" (a target token outside
# the intersection, fed to the drafter as "c", "a") and has "cc" (mass the intersection removes).

L = 6
PROMPT = [1, 4, 1, 4]
N = 1000
SETTINGS = {"temperature": dict(temperature=1.0), "top_k": dict(temperature=1.5, top_k=3),
            "top_p": dict(temperature=1.5, top_p=0.9)}
_laws: dict = {}


def _char_bpe(vocab, merges):
    return PreTrainedTokenizerFast(tokenizer_object=Tokenizer(token_models.BPE(vocab=vocab, merges=merges)))


def build_char_pair():
    """(target, cross-tokenizer drafter model, same-vocabulary close drafter) of the deep cells:
    the damped V=5 target under a char BPE tokenizer, the drafter's tokenizer lacking one target
    token and adding one of its own."""
    from test_lossless_deep import damped

    base = damped()
    target = CausalLM(base.model, _char_bpe({"a": 0, "b": 1, "c": 2, "ab": 3, "ca": 4}, [("a", "b"), ("c", "a")]), "damped-abc")
    drafter_lm = text_aligned_copy(target, _char_bpe({"c": 0, "ab": 1, "a": 2, "cc": 3, "b": 4}, [("a", "b"), ("c", "c")]),
                                   noise=0.2, seed=3, name="damped-as-abcc")
    close = CausalLM(perturbed_copy(base, 0.35, seed=3).model, target.tokenizer, "damped-close")  # same vocabulary
    return target, drafter_lm, close


@pytest.fixture(scope="module")
def char_pair():
    return build_char_pair()


def _pvalue(target, make, setting, seed=0):
    if setting not in _laws:
        _laws[setting] = exact_law(target.model, PROMPT, L, **SETTINGS[setting])
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        samples = sample_outputs(target, make, PROMPT, L, N, seed, SETTINGS[setting])
    finally:
        torch.set_num_threads(threads)
    return samples, lossless_pvalue(samples, _laws[setting])


def _deep_methods(drafter_lm, close):
    dytc = dict(t_min=0.02, max_nodes=24, max_depth=5, max_rank=1, prior_drafter_cost=0.01,
                prior_verify_slope=0.005, measure_costs=False)
    return {
        "chain_intersection": (lambda: CrossTokenizerDrafter(drafter_lm, k=5), 4),
        "chain_string": (lambda: CrossTokenizerDrafter(drafter_lm, k=5, rule="string"), 2),
        "cascade_lower": (lambda: VerticalCascade([SmallLMDrafter(close, k=5), CrossTokenizerDrafter(drafter_lm, k=2)]), 4),
        "static_tree": (lambda: TreeDrafter([CrossTokenizerDrafter(drafter_lm)], StaticTreePolicy((2, 2, 1, 1))), 3),
        "dytc": (lambda: TreeDrafter([CrossTokenizerDrafter(drafter_lm), SmallLMDrafter(close), NGramDrafter(k=1)],
                                     DynamicTreePolicy(**dytc)), 4),
    }


DEEP_CELLS = [("chain_intersection", "temperature"), ("chain_intersection", "top_k"), ("chain_intersection", "top_p"),
              ("chain_string", "top_p"), ("cascade_lower", "top_k"), ("static_tree", "temperature"), ("dytc", "top_p")]


@pytest.mark.parametrize("method,setting", DEEP_CELLS)
def test_sampled_cross_tokenizer_drafting_is_lossless(method, setting, char_pair):
    target, drafter_lm, close = char_pair
    make, depth = _deep_methods(drafter_lm, close)[method]
    samples, p = _pvalue(target, make, setting)
    report = f"{method}/{setting}: p={p:.2g}; {samples.depth_report()}"
    assert samples.exercised(depth, 20), "the test does not exercise deep drafts: " + report
    assert p > LEVEL, report


def test_intersection_q_not_renormalised_is_caught(char_pair):
    target, drafter_lm, _ = char_pair
    samples, p = _pvalue(target, lambda: UnrenormalisedIntersectionDrafter(drafter_lm, k=5), "temperature")
    assert p < LEVEL, f"the unrenormalised intersection passed: p={p:.2g}; {samples.depth_report()}"


# ---- the real pair ------------------------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.real
def test_smollm_drafts_for_qwen_greedy_equals_autoregressive():
    """SmolLM2-135M (49k vocabulary) drafting for Qwen2.5-Coder-1.5B (152k) on the native backend
    (row-invariant: no near-tie allowance): chain (string-level match), the intersection chain, a
    cascade under the 0.5B and DyTC with the 0.5B and prompt lookup; every output equals
    autoregressive decoding, and drafts are accepted."""
    from cascade import load_model
    from cascade.data import BUILTIN, encode_prompt

    target = load_model("qwen2.5-coder-1.5b")
    smol, small = load_model("smollm2-135m"), load_model("qwen2.5-coder-0.5b")
    makers = {
        "chain": lambda: CrossTokenizerDrafter(smol, k=6),
        "chain_intersection": lambda: CrossTokenizerDrafter(smol, k=6, rule="intersection"),
        "cascade": lambda: VerticalCascade([SmallLMDrafter(small, k=6), CrossTokenizerDrafter(smol, k=3)]),
        "dytc": lambda: TreeDrafter([SmallLMDrafter(small), CrossTokenizerDrafter(smol), NGramDrafter(k=1)],
                                    DynamicTreePolicy(calibrate=False)),
    }
    for kind, make in makers.items():
        drafter, accepted = make(), 0
        for prompt in BUILTIN[:2]:
            ids = encode_prompt(target, prompt.text)
            ar = generate(target, ids, max_new_tokens=24)
            sp = generate(target, ids, drafter=drafter, max_new_tokens=24)
            assert sp.tokens == ar.tokens, (kind, prompt.id)
            accepted += sum(s.accepted for s in sp.steps)
        assert accepted > 0, kind
