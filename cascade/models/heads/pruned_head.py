"""A drafter's LM head cut to a subset of the vocabulary (FR-Spec, Zhao et al. 2025).

A small drafter spends a large share of each forward in its LM head: the 0.5B Qwen2.5-Coder's
head is 136M of its 494M linear weights (151,936 x 896), so on a CPU, where a one-token forward
streams every weight once, about 28% of each drafted token's time. Most of those rows are tokens
the drafter almost never proposes. :func:`prune_head` swaps the head for :class:`PrunedHead`,
which multiplies only by the rows of ``keep`` (token ids, e.g. the most frequent ones of a
corpus: :func:`rank_by_frequency`) and returns logits over the whole vocabulary with ``-inf``
at every other id, so every consumer (sampling, warpers, verification) sees an ordinary
distribution [V] that is zero outside ``keep``.

Lossless: only drafters' models are pruned. A drafter samples from (and reports) that
distribution, so q is exact; the target's p is untouched and verification recovers every
token the drafter cannot propose through the residual. Pruning changes acceptance, never the
output distribution. (Never prune a target: its distribution would change.)

The kept rows run on the same kernel as the head they replace (``nn.Linear`` in the model's
dtype, ``FP16WeightLinear``, ``OneDNNLinear``, or PyTorch's dynamic int8 ``Linear``, whose
pruned copy is re-quantized from its dequantized rows). Shapes: hidden [..., H] -> logits
[..., V].
"""

from __future__ import annotations

import copy
from collections.abc import Iterable

import torch
from torch import nn

from cascade.models.backends.cpu_kernels import FP16WeightLinear, OneDNNLinear
from cascade.models.backends.lean import LeanDecoder
from cascade.models.lm import CausalLM
from cascade.models.backends.native import NativeLinear
from cascade.models.backends.quantize import quantize_int8_dynamic


def rank_by_frequency(sequences: Iterable[Iterable[int]], vocab_size: int) -> torch.Tensor:
    """Every token id in [0, vocab_size), most frequent in ``sequences`` first; ties (and ids
    never seen) in increasing id order (in byte-level BPE vocabularies a lower id is an earlier
    merge, i.e. a more frequent pair in the tokenizer's own training data). Ids outside the
    vocabulary (e.g. document separators) are ignored. Returns [vocab_size] int64."""
    counts = torch.zeros(vocab_size, dtype=torch.int64)
    for seq in sequences:
        ids = torch.as_tensor(seq if hasattr(seq, "__len__") else list(seq), dtype=torch.int64).reshape(-1)  # list, array or tensor
        ids = ids[(ids >= 0) & (ids < vocab_size)]
        counts += torch.bincount(ids, minlength=vocab_size)
    # stable sort on -count keeps increasing id order among equal counts
    return torch.sort(-counts, stable=True).indices


def _dense(head: nn.Module) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The weight [V, H] and bias [V] (or None) that ``head`` multiplies by."""
    if isinstance(head, nn.Linear):
        return head.weight.detach(), None if head.bias is None else head.bias.detach()
    if isinstance(head, (FP16WeightLinear, OneDNNLinear, NativeLinear)):
        state = head.dense_state()
        bias = state.get("bias")
        if isinstance(head, OneDNNLinear) and bias is not None and not bool(bias.any()):
            bias = None  # OneDNNLinear stores a missing bias as zeros
        return state["weight"], bias
    if isinstance(head, torch.ao.nn.quantized.dynamic.Linear):
        weight, bias = head._packed_params._weight_bias()
        return weight.dequantize(), bias
    raise TypeError(f"cannot prune an LM head of type {type(head).__name__}")


def _like(head: nn.Module, sub: nn.Linear) -> nn.Module:
    """``sub`` (fp32 or the model's dtype) on the kernel ``head`` runs on."""
    if isinstance(head, FP16WeightLinear):
        return FP16WeightLinear(sub)  # rows of an exactly-converted head: still exact
    if isinstance(head, OneDNNLinear):
        return OneDNNLinear(sub)
    if isinstance(head, NativeLinear):  # fp16 rows stay exact; int8 / int4 rows keep their scales
        return type(head)(sub.float())
    if isinstance(head, torch.ao.nn.quantized.dynamic.Linear):
        return quantize_int8_dynamic(nn.Sequential(sub.float()))[0]
    return sub


class PrunedHead(nn.Module):
    """An LM head that computes logits for ``keep`` only; every other id gets ``-inf``."""

    def __init__(self, head: nn.Module, keep: torch.Tensor, vocab_size: int) -> None:
        super().__init__()
        keep = torch.as_tensor(keep, dtype=torch.int64).reshape(-1)
        if keep.numel() == 0 or int(keep.min()) < 0 or int(keep.max()) >= vocab_size or len(set(keep.tolist())) != keep.numel():
            raise ValueError(f"keep must be distinct token ids in [0, {vocab_size}), at least one")
        weight, bias = _dense(head)  # [V, H], [V]
        if weight.shape[0] != vocab_size:
            raise ValueError(f"head has {weight.shape[0]} rows, vocabulary {vocab_size}")
        dtype = weight.dtype if isinstance(head, nn.Linear) else torch.float32
        sub = nn.Linear(weight.shape[1], keep.numel(), bias=bias is not None, dtype=dtype, device=weight.device)
        with torch.no_grad():
            sub.weight.copy_(weight[keep])
            if bias is not None:
                sub.bias.copy_(bias[keep])
        self.sub = _like(head, sub)
        self.register_buffer("keep", keep.to(weight.device), persistent=False)
        self.out_features = vocab_size  # what CausalLM.vocab_size reads

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:  # [..., H] -> [..., V]
        kept = self.sub(hidden)  # [..., n]
        out = kept.new_full((*kept.shape[:-1], self.out_features), float("-inf"))
        out[..., self.keep] = kept
        return out


def prune_head(lm: CausalLM, keep: torch.Tensor) -> CausalLM:
    """``lm`` with its LM head cut to the token ids ``keep``, as a new ``CausalLM`` for a
    drafter. ``lm`` itself is untouched and every other weight is shared, not copied (the new
    model is a shallow copy of ``lm.model`` whose module table differs in the head only). The
    model's EOS ids are always kept, so a draft can end where the text does."""
    head = lm.model.get_output_embeddings()
    if isinstance(head, PrunedHead):
        raise ValueError(f"{lm.name}: LM head is already pruned")
    keep = torch.as_tensor(keep, dtype=torch.int64).reshape(-1)
    missing = [i for i in sorted(lm.eos_token_ids) if i not in set(keep.tolist()) and i < lm.vocab_size]
    if missing:
        keep = torch.cat([keep, torch.tensor(missing, dtype=torch.int64)])
    vocab = lm.vocab_size
    pruned = PrunedHead(head, keep, vocab)
    # transformers' causal-LM classes call self.lm_head (get_output_embeddings) after the
    # decoder; a shallow copy with its own module table leaves the original model intact.
    model = copy.copy(lm.model)
    model._modules = dict(lm.model._modules)
    model.set_output_embeddings(pruned)
    if model.get_output_embeddings() is not pruned or lm.model.get_output_embeddings() is not head:
        raise TypeError(f"{type(lm.model).__name__}: could not swap the LM head on a copy")
    pruned_lm = CausalLM(model, lm.tokenizer, f"{lm.name}[head {keep.numel()}/{vocab}]", backend=lm.backend)
    if isinstance(lm.lean, LeanDecoder):  # the lean forward reads the head from the model it is built on
        pruned_lm.use_forward(LeanDecoder(model))
    return pruned_lm
