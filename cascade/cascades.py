"""Drafters built from drafters: vertical and horizontal cascades (CS Drafting, Chen et al. 2023).

Vertical cascade
    ``VerticalCascade([lm_1, d_2, ..., d_n])``: level 1 (an LM drafter) drafts for the target by
    itself running speculative decoding with level 2 as *its* drafter, recursively. Every inner
    verification is exact (greedy: argmax; sampled: the same lossless rule as the target's), so
    the tokens the cascade hands up are distributed exactly as level 1's own autoregressive
    output, and the ``q`` handed up at each position is level 1's processed distribution there.
    That is what keeps the target-level verification lossless; a lenient middle level (accepting
    more than ``min(1, q1/q2)``) would hand up tokens whose law is not ``q`` (see the tests).

Horizontal cascade
    ``HorizontalCascade([(d_a, n_a), (d_b, n_b), ...])``: the first ``n_a`` positions of a draft
    come from ``d_a``, the next ``n_b`` from ``d_b``...: a stronger drafter where acceptance
    matters most, cheaper ones later. Vertical and horizontal compose (a level can be a horizontal
    schedule, a schedule entry can be a vertical cascade): CS Drafting's ``k``-matrix.

Each level keeps its KV cache in sync with the accepted prefix through its own longest-common-
prefix bookkeeping (``SmallLMDrafter.score``) or, for levels sharing the target's cache, by
leaving that cache as they found it, so no level needs to be told what was accepted.
"""

from __future__ import annotations

import torch

from cascade.costs import decode_clock
from cascade.drafters.base import ChecksTarget, Drafter, DraftStart, Outcome, SharesCache, check_target, shared_hidden_layer
from cascade.drafters.lm_base import LMDrafter
from cascade.models.lm import CausalLM, HiddenLayers
from cascade.sampling import logits_to_probs, one_hot_rows
from cascade.types import CascadeStats, DraftBlock, DrafterInfo, LevelStats, SamplingConfig, Scored, Segment, VerifyResult
from cascade.verify import EXACT, Verifier, verifier_named


class VerticalCascade(Drafter, ChecksTarget):
    """Level 1 drafts with speculative decoding, using the rest of the levels as its drafter.

    levels: ``[top, lower_1, lower_2, ...]``. ``top`` must be an ``LMDrafter`` (a small LM, a
    quantized LM, a layer-skip exit: it verifies the level below with its ``score``); every level
    but the last must be one too, since each verifies the next. ``top.k`` is the number of tokens handed up per round (its budget);
    each lower level's own ``k`` is its budget per inner round.
    """

    kind = "vertical_cascade"

    def __init__(self, levels: list[Drafter], name: str | None = None, verifier: Verifier | str = EXACT) -> None:
        """verifier: the acceptance rules every inner round uses (``cascade.verify``; token-wise by
        default; a name: ``token``, ``block``, ``traversal``)."""
        levels = list(levels)
        verifier = verifier_named(verifier)
        if len(levels) < 2:
            raise ValueError("a vertical cascade needs at least two levels")
        if not isinstance(levels[0], LMDrafter):
            raise TypeError(f"the top level of a vertical cascade must be an LMDrafter, got {type(levels[0]).__name__}")
        self.top = levels[0]
        self.lower: Drafter = levels[1] if len(levels) == 2 else VerticalCascade(levels[1:], verifier=verifier)
        if self.lower.hidden_layer is not None:
            raise ValueError(
                f"{self.lower.name} needs the target's hidden states, which a lower cascade level does not get "
                "(its verifier is the level above, not the target): use it as the top level or alone"
            )
        self.verifier = verifier
        self.name = name or " <- ".join([self.top.name, self.lower.name])

    @property
    def hidden_layer(self) -> HiddenLayers:
        return self.top.hidden_layer

    def describe(self) -> DrafterInfo:
        lower = self.lower.describe()
        below = lower.parts if isinstance(self.lower, VerticalCascade) else [lower]  # levels, flattened
        return DrafterInfo(self.kind, self.name, self.top.k, parts=[self.top.describe()] + below)

    def check_compatible(self, target: CausalLM) -> None:
        self.top.check_compatible(target)
        check_target(self.lower, self.top.scores_vocabulary_of(target))  # the lower level drafts for the top's model

    def start(self, run: DraftStart) -> None:
        super().start(run)
        self.top.start(run)
        # The lower level drafts for the top's model: a self-drafting lower level (a layer skip
        # of the top's model) shares the top's cache (the target's, when the top is itself a
        # layer skip), which the top's start has just made and filled with the prompt.
        shared = self.top.draft_cache() if isinstance(self.top, SharesCache) else None
        model, cache = shared if shared is not None else (self.top.scores_vocabulary_of(run.target), None)
        self.lower.start(DraftStart(model, cache, run.prompt, run.sampling, run.generator))

    def _inner_round(self, ctx: list[int], budget: int, deterministic: bool, lower: dict[str, LevelStats]):
        """One speculative round of the top level over the lower level's draft: the lower level's
        block is verified by the top's model with the same rules as the target's verification.

        Returns the emitted tokens, the top level's processed distribution at each emitted
        position when sampling ([m, V], else None), and the top level's own time."""
        t0 = decode_clock()
        self.top.sync(ctx)  # the top's cache must hold a prefix of ctx only (a lower level may share it)
        block = self.lower.propose(ctx, budget - 1) if budget > 1 else DraftBlock.empty(self.lower.name)
        if not block.is_chain:
            raise ValueError(f"{self.lower.name} proposed a token tree: a cascade level verifies chains")
        t1 = decode_clock()
        logits = self.top.score(ctx, block.tokens.tolist())  # [j+1, V]
        sampling = SamplingConfig() if deterministic else self.sampling
        result = self.verifier.accept(block, logits, sampling, self.generator)
        emitted = block.tokens.tolist()[: result.num_accepted] + [result.next_token]
        self.lower.observe(Outcome(ctx + emitted, result, scored=Scored([ctx[-1]] + block.tokens.tolist(), logits)))
        if block.k:  # a nested cascade reports its own top level's time, without its levels'
            own = block.cascade
            name, own_time = (own.top, own.top_time_s) if own is not None else (self.lower.name, t1 - t0)
            lower.setdefault(name, LevelStats()).add(LevelStats(block.k, result.num_accepted, own_time, 1))
            for deeper, stats in (own.lower.items() if own is not None else ()):  # already aggregated
                lower.setdefault(deeper, LevelStats()).add(stats)
        rows = None if deterministic else self._handed_up_q(logits, result)  # [m, V]
        return emitted, rows, decode_clock() - t1

    def _handed_up_q(self, logits: torch.Tensor, result: VerifyResult) -> torch.Tensor:
        """The law of each token one inner round hands up, [num_accepted + 1, V]: the top level's own
        processed distribution at each emitted position. Exact inner verification makes the
        emitted tokens follow it (a recovered token too: p-residual mixed with the accepted
        mass is p again); handing up the residual instead would break losslessness."""
        return logits_to_probs(logits[: result.num_accepted + 1], self.sampling)

    def propose(self, context: list[int], budget: int) -> DraftBlock:
        n = min(budget, self.top.k)
        deterministic = self.sampling.greedy or not self.top.sample
        ctx, tokens, q_rows, lower, top_time = list(context), [], [], {}, 0.0
        while len(tokens) < n:
            emitted, rows, dt = self._inner_round(ctx, n - len(tokens), deterministic, lower)
            top_time += dt
            ctx += emitted
            tokens += emitted
            if rows is not None:
                q_rows.append(rows)
        q = torch.cat(q_rows) if q_rows else None  # [n, V]
        return DraftBlock(torch.tensor(tokens, dtype=torch.long), q, self.name,
                          cascade=CascadeStats(self.top.name, top_time, lower))

    def observe(self, outcome: Outcome) -> None:
        self.top.observe(outcome)


