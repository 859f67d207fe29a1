"""Methods side by side: decode every prompt with every method, interleaved, and compare.

A *method* is anything that turns a prompt into a ``Generation`` and can say what it is:

``SpeculativeMethod(drafter)``
    ``cascade.generate`` with a drafter (``None``: the autoregressive baseline, the same loop
    with an empty draft).
``TransformersGenerate(model, assistant, ...)``
    transformers' own ``model.generate`` (autoregressive, assisted by a small model, or prompt
    lookup) on the run's target (our swapped modules) or on a stock copy: the framework-tax
    rows, measured in the same process and on the same prompts as the rest. It records no steps,
    so its τ and α are None; its tokens and time are comparable with every other method's.

``decode_interleaved`` runs them prompt by prompt (every method on prompt i before any on
prompt i + 1, after one short warm-up generation each), so machine noise hits all methods
alike; ``summarize_methods`` turns the generations into typed :class:`~cascade.summary.MethodSummary`
rows (speedup against the baseline, in-sample decomposition, held-out prediction, per-category
rows and, under greedy decoding, the divergences from the baseline with the target's top-2 gap).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Protocol

import torch
from tqdm.auto import tqdm

from cascade.costs import VirtualClock
from cascade.data import Prompt
from cascade.decode import Generation, generate
from cascade.drafters.base import Drafter
from cascade.metrics import decode_speedup, decomposition, prediction, speedup, summarize
from cascade.models.lm import CausalLM
from cascade.summary import CategoryResult, Divergence, HeldOut, MethodSummary
from cascade.types import DrafterInfo, SamplingConfig
from cascade.verify import EXACT, Verifier

BASELINE = "ar"


class Method(Protocol):
    def decode(self, target: CausalLM, ids: list[int], max_new_tokens: int, sampling: SamplingConfig,
               seed: int, clock: VirtualClock | None = None) -> Generation: ...

    def describe(self, name: str) -> DrafterInfo: ...


@dataclass
class SpeculativeMethod:
    """``cascade.generate`` with ``drafter`` (None: autoregressive decoding), on the run's target
    or on ``model`` (the same target loaded on another backend: e.g. the FBGEMM backend beside the
    native one, to measure a backend as a method of the same run)."""

    drafter: Drafter | None = None
    verifier: Verifier = EXACT  # the target's verification rule (cascade.verify.VERIFIERS)
    model: CausalLM | None = None  # None: the run's target

    def decode(self, target, ids, max_new_tokens, sampling, seed, clock=None):
        return generate(self.model or target, ids, drafter=self.drafter, max_new_tokens=max_new_tokens, seed=seed,
                        sampling=sampling, verifier=self.verifier, clock=clock)

    def describe(self, name: str) -> DrafterInfo:
        if self.drafter is None:
            return DrafterInfo("autoregressive", name, 0)
        return self.drafter.describe()


@dataclass
class TransformersGenerate:
    """transformers' ``generate`` on ``model`` (None: the run's target, i.e. cascade's loaded
    modules; a ``CausalLM`` loaded separately: a stock copy), optionally assisted by ``assistant``
    (a small model: transformers' assisted generation with its own defaults) or by prompt lookup
    (``prompt_lookup_num_tokens``). Sampling settings are the run's."""

    model: CausalLM | None = None
    assistant: CausalLM | None = None
    prompt_lookup_num_tokens: int | None = None
    max_matching_ngram_size: int | None = None
    kind = "transformers_generate"

    def __post_init__(self) -> None:
        if self.assistant is not None and self.prompt_lookup_num_tokens is not None:
            raise ValueError("transformers' generate takes an assistant model or prompt lookup, not both")

    def _kwargs(self, sampling: SamplingConfig) -> dict:
        kw: dict = {"do_sample": not sampling.greedy}
        if not sampling.greedy:
            kw.update(temperature=sampling.temperature, top_k=sampling.top_k or 0, top_p=sampling.top_p or 1.0)
        if self.assistant is not None:
            kw["assistant_model"] = self.assistant.model
        if self.prompt_lookup_num_tokens is not None:
            kw["prompt_lookup_num_tokens"] = self.prompt_lookup_num_tokens
            if self.max_matching_ngram_size is not None:
                kw["max_matching_ngram_size"] = self.max_matching_ngram_size
        return kw

    def decode(self, target, ids, max_new_tokens, sampling, seed, clock=None):
        if clock is not None:
            raise ValueError("transformers' generate cannot run on a virtual clock (its forwards are not priced)")
        lm = self.model or target
        inp = torch.tensor([ids], device=lm.device)
        torch.manual_seed(seed)  # transformers samples from the global generator
        eos = sorted(target.eos_token_ids)
        t0 = time.perf_counter()
        out = lm.model.generate(inp, attention_mask=torch.ones_like(inp), max_new_tokens=max_new_tokens,
                                min_new_tokens=0, pad_token_id=eos[0] if eos else 0, eos_token_id=eos or None,
                                **self._kwargs(sampling))
        wall = time.perf_counter() - t0
        tokens = out[0, len(ids):].tolist()
        hit_eos = bool(tokens) and tokens[-1] in target.eos_token_ids
        return Generation(tokens, len(ids), [], wall, 0.0, "eos" if hit_eos else "max_new_tokens", sampling)

    def describe(self, name: str) -> DrafterInfo:
        helper = "assisted" if self.assistant is not None else "prompt_lookup" if self.prompt_lookup_num_tokens else "ar"
        budget = self.prompt_lookup_num_tokens or 0
        return DrafterInfo(f"{self.kind}:{helper}", name, budget)


def decode_interleaved(target: CausalLM, methods: dict[str, Method], prompts: list[list[int]], max_new_tokens: int,
                       sampling: SamplingConfig, *, warmup: bool = True, progress: bool = True,
                       seed: int = 0, device: str | None = None) -> dict[str, list[Generation]]:
    """Every method on every prompt, interleaved prompt by prompt so that machine noise hits all
    methods alike, after one short warm-up generation per method. The methods' order rotates by
    one place per prompt (prompt i starts with the i-th method): in a fixed order the methods
    late in each prompt's sequence ran slower on a shared host (DyTC behind five chains: 0.78-0.96
    of the chain drafting the same tokens at the same cost on a quiet machine), so no method keeps
    one position. Prompt i is decoded with seed ``seed + i``. ``device``: every generation on a
    virtual clock of that device (``cascade.costs``: its times are predictions). Returns
    name -> [Generation per prompt]."""
    def clock() -> VirtualClock | None:
        return None if device is None else VirtualClock(device)

    if warmup:
        for method in methods.values():
            method.decode(target, prompts[0][:32], min(8, max_new_tokens), sampling, 0, clock())
    gens: dict[str, list[Generation]] = {name: [] for name in methods}
    names = list(methods)
    for i, ids in enumerate(tqdm(prompts, desc="prompts", disable=not progress)):
        for name in rotated(names, i):
            gens[name].append(methods[name].decode(target, ids, max_new_tokens, sampling, seed + i, clock()))
    return gens


def rotated(names: list[str], i: int) -> list[str]:
    """``names`` starting at position ``i`` (mod their count): prompt i's order of the methods."""
    k = i % len(names) if names else 0
    return names[k:] + names[:k]


def heldout(gens: list[Generation], base: list[Generation]) -> HeldOut | None:
    """Predict the second half of the prompts from the first: ``metrics.prediction`` with the
    first half's measurements (against the baseline on the same prompts) as the fit. None with
    fewer than two prompts."""
    if len(base) < 2:
        return None
    half = len(base) // 2
    return prediction(summarize(gens[:half]), summarize(base[:half]), summarize(gens[half:]), summarize(base[half:]))


def by_category(prompt_set: list[Prompt], gens: list[Generation], base: list[Generation]) -> dict[str, CategoryResult] | None:
    """Per prompt category (``Prompt.category``, in order of appearance): prompts, τ, tok/s and
    the speedup against the baseline on the same prompts. None when there is one category."""
    cats = [p.category for p in prompt_set]
    if len(set(cats)) < 2:
        return None
    out = {}
    for c in dict.fromkeys(cats):
        idx = [i for i, x in enumerate(cats) if x == c]
        s, b = summarize([gens[i] for i in idx]), summarize([base[i] for i in idx])
        out[c] = CategoryResult(prompts=len(idx), tau=s.tau, tokens_per_s=s.tokens_per_s, speedup=speedup(s, b))
    return out


def divergences(target: CausalLM, prompt_set: list[Prompt], prompts: list[list[int]], gens: list[Generation],
                base: list[Generation], measure_gap: bool = True) -> list[Divergence]:
    """First position where each prompt's tokens leave the baseline's, with the target's top-2
    logit gap there (greedy runs: a near-tie that batched numerics may round differently)."""
    out = []
    for p, ids, a, b in zip(prompt_set, prompts, base, gens):
        j = next((j for j, (x, y) in enumerate(zip(a.tokens, b.tokens)) if x != y), None)
        if j is None and len(a.tokens) != len(b.tokens):
            j = min(len(a.tokens), len(b.tokens))
        if j is not None:
            gap = target.top2_gap(ids + a.tokens[:j]) if measure_gap else None
            out.append(Divergence(p.id, j, None if gap is None else round(gap, 4)))
    return out


def summarize_methods(target: CausalLM, methods: dict[str, Method], prompt_set: list[Prompt], prompts: list[list[int]],
                      gens: dict[str, list[Generation]], sampling: SamplingConfig) -> dict[str, MethodSummary]:
    """One typed row per method, against ``gens[BASELINE]``."""
    base_gens = gens[BASELINE]
    base = summarize(base_gens)
    out = {}
    for name, g in gens.items():
        s = summarize(g)
        div = divergences(target, prompt_set, prompts, g, base_gens) if sampling.greedy and name != BASELINE else []
        out[name] = MethodSummary(
            drafter=methods[name].describe(name),
            stats=s,
            speedup=speedup(s, base),
            decomposition=decomposition(s, base),
            heldout=heldout(g, base_gens),  # out of sample: the second half of the prompts from the first
            by_category=by_category(prompt_set, g, base_gens),
            tokens={p.id: gen.tokens for p, gen in zip(prompt_set, g)},
            # per prompt, for the spread of speedups across prompts (analysis figures)
            tokens_per_s_by_prompt={p.id: len(gen.tokens) / gen.wall_time_s for p, gen in zip(prompt_set, g)},
            identical_to_baseline=len(prompts) - len(div) if sampling.greedy else None,
            divergences=div,
            decode_speedup=decode_speedup(s, base),
        )
    return out
