"""Subtly broken verification rules and cascade levels: what the losslessness tests must catch.

Each is the exact rule with one realistic mistake (see ``tests/power_table.py`` for how often the
statistical tests catch each one at the sample size CI uses):

``residual_eps``      the recovered token drawn from ``p`` instead of the residual in a fraction
                      ε = 0.25 of rejections
``bonus_wrong_row``   the bonus token (below a leaf) drawn from the row of the leaf's parent
``q_wrong_position``  a node judged with the ``q`` row of its parent's position
``mask_off_by_one``   tree attention: a node at depth >= 2 does not see its parent
``middle_residual``   a vertical cascade's middle level hands up, at an inner rejection, the
                      residual it drew the recovered token from instead of its own distribution
``stale_sibling``     sampled siblings: after a sibling's rejection the residual is not updated
                      in ε = 0.25 of rejections (the next sibling and the recovered token see a
                      stale residual)
``shared_uniform``    one uniform shared by all children of a node instead of one per child
``bonus_from_q``      the bonus token below a leaf drawn from the leaf's own q row instead of the
                      target's p there
``warp_order``        the target's p with temperature applied after top-p (q unchanged): only
                      visible under temperature != 1 with top-p
``unwarped_draw``     recovered and bonus tokens drawn from the unwarped target (softmax of the
                      raw logits): only visible under warping
``commit_off_by_one`` the target's cache keeps inputs 0 .. len(path) (a chain's crop) after a path
                      that leaves the first branch of a tree, instead of the path's own inputs
                      (``Verifier.kept``): later steps attend to the wrong keys
``UntruncatedQDrafter`` samples from the truncated q, reports q before top-k / top-p
``NoReplacementStaticTree`` sampled siblings drawn without replacement, each reporting the full q
``UnrenormalisedIntersectionDrafter`` cross-tokenizer drafting: samples from the drafter's
                      distribution restricted to the shared tokens and renormalised, reports it
                      not renormalised
``sibling_vs_p``      a deterministic child judged against the target's ``p`` instead of the
                      residual left by its rejected siblings (accept w.p. p(x), not
                      p(x) / (1 - p(earlier siblings))); the recovered token is still drawn
                      from the right residual. Only trees with deterministic siblings (Token
                      Recycling's tree, ranked children) can show it
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from cascade.cascades import VerticalCascade
from cascade.drafters import SmallLMDrafter
from cascade.drafters.cross_tokenizer import CrossTokenizerDrafter
from cascade.sampling import logits_to_probs, sample
from cascade.tree_structure import children_of, is_chain, tree_positions
from cascade.trees import StaticTreePolicy
from cascade.types import ACCEPTED, REJECTED, UNJUDGED, DraftBlock, SamplingConfig, VerifyResult
from cascade.verify import Verifier, residual_distribution

EPS = 0.25


def _uniform(generator) -> float:
    return float(torch.rand((), generator=generator, dtype=torch.float64))


def _accept_sampled(tokens, parents, q, p, generator, *, eps=0.0, bonus_row=False, q_shift=False, sibling_p=False,
                    stale=0.0, shared_uniform=False, bonus_from_q=False, raw=None):
    """The exact rule with switches for the mistakes above (all off: exact). ``raw``: [n + 1, V]
    unwarped target rows; when given, the recovered and bonus tokens are drawn from them (the
    acceptance ratios still use the warped ``p``)."""
    kids = children_of(parents)
    judgements = [UNJUDGED] * len(tokens)
    path, j = [], 0
    while True:
        residual, rejected = p[j], False
        draw_from = None if raw is None else raw[j]  # the unwarped residual the buggy draw uses
        nxt = None
        u_shared = _uniform(generator) if shared_uniform and kids[j] else None
        for c in kids[j]:
            x = tokens[c]
            row = c if not (q_shift and parents[c] >= 0) else parents[c]
            qx = 1.0 if q is None else float(q[row, x])
            judge = p[j] if sibling_p and q is None else residual
            u = u_shared if u_shared is not None else _uniform(generator)
            if qx > 0 and u * qx < float(judge[x]):
                judgements[c] = ACCEPTED
                nxt = c
                break
            judgements[c] = REJECTED
            rejected = True
            q_row = torch.nn.functional.one_hot(torch.tensor(x), residual.shape[-1]).to(residual) if q is None \
                else q[row].to(residual.dtype)
            if stale and q is not None and len(kids[j]) > 1 and _uniform(generator) < stale:
                continue  # the residual is not updated after this sibling's rejection
            residual = residual_distribution(residual, q_row)
            if draw_from is not None:
                draw_from = residual_distribution(draw_from, q_row.to(draw_from.dtype))
        if nxt is None:
            if rejected and eps and _uniform(generator) < eps:
                residual = p[j]
            if not kids[j] and bonus_row and path:
                residual = p[parents[path[-1]] + 1]  # the leaf's parent's row
            if not kids[j] and bonus_from_q and path and q is not None:
                residual = q[path[-1]].to(residual.dtype)  # the bonus drawn from the leaf's own q row
            if draw_from is not None:
                residual = draw_from
            return VerifyResult(len(path), int(sample(residual, generator)), not kids[j], path, judgements)
        path.append(nxt)
        j = nxt + 1


def _mask_off_by_one(parents, past, dtype):
    """Tree inputs where a node at depth >= 2 does not attend to its parent (but to the others)."""
    if is_chain(parents) and not parents:
        return None, None
    n = len(parents) + 1
    allowed = torch.zeros(n, n, dtype=torch.bool)
    allowed[:, 0] = True
    for i, p in enumerate(parents):
        allowed[i + 1] = allowed[p + 1]
        allowed[i + 1, i + 1] = True
        if p >= 0:
            allowed[i + 1, p + 1] = False
    full = torch.cat([torch.ones(n, past, dtype=torch.bool), allowed], dim=1)
    mask = torch.zeros(n, past + n, dtype=dtype)
    mask.masked_fill_(~full, torch.finfo(dtype).min)
    return tree_positions(parents, past), mask[None, None]


@dataclass(frozen=True)
class WarpOrderVerifier(Verifier):
    """The target's p computed with temperature applied after top-p (transformers and
    cascade.sampling apply it first); the drafters' q stay right."""

    def accept(self, block, logits, sampling, generator):
        if sampling.greedy or sampling.top_p is None:
            return super().accept(block, logits, sampling, generator)
        p = logits_to_probs(logits, SamplingConfig(1.0, sampling.top_k, sampling.top_p))  # truncated at T = 1
        p = logits_to_probs(torch.log(p) / sampling.temperature, SamplingConfig(1.0))  # then the temperature
        q = None if block.q is None else block.q.to(p.device)
        return self.sampled(block.tokens.tolist(), block.parents, q, p, generator)


