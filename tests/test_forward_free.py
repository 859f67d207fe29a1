"""Forward-free drafters (Token Recycling, suffix lookup) and the multi-category prompt sets.

Greedy equality on float64 tiny models for each drafter alone, as a cascade level and in trees;
their tables / datastores against naive references. The sampled-law tests are in
test_lossless_deep.py (methods chain_recycling, tree_recycling, vertical_recycling, ...).
"""

import random

import numpy as np
import pytest
import torch

from cascade import generate
from cascade.cascades import HorizontalCascade, VerticalCascade
from cascade.data import DataError, DataFile, Prompt, load_prompts, mixed
from cascade.drafters import Datastore, SmallLMDrafter, SuffixDrafter, TokenRecyclingDrafter
from cascade.drafters.recycling import UNKNOWN
from cascade.drafters.suffix import SEP, suffix_array
from cascade.trees.drafter import TreeDrafter
from cascade.trees import DynamicTreePolicy
from cascade.types import Scored, VerifyResult
from cascade.drafters.base import Outcome


def _prompts(n, seed=0):
    rng = random.Random(seed)
    return [[rng.randrange(32) for _ in range(rng.randint(1, 12))] for _ in range(n)]  # tiny vocabulary: 32


# ---- Token Recycling --------------------------------------------------------------------------
def test_recycling_table_is_the_verifiers_top_r():
    d = TokenRecyclingDrafter(r=3, k=2, vocab_size=10)
    logits = torch.randn(3, 10, dtype=torch.float64)
    d.observe(Outcome([0], VerifyResult(0, 1, False), scored=Scored([4, 7, 4], logits)))
    want = torch.topk(logits, 3, -1)
    assert d.table[7].tolist() == want.indices[1].tolist()
    assert d.table[4].tolist() == want.indices[2].tolist()  # a repeated input: the last row wins
    torch.testing.assert_close(d.probs[7], torch.softmax(logits[1], -1)[want.indices[1]].float())
    assert (d.table[[0, 1, 2, 3, 5, 6, 8, 9]] == UNKNOWN).all()
    d.observe(Outcome([0], VerifyResult(0, 1, False), scored=None))  # nothing to learn from: unchanged
    assert d.filled == 2


def test_recycling_chain_tree_and_min_prob_read_the_table():
    d = TokenRecyclingDrafter(r=2, tree=(2, 1), vocab_size=6)
    d.table[0] = torch.tensor([1, 2])
    d.probs[0] = torch.tensor([0.6, 0.3])
    d.table[1] = torch.tensor([3, 4])
    d.probs[1] = torch.tensor([0.9, 0.05])
    block = d.propose([5, 0], budget=4)
    assert block.tokens.tolist() == [1, 2, 3] and block.parents == [-1, -1, 0] and block.q is None
    assert d.propose([5, 0], budget=1).tokens.tolist() == [1, 2]  # depth within the budget
    d.min_prob = 0.5  # 0.3 (second child) and 0.6 * 0.9 = 0.54 >= 0.5: kept; stops below
    assert d.propose([0], budget=4).tokens.tolist() == [1, 3]
    chain = TokenRecyclingDrafter(r=2, k=5, vocab_size=6)
    chain.table, chain.probs = d.table, d.probs
    assert chain.propose([0], budget=5).tokens.tolist() == [1, 3]  # row 3 unknown: the path ends


def test_recycling_table_persists_saves_and_loads(tmp_path, tiny_target):
    d = TokenRecyclingDrafter(r=4, k=3)
    generate(tiny_target, [1, 2, 3], drafter=d, max_new_tokens=10)
    filled = d.filled
    assert filled >= 5
    generate(tiny_target, [7], drafter=d, max_new_tokens=2)  # a new generation keeps the table
    assert d.filled >= filled
    d.save(tmp_path / "t.pt")
    e = TokenRecyclingDrafter(r=2, k=3, table=str(tmp_path / "t.pt"))
    assert torch.equal(e.table, d.table[:, :2])
    with pytest.raises(ValueError, match="r=8"):
        TokenRecyclingDrafter(r=8, table=str(tmp_path / "t.pt"))
    with pytest.raises(FileNotFoundError):
        TokenRecyclingDrafter(table=str(tmp_path / "absent.pt"))
    with pytest.raises(ValueError, match="vocabulary"):
        TokenRecyclingDrafter(vocab_size=7).check_compatible(tiny_target)
    for bad in (dict(r=0), dict(k=0), dict(r=2, tree=(3,)), dict(min_prob=1.0)):
        with pytest.raises(ValueError):
            TokenRecyclingDrafter(**bad)


