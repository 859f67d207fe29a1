"""A drafter's LM head cut to frequent tokens (cascade.models.heads.pruned_head, FR-Spec)."""

import pytest
import torch

from cascade import generate
from cascade.drafters import SmallLMDrafter, frequent_head
from cascade.models import perturbed_copy, tiny_llama
from cascade.models.heads.pruned_head import PrunedHead, prune_head, rank_by_frequency


def test_rank_by_frequency_orders_by_count_then_id():
    ranked = rank_by_frequency([[3, 3, 5, 9, 5, 3], [5, -1, 12]], vocab_size=10)  # -1 and 12: outside, ignored
    assert ranked.tolist() == [3, 5, 9, 0, 1, 2, 4, 6, 7, 8]


def test_pruned_logits_are_the_full_logits_on_kept_ids_and_minus_inf_elsewhere(tiny_target):
    keep = torch.tensor([7, 0, 31, 12, 5])
    pruned = prune_head(tiny_target, keep)
    assert isinstance(pruned.model.lm_head, PrunedHead) and not isinstance(tiny_target.model.lm_head, PrunedHead)
    assert pruned.vocab_size == tiny_target.vocab_size == 32
    assert pruned.model.model is tiny_target.model.model  # decoder shared, not copied
    ids = [3, 9, 4, 4, 1]
    full = tiny_target.forward(ids, tiny_target.new_cache())  # [5, 32] float64
    cut = pruned.forward(ids, pruned.new_cache())
    torch.testing.assert_close(cut[:, keep], full[:, keep], atol=1e-12, rtol=0)
    rest = torch.ones(32, dtype=torch.bool)
    rest[keep] = False
    assert torch.isneginf(cut[:, rest]).all()


def test_pruning_keeps_eos_and_refuses_bad_input(tiny_target):
    lm = tiny_llama(vocab_size=32, seed=0, eos_token_id=30)
    pruned = prune_head(lm, torch.tensor([1, 2]))
    assert sorted(pruned.model.lm_head.keep.tolist()) == [1, 2, 30]
    with pytest.raises(ValueError, match="already pruned"):
        prune_head(pruned, torch.tensor([1]))
    for bad in ([], [0, 0], [32], [-1]):
        with pytest.raises(ValueError, match="distinct token ids"):
            prune_head(tiny_target, torch.tensor(bad, dtype=torch.int64))


@pytest.mark.parametrize("backend", ["fp16w", "onednn", "int8"])
def test_pruned_head_runs_on_the_heads_own_kernel(backend):
    from cascade.models.backends.cpu_kernels import (FP16WeightLinear, OneDNNLinear, fbgemm_available, onednn_available, use_fp16_weight_linears,
                                            use_onednn_linears)
    from cascade.models.backends.quantize import quantize_int8_dynamic

    if backend in ("fp16w", "int8") and not fbgemm_available():
        pytest.skip("FBGEMM is not available in this torch build")
    if backend == "onednn" and not onednn_available():
        pytest.skip("oneDNN is not available in this torch build")
    lm = tiny_llama(vocab_size=64, seed=4, dtype="float32")
    with torch.no_grad():  # bf16-valued weights, as a checkpoint holds (fp16 holds them exactly)
        for p in lm.model.parameters():
            p.copy_(p.bfloat16().float())
    {"fp16w": lambda m: use_fp16_weight_linears(m), "onednn": use_onednn_linears, "int8": quantize_int8_dynamic}[backend](lm.model)
    keep = torch.arange(0, 64, 3)
    pruned = prune_head(lm, keep)
    kind = {"fp16w": FP16WeightLinear, "onednn": OneDNNLinear, "int8": torch.ao.nn.quantized.dynamic.Linear}[backend]
    assert isinstance(pruned.model.lm_head.sub, kind)
    ids = [5, 9, 2, 7]
    full = lm.forward(ids, lm.new_cache())
    cut = pruned.forward(ids, pruned.new_cache())
    # fp16w and oneDNN multiply the same rows exactly (fp32 sums); int8 re-quantizes the kept rows
    tol = 0.1 if backend == "int8" else 1e-5
    torch.testing.assert_close(cut[:, keep], full[:, keep], atol=tol, rtol=tol)
    assert torch.isneginf(cut[:, 1]).all()


def test_pruned_drafter_keeps_greedy_equality(tiny_target, tiny_close_drafter):
    """A pruned drafter never proposes most ids; the output is still the target's (float64, exact)."""
    ar_keep = set()
    for prompt in ([1, 2, 3], [4, 4, 4, 4], [9, 8, 7, 9, 8]):
        ar = generate(tiny_target, prompt, max_new_tokens=24, stop_on_eos=False)
        ar_keep |= set(ar.tokens)
        for keep in (torch.arange(0, 32, 2), torch.tensor(sorted(set(ar.tokens))[: max(1, len(set(ar.tokens)) // 2)])):
            drafter = SmallLMDrafter(prune_head(tiny_close_drafter, keep), k=4)
            out = generate(tiny_target, prompt, drafter=drafter, max_new_tokens=24, stop_on_eos=False)
            assert out.tokens == ar.tokens
    assert len(ar_keep) > 3  # the outputs use ids outside some kept sets: rejections were exercised


def test_frequent_head_ranks_the_corpus_in_the_models_tokenizer(tmp_path, monkeypatch):
    import cascade.data
    import cascade.models.zoo as zoo

    monkeypatch.setattr(cascade.data, "corpus", lambda name: ["aaab", "abba c"])
    monkeypatch.setattr(zoo, "cache_root", lambda: tmp_path)
    lm = tiny_llama(vocab_size=256, num_layers=1, seed=0)  # byte-level: token id = byte
    pruned = frequent_head(lm, vocab=5, corpus=["letters"])
    # a x5, b x3, then " " and "c" x1 (by id), then ids the corpus never shows, from 0
    assert pruned.model.lm_head.keep.tolist() == [ord("a"), ord("b"), ord(" "), ord("c"), 0]
    with pytest.raises(ValueError, match="vocab"):
        frequent_head(lm, vocab=0, corpus=["letters"])


def test_sampled_pruned_drafter_reports_its_own_q(tiny_target):
    """A sampled draft token lies in the kept set and its reported q is zero outside it."""
    from cascade.drafters.base import DraftStart
    from cascade.types import SamplingConfig

    keep = torch.arange(0, 32, 2)
    drafter = SmallLMDrafter(prune_head(perturbed_copy(tiny_target, 0.3, seed=2), keep), k=4)
    drafter.start(DraftStart(tiny_target, None, [1, 2, 3], SamplingConfig(temperature=1.0), torch.Generator().manual_seed(0)))
    block = drafter.propose([1, 2, 3], 4)
    assert all(int(t) % 2 == 0 for t in block.tokens)
    assert block.q is not None and float(block.q[:, 1::2].abs().max()) == 0.0
    torch.testing.assert_close(block.q.sum(-1), torch.ones(len(block.tokens), dtype=block.q.dtype))