@dataclass(frozen=True)
class UnwarpedDrawVerifier(Verifier):
    """Recovered and bonus tokens drawn from the unwarped target rows (softmax of the raw logits);
    the acceptance ratios use the warped p."""

    def accept(self, block, logits, sampling, generator):
        if sampling.greedy:
            return super().accept(block, logits, sampling, generator)
        p = logits_to_probs(logits, sampling)
        raw = torch.softmax(logits.to(p.dtype), -1)
        q = None if block.q is None else block.q.to(p.device)
        return _accept_sampled(block.tokens.tolist(), block.parents, q, p, generator, raw=raw)


def _kept_off_by_one(result):
    """The inputs the cache keeps, with an off-by-one past a branch: after a path that leaves the
    first branch (a node that is not its parent's first child), the kept inputs are the path's
    positions counted as a chain, 0 .. len(path), instead of the path's own inputs."""
    keep = [0] + [i + 1 for i in result.path]
    return list(range(len(keep))) if keep != list(range(len(keep))) else keep


VERIFIERS = {
    "residual_eps": Verifier(sampled=lambda *a: _accept_sampled(*a, eps=EPS)),
    "bonus_wrong_row": Verifier(sampled=lambda *a: _accept_sampled(*a, bonus_row=True)),
    "q_wrong_position": Verifier(sampled=lambda *a: _accept_sampled(*a, q_shift=True)),
    "mask_off_by_one": Verifier(inputs=_mask_off_by_one),
    "sibling_vs_p": Verifier(sampled=lambda *a: _accept_sampled(*a, sibling_p=True)),
    "stale_sibling": Verifier(sampled=lambda *a: _accept_sampled(*a, stale=EPS)),
    "shared_uniform": Verifier(sampled=lambda *a: _accept_sampled(*a, shared_uniform=True)),
    "bonus_from_q": Verifier(sampled=lambda *a: _accept_sampled(*a, bonus_from_q=True)),
    "warp_order": WarpOrderVerifier(),
    "unwarped_draw": UnwarpedDrawVerifier(),
    "commit_off_by_one": Verifier(kept=_kept_off_by_one),
}