# ---- suffix lookup ------------------------------------------------------------------------------
def test_suffix_array_and_matches_equal_naive():
    rng = np.random.default_rng(0)
    for _ in range(40):
        docs = [rng.integers(0, 4, size=rng.integers(1, 30)).tolist() for _ in range(rng.integers(1, 4))]
        store = Datastore.build(docs)
        toks = store.tokens.tolist()
        assert store.sa.tolist() == sorted(range(len(toks)), key=lambda i: toks[i:])
        for m in (1, 2, 3):
            pattern = rng.integers(0, 4, size=m).tolist()
            lo, hi = store.matches(pattern)
            want = sorted(i for i in range(len(toks)) if toks[i : i + m] == pattern)
            assert sorted(store.sa[lo:hi].tolist()) == want


def test_suffix_continuation_is_the_majority_path_and_stops_at_documents():
    store = Datastore.build([[1, 2, 3, 4], [1, 2, 3, 5, 6], [1, 2, 3, 5, 7], [9, 1, 2]])
    # [1, 2] is followed by 3, 3, 3, SEP: 3; then 4, 5, 5: 5; then 6, 7 (a tie: the first in
    # suffix order, 6); then SEP ends it
    assert store.continuation([1, 2], 5, 64) == [3, 5, 6]
    assert store.continuation([9, 1, 2], 5, 64) == []  # the document ends: nothing crosses SEP
    assert store.continuation([8], 5, 64) == []
    assert SEP not in store.continuation([3], 9, 64)


def test_suffix_drafter_prefers_the_longer_match_and_caches(tmp_path):
    store = Datastore.build([[5, 6, 7, 8, 9]])
    d = SuffixDrafter(store, k=4, min_ngram=1)
    assert d.propose([1, 6, 2, 5, 6], 4).tokens.tolist() == [7, 8, 9]  # datastore match of 2 beats context's 1
    assert d.propose([5, 1, 5], 4).tokens.tolist() == [1, 5]  # context match of 1 (tie: the context)
    assert SuffixDrafter(store, k=4, min_ngram=1, context=False).propose([5, 1, 5], 4).tokens.tolist() == [6, 7, 8, 9]
    built = []
    a = Datastore.cached("k", lambda: built.append(1) or [[1, 2, 3]], tmp_path)
    b = Datastore.cached("k", lambda: built.append(1) or [[9]], tmp_path)  # read from disk, not rebuilt
    assert built == [1] and b.tokens.tolist() == a.tokens.tolist() == [1, 2, 3, SEP]
    with pytest.raises(ValueError):
        SuffixDrafter(None, context=False)


def test_corpus_datastore_tokenizes_with_the_target(tmp_path, monkeypatch, tiny_target):
    """A corpus is tokenized with the target (bytes, for a tiny model), cached, and refused for a
    model that cannot tokenize text."""
    import cascade.data
    import cascade.models.zoo as zoo
    from cascade.models import tiny_llama

    monkeypatch.setattr(cascade.data, "corpus", lambda name: ["def f(x):\n    return x\n", "def g(y):\n    return y\n"])
    real_root = zoo.cache_root
    monkeypatch.setattr(zoo, "cache_root", lambda: tmp_path)
    big = tiny_llama(vocab_size=256, num_layers=1, seed=0)
    d = SuffixDrafter(corpus=["two_functions"], k=6, context=False)
    d.check_compatible(big)
    assert list((tmp_path / "datastores").glob("two_functions-*.npz"))
    assert bytes(d.propose(list(b"def g(y):\n    ret"), 6).tokens.tolist()) == b"urn y\n"
    with pytest.raises(ValueError, match="no tokenizer"):
        SuffixDrafter(corpus=["two_functions"]).check_compatible(tiny_target)  # vocabulary 64 < 256
    monkeypatch.setattr(zoo, "cache_root", real_root)


# ---- greedy equality ----------------------------------------------------------------------------
def _store(target, n=30, seed=0):
    """A datastore of the target's own continuations (so lookups are often accepted)."""
    return Datastore.build(generate(target, p, max_new_tokens=12, stop_on_eos=False).tokens for p in _prompts(n, seed + 100))


def _methods(target, close):
    return {
        "recycling_chain": lambda: TokenRecyclingDrafter(r=4, k=4),
        "recycling_tree": lambda: TokenRecyclingDrafter(r=4, tree=(3, 2, 1)),
        "recycling_min_prob": lambda: TokenRecyclingDrafter(r=4, k=6, min_prob=0.05),
        "suffix": lambda: SuffixDrafter(_store(target), k=5, min_ngram=1),
        "vertical_lm_recycling": lambda: VerticalCascade([SmallLMDrafter(close, k=5), TokenRecyclingDrafter(r=4, k=2)]),
        "vertical_lm_suffix": lambda: VerticalCascade([SmallLMDrafter(close, k=5), SuffixDrafter(_store(target), k=2, min_ngram=1)]),
        "horizontal_recycling_lm": lambda: HorizontalCascade([(TokenRecyclingDrafter(r=4, k=2), 2), (SmallLMDrafter(close, k=3), 3)]),
        "dytc_lm_recycling_suffix": lambda: TreeDrafter(
            [SmallLMDrafter(close), TokenRecyclingDrafter(r=4, k=1), SuffixDrafter(_store(target), k=1, min_ngram=1)],
            DynamicTreePolicy(t_min=0.05, max_nodes=12, max_depth=5, max_rank=2, measure_costs=False)),
    }


