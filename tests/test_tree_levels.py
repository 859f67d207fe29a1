"""Level-synchronous tree drafting: a drafter's level forward gives every node the logits of its
path scored alone (float64, 1e-9), for each LM drafter kind; compaction of the draft cache to
the accepted path equals a cache built from that path; a drafter on the target's cache leaves
it as it found it."""

import random

import pytest
import torch

from cascade.drafters import LayerSkipDrafter, SmallLMDrafter
from cascade.models.heads.adapter import ExitAdapter
from cascade.models.layers import head_logits, layer_lengths, run_layers
from cascade.tree_structure import depths_of, path_to
from cascade.types import SamplingConfig
from cascade.drafters.base import DraftStart


def random_tree(rng: random.Random, n: int, vocab: int) -> tuple[list[int], list[int]]:
    parents = [-1, -1]
    for i in range(2, n):
        parents.append(rng.randrange(-1, i))
    return [rng.randrange(vocab) for _ in range(n)], parents


def grow_by_levels(drafter, context, tokens, parents) -> dict[int, torch.Tensor]:
    """Feed the tree depth by depth (one tree_level per depth); logits per node (-1 = root)."""
    out = {-1: drafter.tree_start(context)}
    depths = depths_of(parents)
    for d in range(1, max(depths) + 1):
        level = [i for i, dd in enumerate(depths) if dd == d]
        rows = drafter.tree_level(level, [tokens[i] for i in level], [parents[i] for i in level])
        assert rows.shape[0] == len(level)
        out.update({i: rows[r] for r, i in enumerate(level)})
    return out


def _reference(kind, target, small, adapter, seq):
    """The drafter's next-token logits after ``seq``, computed on a fresh cache from the model's
    parts (not through the drafter)."""
    if kind == "small_lm":
        return small.forward(seq, small.new_cache())[-1]
    hidden = run_layers(target, seq, target.new_cache(), 1)  # [n, H]
    if kind == "layer_skip":
        return head_logits(target, hidden)[-1]
    return adapter.logits(target, hidden, torch.arange(len(seq)), adapter.new_cache())[-1]


@pytest.mark.parametrize("kind", ["small_lm", "layer_skip", "kangaroo"])
@pytest.mark.parametrize("seed", [0, 1])
def test_level_forward_equals_each_path_alone(kind, seed, tiny_target, tiny_close_drafter):
    rng = random.Random(seed)
    context = [rng.randrange(32) for _ in range(6)]
    tokens, parents = random_tree(rng, 14, 32)
    adapter = ExitAdapter.from_target(tiny_target, 1) if kind == "kangaroo" else None
    if kind == "small_lm":
        drafter = SmallLMDrafter(tiny_close_drafter)
        drafter.start(DraftStart(tiny_target, None, context, SamplingConfig(), None))
    else:
        drafter = LayerSkipDrafter(1, adapter=adapter)
        cache = tiny_target.new_cache()
        drafter.check_compatible(tiny_target)
        _, hidden = tiny_target.forward(context[:-1], cache, return_hidden=1)
        drafter.start(DraftStart(tiny_target, cache, context, SamplingConfig(), None, hidden))
        before = layer_lengths(cache)
    got = grow_by_levels(drafter, context, tokens, parents)
    for node, logits in got.items():
        seq = context + [tokens[j] for j in path_to(node, parents)]
        want = _reference(kind, tiny_target, tiny_close_drafter, adapter, seq)
        assert torch.allclose(logits, want, atol=1e-9, rtol=0), (kind, node)
    drafter.tree_end()
    if kind != "small_lm":
        assert layer_lengths(cache) == before  # the target finds its cache as it left it
        drafter.tree_commit(path_to(9, parents))


def test_compaction_to_the_accepted_path(tiny_close_drafter):
    rng = random.Random(3)
    context = [rng.randrange(32) for _ in range(5)]
    tokens, parents = random_tree(rng, 12, 32)
    drafter = SmallLMDrafter(tiny_close_drafter)
    drafter.start(DraftStart(tiny_close_drafter, None, context, SamplingConfig(), None))
    grow_by_levels(drafter, context, tokens, parents)
    drafter.tree_end()
    path = path_to(11, parents)
    drafter.tree_commit(path)
    seq = context + [tokens[j] for j in path]
    assert drafter.cached == seq
    fresh = tiny_close_drafter.new_cache()
    tiny_close_drafter.forward(seq, fresh)
    for a, b in zip(drafter.cache.layers, fresh.layers):
        assert a.keys.shape == b.keys.shape
        assert torch.allclose(a.keys, b.keys, atol=1e-9, rtol=0) and torch.allclose(a.values, b.values, atol=1e-9, rtol=0)
    # the next draft continues from the compacted cache: same logits as from scratch
    nxt = seq + [7]
    assert torch.allclose(drafter.score(nxt)[-1], tiny_close_drafter.forward(nxt, tiny_close_drafter.new_cache())[-1], atol=1e-9, rtol=0)


def test_a_path_partly_fed_keeps_its_fed_prefix(tiny_close_drafter):
    """The accepted path may end in leaves the drafter never fed: only the fed prefix is kept, and
    the next call feeds the rest."""
    context = [3, 1, 4, 1, 5]
    tokens, parents = [9, 2, 6, 5], [-1, -1, 0, 2]
    drafter = SmallLMDrafter(tiny_close_drafter)
    drafter.start(DraftStart(tiny_close_drafter, None, context, SamplingConfig(), None))
    drafter.tree_start(context)
    drafter.tree_level([0, 1], [9, 2], [-1, -1])  # node 2 and 3 are never fed
    drafter.tree_end()
    drafter.tree_commit([0, 2, 3])
    assert drafter.cached == context + [9]
    assert drafter.model.cache_len(drafter.cache) == len(context) + 1
    nxt = context + [9, 6, 5, 8]
    assert torch.allclose(drafter.score(nxt)[-1], tiny_close_drafter.forward(nxt, tiny_close_drafter.new_cache())[-1], atol=1e-9, rtol=0)


def test_unfed_parent_is_refused(tiny_close_drafter):
    drafter = SmallLMDrafter(tiny_close_drafter)
    drafter.start(DraftStart(tiny_close_drafter, None, [1, 2, 3], SamplingConfig(), None))
    drafter.tree_start([1, 2, 3])
    with pytest.raises(ValueError, match="has not been fed"):
        drafter.tree_level([5], [4], [2])