class MiddleResidualCascade(VerticalCascade):
    """At an inner rejection, hands up the residual norm(max(0, q_top - q_low)) as the recovered
    token's q instead of q_top."""

    def _handed_up_q(self, logits, result):
        rows = logits_to_probs(logits[: result.num_accepted + 1], self.sampling).clone()
        if not result.all_accepted and self._last_low_q is not None:
            n = result.num_accepted
            rows[n] = residual_distribution(rows[n], self._last_low_q[n].to(rows))
        return rows

    def _inner_round(self, ctx, budget, deterministic, lower):
        # remember the lower level's q of this round (the exact class does not need it)
        original = self.lower.propose

        def spy(context, b):
            block = original(context, b)
            self._last_low_q = block.q if block.q is not None else (
                torch.nn.functional.one_hot(block.tokens, self.top.model.vocab_size).double() if block.k else None)
            return block

        self.lower.propose = spy
        try:
            return super()._inner_round(ctx, budget, deterministic, lower)
        finally:
            self.lower.propose = original


class _MisreportingDrafter(SmallLMDrafter):
    """Drafts with ``model`` but reports, for each drafted token, a q computed by ``reported_q``
    from the logits of ``scorer_model`` at the same positions."""

    def __init__(self, model, scorer_model, k):
        super().__init__(model, k=k)
        self.scorer = SmallLMDrafter(scorer_model, k=k)

    def start(self, run):
        super().start(run)
        self.scorer.start(run)  # its own cache, caught up on the same prompt

    def reported_q(self, logits):
        raise NotImplementedError

    def propose(self, context, budget):
        block = super().propose(context, budget)
        if block.q is None or block.k == 0:
            return block
        logits = self.scorer.score(context, block.tokens[:-1].tolist())  # [k, V]: after context and each drafted prefix
        return DraftBlock(block.tokens, self.reported_q(logits), block.drafter, stop=block.stop)


class FullQPrunedDrafter(_MisreportingDrafter):
    """Drafts with a pruned-head model (FR-Spec) but reports the q of the full head: the
    acceptance ratio p/q and the residual use probabilities the draft was not sampled from (an
    implementation that prunes only the sampling step)."""

    def __init__(self, pruned, full, k):
        super().__init__(pruned, full, k)

    def reported_q(self, logits):
        return logits_to_probs(logits, self.sampling)


# Block and traversal verification with one mistake each (all switches off: the real rules, draw
# for draw; tests/test_lossless_deep.py asserts it).
#
# ``block_weight_shift``  block verification's backward pass takes a position's stop probability
#                         and residual from the next position's weight (w_{j+1} instead of w_j)
# ``traversal_stale``     traversal verification keeps a parent's weight after a child's subtree
#                         is rejected (its law is updated): later siblings and the parent's own
#                         stop are judged with a stale weight