@pytest.mark.parametrize("name", list(_methods(None, None)))
def test_greedy_equals_autoregressive(name, tiny_target, tiny_close_drafter):
    drafter = _methods(tiny_target, tiny_close_drafter)[name]()  # one drafter reused: tables persist
    accepted, by_self = 0, 0
    for i, prompt in enumerate(_prompts(10, seed=len(name))):
        for max_new in (1, 4, 17, 40) if i < 3 else (25,):
            ar = generate(tiny_target, prompt, max_new_tokens=max_new, stop_on_eos=False)
            sp = generate(tiny_target, prompt, drafter=drafter, max_new_tokens=max_new, stop_on_eos=False)
            assert sp.tokens == ar.tokens, (prompt, max_new)
            accepted += sum(s.accepted for s in sp.steps)
            by_self += sum(s.accepted for s in sp.steps if s.tree is None or any(
                "recycling" in n or "suffix" in n for n in s.tree.node_drafters))
    assert accepted > 0 and by_self > 0, "the test must exercise accepted drafts"


def test_cascade_level_recycling_learns_from_the_level_above(tiny_target, tiny_close_drafter):
    """As a lower level, Token Recycling is handed its verifier's forward: the small LM's logits
    over [last] + its draft (not the target's), and its table rows are their top-r."""
    low = TokenRecyclingDrafter(r=2, k=2)
    seen = []
    original = low.observe

    def spy(outcome):
        seen.append((list(outcome.context), outcome.result.num_accepted, outcome.scored))
        original(outcome)

    low.observe = spy
    casc = VerticalCascade([SmallLMDrafter(tiny_close_drafter, k=4), low])
    generate(tiny_target, [3, 1, 4, 1, 5], drafter=casc, max_new_tokens=30, stop_on_eos=False)
    assert len(seen) >= 5 and any(len(s.inputs) > 1 for _, _, s in seen)
    for context, accepted, scored in seen:
        ctx = context[: len(context) - accepted - 1]
        assert scored.inputs[0] == ctx[-1]
        full = ctx + scored.inputs[1:]
        want = tiny_close_drafter.forward(full, tiny_close_drafter.new_cache())[len(ctx) - 1 :]  # [n+1, V]
        torch.testing.assert_close(scored.logits.double(), want.double(), atol=1e-9, rtol=0)
        assert not torch.allclose(want.double(), tiny_target.forward(full, tiny_target.new_cache())[len(ctx) - 1 :].double())
    last = seen[-1][2]
    assert low.table[last.inputs[-1]].tolist() == torch.topk(last.logits[-1], 2).indices.tolist()


# ---- prompt sets --------------------------------------------------------------------------------
def test_mixed_set_has_every_category_round_robin():
    ps = mixed(2)
    cats = list(dict.fromkeys(p.category for p in ps))
    assert len(cats) == 11 and len(ps) == 22
    assert {c for c in cats if c.startswith("mtbench/")} == {f"mtbench/{c}" for c in (
        "writing", "roleplay", "reasoning", "math", "coding", "extraction", "stem", "humanities")}
    assert [p.category for p in ps[:11]] == cats  # round-robin: every category before any repeats
    assert all(p.chat is (p.category != "code") for p in ps)  # HumanEval is completed as raw code
    assert load_prompts("mixed", num_prompts=5, per_category=1) == ps[:5]
    assert len(load_prompts("mtbench")) == 80 and len(load_prompts("gpqa")) == 198


def test_prompt_files_are_checksummed(monkeypatch):
    import cascade.data as data

    bad = DataFile(data._MTBENCH.part, data._MTBENCH.size, "0" * 64)
    monkeypatch.setattr(data, "_MTBENCH", bad)
    with pytest.raises(DataError, match="sha256"):
        data.mtbench()


def test_run_summary_has_per_category_results(tmp_path):
    from test_experiments import _cfg

    from cascade.run import run

    path = tmp_path / "p.jsonl"
    path.write_text('{"prompt": "abc abc", "category": "x"}\n{"prompt": "def", "category": "y"}\n{"prompt": "abd", "category": "x"}\n')
    cfg = _cfg("+experiment=token_recycling", "debug=tiny", "dataset.name=jsonl", f"dataset.path={path}", "dataset.max_new_tokens=6",
               "dataset.chat_template=false", "dataset.num_prompts=null", f"output_dir={tmp_path / 'out'}", "progress=false")
    summary = run(cfg)
    cats = summary.methods["token_recycling"].by_category
    assert list(cats) == ["x", "y"] and cats["x"].prompts == 2 and cats["y"].prompts == 1
    assert summary.methods["ar"].by_category["x"].speedup == 1.0
    assert Prompt("a", "b").chat is None
