"""Deep-draft losslessness tests: an independent exact reference and pairwise chi-square tests.

Reference (independent of the code under test). ``exact_law`` enumerates every continuation of
length L (L >= 6) on a tiny vocabulary and computes its exact probability from the Hugging Face
model's own forward (``model(input_ids).logits``: one batched forward per depth over every
prefix of that length, no cache) and transformers' own logits warpers in ``generate``'s order
(temperature, top-k, top-p). It never calls ``cascade.sampling``, ``cascade.verify`` or ``CausalLM``.

Samples. ``sample_outputs`` runs ``cascade.generate`` with ``max_new_tokens = L`` so that the
first step drafts up to ``L - 1`` tokens deep, and every later step of the generation is
verified too (bonus tokens, recovered tokens after deep accepts, cache sync after a long
accept, stop-policy decisions at every position). It records how deep each step's accepted path
went, so a test can show (and its failure message report) that multi-token accepts and
rejections at every depth happen.

It also counts, per depth, the events a tree or a leaf produces: a sibling judged after an
earlier sibling of the same node was rejected, and a bonus token drawn below a leaf.

Statistic. Chi-square tests of the samples against the reference's exact marginals: each
position's token alone (L tests: the most sensitive to a wrong recovered or bonus token), every
sliding pair (x1, x2), (x2, x3), ... and every sliding triple (x1, x2, x3), ... (dependence along
the output, across step boundaries wherever they fall); cells with expected count < 5 pooled, a
count in a zero-probability cell gives p = 0. The test fails when the smallest p-value times the
number of tests (Bonferroni, L + (L - 1) + (L - 2)) is below ``LEVEL``. Seeds are fixed, so each
test's outcome is deterministic.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

import numpy as np
import torch
from transformers.generation.logits_process import (
    LogitsProcessorList,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

from cascade import generate
from cascade.tree_structure import children_of
from cascade.types import SamplingConfig
from stat_utils import chi_square_pvalue as _chi2

LEVEL = 1e-3  # family-wise false-alarm level of one test (over its pairs)


def hf_warpers(temperature: float, top_k: int | None, top_p: float | None) -> LogitsProcessorList:
    """transformers' warpers in the order ``generate`` applies them."""
    warpers = LogitsProcessorList()
    if temperature != 1.0:
        warpers.append(TemperatureLogitsWarper(temperature))
    if top_k is not None:
        warpers.append(TopKLogitsWarper(top_k))
    if top_p is not None and top_p < 1.0:
        warpers.append(TopPLogitsWarper(top_p))
    return warpers


@torch.no_grad()
def exact_law(hf_model, prompt: list[int], length: int, temperature: float, top_k=None, top_p=None,
              batch: int = 1024) -> np.ndarray:
    """P(first ``length`` generated tokens = x) for every x: an array of shape [V] * length.
    Depth by depth, every prefix of positive mass is one row of a batched forward (they all have
    the same length, so no padding and no mask: the model's own causal forward)."""
    warpers = hf_warpers(temperature, top_k, top_p)
    vocab = hf_model.get_output_embeddings().out_features
    law = np.zeros((vocab,) * length)
    prefixes, masses = [()], np.ones(1)
    for depth in range(length):
        probs = np.zeros((len(prefixes), vocab))
        for a in range(0, len(prefixes), batch):
            ids = torch.tensor([prompt + list(p) for p in prefixes[a:a + batch]], device=hf_model.device)  # [b, T]
            logits = hf_model(input_ids=ids).logits[:, -1].double()  # [b, V]
            probs[a:a + len(ids)] = torch.softmax(warpers(ids, logits), dim=-1).cpu().numpy()
        rows, tokens = np.nonzero(probs > 0)
        prefixes = [prefixes[r] + (int(x),) for r, x in zip(rows, tokens)]
        masses = masses[rows] * probs[rows, tokens]
    for seq, mass in zip(prefixes, masses):
        law[seq] = mass
    return law