def _accept_block(tokens, parents, q, p, generator, *, weight_shift=False):
    """The real accept_block; with ``weight_shift`` its backward pass reads position j's weight
    as w_{j+1} for 0 < j < k (the leaf and the root keep theirs)."""
    import cascade.verify as v

    original = v._block_weights
    if weight_shift:
        def shifted(tokens, q, p):
            w = original(tokens, q, p)
            return [w[0]] + w[2:] + [w[-1]] if len(w) > 2 else w
        v._block_weights = shifted
    try:
        return v.accept_block(tokens, parents, q, p, generator)
    finally:
        v._block_weights = original


def _accept_traversal(tokens, parents, q, p, generator, *, stale=False):
    import cascade.verify as v

    original = v._after_rejection
    if stale:
        v._after_rejection = lambda w, law, q_row: (w if w < 1 else 1.0, original(w, law, q_row)[1])
    try:
        return v.accept_traversal(tokens, parents, q, p, generator)
    finally:
        v._after_rejection = original


VERIFIERS.update({
    "block_weight_shift": Verifier(sampled=lambda *a: _accept_block(*a, weight_shift=True), trees=False),
    "traversal_stale": Verifier(sampled=lambda *a: _accept_traversal(*a, stale=True)),
})
EXACT_DOUBLES = {  # the doubles with every switch off
    "block": Verifier(sampled=_accept_block, trees=False),
    "traversal": Verifier(sampled=_accept_traversal),
}


class UntruncatedQDrafter(_MisreportingDrafter):
    """Samples from the truncated (top-k / top-p) q but reports the q before truncation
    (softmax(logits / T)): the ratios and residuals use probabilities of tokens it can never draw."""

    def __init__(self, model, k):
        super().__init__(model, model, k)

    def reported_q(self, logits):
        return logits_to_probs(logits, SamplingConfig(self.sampling.temperature))  # no top-k / top-p


class NoReplacementStaticTree(StaticTreePolicy):
    """Sampled siblings drawn without replacement (each later sibling from q with the earlier
    siblings' tokens removed, renormalised) while every sibling reports the full q."""

    def _children(self, tree, calls, node, logits, count):
        if calls.deterministic(0):
            return super()._children(tree, calls, node, logits, count)
        q = calls.q(logits)  # [V]
        depth = tree.depth(node) + 1
        left, out = q.clone(), []
        for rank in range(1, count + 1):
            if left.sum() <= 0:
                break
            token = calls.draw(left / left.sum())
            left[token] = 0
            out.append(tree.add(node, drafter=0, rank=rank, token=token, q=q,
                                reach=tree.reach(node) * self.acceptance.sibling(0, depth, rank)))
        return out


class UnrenormalisedIntersectionDrafter(CrossTokenizerDrafter):
    """Cross-tokenizer drafting by the token-level intersection with one mistake: tokens are
    sampled from the drafter's distribution restricted to the shared tokens and renormalised,
    but the reported q is the restricted distribution *not* renormalised (the drafter's own
    processed probabilities of the shared tokens, summing to its mass on them): p / q is then
    too large wherever the drafter puts mass outside the intersection."""

    _masses: list[float] = []  # the drafter's mass on the shared tokens at each row of the current draft

    def _in_target_vocabulary(self, rows):
        self._masses = self._masses + self._bridge().shared_mass(rows).tolist()
        return super()._in_target_vocabulary(rows)

    def propose(self, context, budget):
        self._masses = []
        block = super().propose(context, budget)
        if block.q is None or block.k == 0:
            return block
        # one row per drafted token: the start's, then one per _continue
        masses = torch.tensor(self._masses[-block.k:], dtype=block.q.dtype)
        return DraftBlock(block.tokens, block.q * masses[:, None], block.drafter, stop=block.stop)