class HorizontalCascade(Drafter, ChecksTarget):
    """A position-dependent schedule: ``[(drafter, n_tokens), ...]`` fills a draft left to right.

    A drafter that returns fewer tokens than its share (an n-gram drafter without a match)
    hands the remaining positions on to the next entry. Deterministic entries contribute
    one-hot ``q`` rows when another entry samples, so the block's ``q`` is exact at every position.
    """

    kind = "horizontal_cascade"

    def __init__(self, schedule: list, name: str | None = None) -> None:
        entries = [(d, int(n)) for d, n in (e if isinstance(e, (tuple, list)) else (e["drafter"], e["tokens"]) for e in schedule)]
        if not entries or any(n < 1 for _, n in entries):
            raise ValueError("a horizontal cascade needs a non-empty schedule of (drafter, tokens >= 1)")
        self.schedule = entries
        self.k = sum(n for _, n in entries)
        self.name = name or " | ".join(f"{d.name}x{n}" for d, n in entries)
        shared_hidden_layer([d for d, _ in entries], "schedule entries")  # refuse entries needing different layers now

    @property
    def hidden_layer(self) -> HiddenLayers:
        return shared_hidden_layer([d for d, _ in self.schedule], "schedule entries")

    def describe(self) -> DrafterInfo:
        return DrafterInfo(self.kind, self.name, self.k, parts=[d.describe() for d, _ in self.schedule])

    def check_compatible(self, target: CausalLM) -> None:
        for drafter, _ in self.schedule:
            check_target(drafter, target)

    def start(self, run: DraftStart) -> None:
        super().start(run)
        for drafter, _ in self.schedule:
            drafter.start(run.part(drafter))

    def propose(self, context: list[int], budget: int) -> DraftBlock:
        budget = min(budget, self.k)
        tokens: list[int] = []
        segments: list[DraftBlock] = []
        spans: list[Segment] = []  # where each entry's tokens sit in the draft, for per-segment alpha
        carry = 0  # positions a previous entry left unfilled
        for drafter, share in self.schedule:
            want = min(share + carry, budget - len(tokens))
            if want <= 0:
                break
            t0 = decode_clock()
            block = drafter.propose(context + tokens, want)
            if not block.is_chain:
                raise ValueError(f"{drafter.name} proposed a token tree: a horizontal schedule concatenates chains")
            spans.append(Segment(drafter.name, len(tokens), block.k, decode_clock() - t0))
            carry = want - block.k
            tokens += block.tokens.tolist()
            segments.append(block)
        return DraftBlock(torch.tensor(tokens, dtype=torch.long), _stack_q(segments), self.name, segments=spans)

    def observe(self, outcome: Outcome) -> None:
        for drafter, _ in self.schedule:
            drafter.observe(outcome.part(drafter))


def _stack_q(segments: list[DraftBlock]) -> torch.Tensor | None:
    """Concatenate the segments' q ([k_i, V] each); deterministic segments become one-hot rows.
    None when every segment is deterministic."""
    ref = next((b.q for b in segments if b.q is not None), None)
    if ref is None:
        return None
    rows = []
    for b in segments:
        if b.q is not None:
            rows.append(b.q.to(ref.device, ref.dtype))
        elif b.k:
            rows.append(one_hot_rows(b.tokens, ref))
    return torch.cat(rows)  # [k, V]