@dataclass
class Samples:
    outputs: np.ndarray  # [n, L] generated tokens
    depth_counts: dict[tuple[int, bool], int]  # (depth reached, rejected there) over all verified steps
    events: Counter = field(default_factory=Counter)  # ("sibling" | "bonus", depth) -> steps with one

    def _by_depth(self) -> tuple[Counter, Counter]:
        """Judgements per depth: accepted nodes, rejections (a step that accepted d nodes and
        stopped above a node with children was rejected at depth d + 1)."""
        acc, rej = Counter(), Counter()
        for (depth, rejected), n in self.depth_counts.items():
            for d in range(1, depth + 1):
                acc[d] += n
            if rejected:
                rej[depth + 1] += n
        return acc, rej

    def depth_report(self) -> str:
        """How often the verifier accepted / rejected at each draft depth, and the sibling and
        bonus events per depth (for failure messages)."""
        acc, rej = self._by_depth()
        out = "depth: accepted/rejected " + ", ".join(f"{d}: {acc[d]}/{rej[d]}" for d in sorted(set(acc) | set(rej)))
        for kind in ("sibling", "bonus"):
            at = {d: n for (k, d), n in sorted(self.events.items()) if k == kind}
            out += f"; {kind} events by depth " + (", ".join(f"{d}: {n}" for d, n in at.items()) or "none")
        return out

    def event_count(self, kind: str, depth: int | None = None) -> int:
        """Steps with a ``kind`` event ("sibling", "bonus") at ``depth`` (None: any depth)."""
        return sum(n for (k, d), n in self.events.items() if k == kind and (depth is None or d == depth))

    def exercised(self, depth: int, at_least: int) -> bool:
        """Accepts and rejections both happened at least ``at_least`` times at every depth 1..depth."""
        acc, rej = self._by_depth()
        return all(acc[i] >= at_least and rej[i] >= at_least for i in range(1, depth + 1))


def sample_outputs(target, make_drafter, prompt: list[int], length: int, n: int, seed: int, sampling: dict,
                   verifier=None) -> Samples:
    """``n`` generations of ``length`` tokens; one drafter object reused (its state carries over
    across generations, as in a real run)."""
    drafter = make_drafter()
    gen = torch.Generator().manual_seed(seed)
    outputs = np.zeros((n, length), dtype=np.int64)
    depths: Counter = Counter()
    events: Counter = Counter()
    extra = {} if verifier is None else {"verifier": verifier}
    for i in range(n):
        out = generate(target, prompt, drafter=drafter, max_new_tokens=length, generator=gen, stop_on_eos=False,
                       sampling=SamplingConfig(**sampling), **extra)
        outputs[i] = out.tokens
        for s in out.steps:
            if s.drafted:
                # rejected: the accepted path ends at a node that has children (not at a leaf)
                rejected = ([-1] + s.accepted_path)[-1] in set(s.parents)
                depths[(s.accepted, rejected)] += 1
                _count_events(s.parents, s.accepted_path, events)
    return Samples(outputs, dict(depths), events)


def _count_events(parents: list[int], path: list[int], events: Counter) -> None:
    """Sibling events (a node on the path, or the root, whose children were judged beyond the
    first: the accepted one is not its first child, or all of >= 2 were rejected) at the
    children's depth, and a bonus event at the leaf's depth when the path ends at a leaf."""
    kids = children_of(parents)
    inputs = [0] + [i + 1 for i in path]
    for depth, (j, nxt) in enumerate(zip(inputs, path + [None]), start=1):
        judged = kids[j].index(nxt) + 1 if nxt is not None else len(kids[j])
        if judged >= 2:
            events[("sibling", depth)] += 1
    if not kids[inputs[-1]]:
        events[("bonus", len(path))] += 1


def joint_pvalues(samples: Samples, law: np.ndarray, width: int) -> list[float]:
    """One chi-square p-value per sliding window of ``width`` positions (x1..x_w), (x2..x_{w+1}), ..."""
    length, vocab = law.ndim, law.shape[0]
    pvals = []
    for a in range(length - width + 1):
        window = tuple(range(a, a + width))
        marginal = law.sum(axis=tuple(i for i in range(length) if i not in window))  # [V] * width
        counts = np.zeros((vocab,) * width)
        np.add.at(counts, tuple(samples.outputs[:, i] for i in window), 1)
        pvals.append(_chi2(counts, marginal))
    return pvals


def position_pvalues(samples: Samples, law: np.ndarray) -> list[float]:
    """One chi-square p-value per position's token."""
    length, vocab = law.ndim, law.shape[0]
    pvals = []
    for a in range(length):
        marginal = law.sum(axis=tuple(i for i in range(length) if i != a))  # [V]
        pvals.append(_chi2(np.bincount(samples.outputs[:, a], minlength=vocab).astype(float), marginal))
    return pvals


def lossless_pvalue(samples: Samples, law: np.ndarray) -> float:
    """Bonferroni-combined p-value over the positions, the sliding pairs and the sliding triples."""
    pvals = position_pvalues(samples, law) + joint_pvalues(samples, law, 2) + joint_pvalues(samples, law, 3)
    return min(1.0, min(pvals) * len(pvals))
