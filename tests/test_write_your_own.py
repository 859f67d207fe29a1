"""The drafter docs/methods.md shows ("Write your own drafter"), run as written: greedy output
equal to autoregressive decoding in every role it claims (alone, horizontal entry, vertical
cascade's lower level, token-tree member), chi-square cells against the exact law of a float64
model in the same roles, and a variant reporting a q other than the one it sampled from caught
by the same cell."""

from __future__ import annotations

import random
import re
from pathlib import Path

import pytest
import torch

from cascade import generate
from cascade.cascades import HorizontalCascade, VerticalCascade
from cascade.drafters.base import Drafter
from cascade.drafters.small_lm import SmallLMDrafter
from cascade.trees.drafter import DynamicTreePolicy, TreeDrafter
from deep_stats import exact_law, lossless_pvalue, sample_outputs
from test_lossless_deep import L, PROMPTS, SETTINGS, _assert_lossless, models  # noqa: F401 (fixture)

DOC = Path(__file__).resolve().parents[1] / "docs" / "methods.md"


def _example() -> type[Drafter]:
    """The first python block under "Write your own drafter", executed; its drafter class."""
    text = DOC.read_text().split("## Write your own drafter", 1)[1]
    block = re.search(r"```python\n(.*?)```", text, re.S).group(1)
    namespace: dict = {}
    exec(compile(block, str(DOC), "exec"), namespace)
    return namespace["BigramDrafter"]


BigramDrafter = _example()


def roles(close):
    """Each role the example claims, as a drafter factory."""
    return {
        "alone": lambda: BigramDrafter(k=5),
        "horizontal_entry": lambda: HorizontalCascade([(BigramDrafter(k=2), 2), (SmallLMDrafter(close, k=3), 3)]),
        "vertical_lower": lambda: VerticalCascade([SmallLMDrafter(close, k=5), BigramDrafter(k=2)]),
        "tree_member": lambda: TreeDrafter([SmallLMDrafter(close), BigramDrafter(k=1)],
                                           DynamicTreePolicy(t_min=0.02, max_nodes=16, max_depth=5, max_rank=1,
                                                             prior_drafter_cost=0.01, prior_verify_slope=0.005,
                                                             measure_costs=False)),
    }


def test_the_example_is_short_and_needs_only_the_core():
    """About 30 lines; it overrides the three core methods and nothing else of the protocol."""
    assert set(vars(BigramDrafter)) & {"start", "propose", "observe"} == {"start", "propose", "observe"}
    assert not set(vars(BigramDrafter)) & {"check_compatible", "draft_cache", "describe"}
    lines = [ln for ln in re.search(r"```python\n(.*?)```", DOC.read_text().split("## Write your own drafter", 1)[1],
                                    re.S).group(1).splitlines() if ln.strip()]
    assert len(lines) <= 40


@pytest.mark.parametrize("role", ["alone", "horizontal_entry", "vertical_lower", "tree_member"])
def test_greedy_output_is_autoregressive(role, tiny_target, tiny_close_drafter):
    make = roles(tiny_close_drafter)[role]
    drafter = make()
    rng = random.Random(5)
    accepted = 0
    for _ in range(4):
        motif = [rng.randrange(32) for _ in range(3)]
        prompt = (motif * 4)[: rng.randint(2, 12)]
        ar = generate(tiny_target, prompt, max_new_tokens=20, stop_on_eos=False)
        sp = generate(tiny_target, prompt, drafter=drafter, max_new_tokens=20, stop_on_eos=False)
        assert sp.tokens == ar.tokens, (role, prompt)
        accepted += sum(s.accepted for s in sp.steps)
    assert accepted > 0


CELLS = [("alone", "temperature", 0), ("vertical_lower", "top_k", 1), ("tree_member", "top_p", 0)]


def _samples(models, role, setting, prompt, drafter=None):
    target, close, _ = models
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        samples = sample_outputs(target, drafter or roles(close)[role], PROMPTS[prompt], L, 1000, 0, SETTINGS[setting])
    finally:
        torch.set_num_threads(threads)
    return samples, lossless_pvalue(samples, exact_law(target.model, PROMPTS[prompt], L, **SETTINGS[setting]))


@pytest.mark.parametrize("role,setting,prompt", CELLS)
def test_sampled_output_follows_the_target(role, setting, prompt, models):
    samples, p = _samples(models, role, setting, prompt)
    _assert_lossless(role, f"BigramDrafter {role}/{setting}/prompt {prompt}", samples, p, setting)


class _ReportsUniform(BigramDrafter):
    """Broken: samples from its counts but reports the uniform law over the tokens it has seen follow."""

    def propose(self, context, budget):
        block = super().propose(context, budget)
        if block.q is not None:
            block.q = (block.q > 0).to(block.q.dtype)
            block.q /= block.q.sum(-1, keepdim=True)
        return block


def test_a_drafter_misreporting_q_is_caught(models):
    samples, p = _samples(models, "alone", "temperature", 0, drafter=lambda: _ReportsUniform(k=5))
    assert p < 1e-3, f"a misreported q passed: p={p:.2g}; {samples.depth_report()}"
