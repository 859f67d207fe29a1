"""Summaries from hand-made step records."""

import dataclasses

import pytest

from cascade.decode import Generation
from cascade.metrics import alpha_by_depth, decomposition, prediction, speedup, summarize
from cascade.summary import RunStats
from cascade.tree_structure import chain_parents
from cascade.types import StepRecord


def _stats(**fields) -> RunStats:
    """RunStats with the given fields, neutral values for the rest."""
    base = dict(num_generations=1, new_tokens=0, target_forwards=1, tau=1.0, alpha=None, alpha_by_drafter={},
                c_by_drafter={}, alpha_by_depth=[], drafted_per_step=0.0, draft_time_per_token_s=None, tokens_per_s=1.0,
                wall_time_s=1.0, prefill_time_s=0.0, drafter_prefill_time_s=0.0, target_time_per_forward_s=1.0,
                draft_frac=0.0, overhead_frac=0.0, levels={})
    return RunStats(**{**base, **fields})


def _step(drafted, accepted, emitted=None, draft_t=0.1, target_t=1.0, drafter="d"):
    emitted = accepted + 1 if emitted is None else emitted
    return StepRecord(0, drafter, drafted, accepted, emitted, [0] * drafted, [0] * emitted, [0] * (drafted + 1),
                      draft_t, target_t, draft_t + target_t + 0.01, parents=chain_parents(drafted),
                      accepted_path=list(range(accepted)))


def test_summary_counts_the_bonus_token_and_sums_over_steps():
    steps = [_step(4, 4), _step(4, 1), _step(4, 0), _step(2, 2, emitted=2)]
    gen = Generation(tokens=[0] * 11, prompt_len=3, steps=steps, wall_time_s=5.0, prefill_time_s=0.5, stop_reason="max_new_tokens")
    s = summarize([gen])
    assert s.tau == pytest.approx((5 + 2 + 1 + 2) / 4)
    assert s.alpha == pytest.approx(7 / 14)
    assert s.c_by_drafter["d"] == pytest.approx((0.4 / 14) / 1.0)
    assert s.tokens_per_s == pytest.approx(11 / 5.0)
    assert s.overhead_frac == pytest.approx(0.04 / sum(st.step_time_s for st in steps))
    assert s.alpha_by_depth == pytest.approx([3 / 4, 2 / 3, 1.0, 1.0])


def test_alpha_by_depth_only_counts_reached_positions():
    assert alpha_by_depth([_step(3, 0), _step(3, 0)]) == [0.0]
    assert alpha_by_depth([_step(0, 0)]) == []


def test_speedup_and_prediction_use_totals():
    base = _stats(tokens_per_s=2.0, target_time_per_forward_s=0.5)
    method = _stats(tokens_per_s=3.0, alpha=0.8, drafted_per_step=4.0, draft_time_per_token_s=0.05,
                    target_time_per_forward_s=1.0, alpha_by_depth=[0.9, 0.8, 0.8, 0.7])
    assert speedup(method, base) == 1.5
    p = decomposition(method, base)
    el = (1 - 0.8**5) / 0.2
    assert p.formula_speedup == pytest.approx(el / (1 + 4 * 0.1))
    assert p.formula_speedup_verify_cost == pytest.approx(el / (2 + 4 * 0.1))
    assert p.formula_tau_iid == pytest.approx(el)
    assert p.decomposed_tau_per_depth == pytest.approx(1 + 0.9 + 0.72 + 0.576 + 0.4032)
    assert p.decomposed_speedup_per_depth == pytest.approx(p.decomposed_tau_per_depth / (2 + 4 * 0.1))
    assert p.measured_over_formula == pytest.approx(1.5 / p.formula_speedup)


def test_prediction_uses_only_the_fit():
    """The held-out prediction is computed from the fit's numbers alone: changing what was
    measured on the held-out prompts moves only the measured side."""
    fit_base = _stats(tokens_per_s=2.0, target_time_per_forward_s=0.5)
    fit = _stats(tokens_per_s=3.0, tau=4.0, alpha=0.8, drafted_per_step=4.0, draft_time_per_token_s=0.05,
                 target_time_per_forward_s=1.0, alpha_by_depth=[0.9, 0.8, 0.8, 0.7])
    test_base = _stats(tokens_per_s=2.0, target_time_per_forward_s=0.5)
    tau = 1 + 0.9 + 0.72 + 0.576 + 0.4032
    for measured_tps, measured_tau in ((4.0, 5.0), (1.0, 1.5)):
        test = dataclasses.replace(fit, tokens_per_s=measured_tps, tau=measured_tau, alpha_by_depth=[0.1, 0.1])
        p = prediction(fit, fit_base, test, test_base)
        assert p.predicted_tau == pytest.approx(tau)
        assert p.predicted_speedup == pytest.approx(tau / (2 + 4 * 0.1))
        assert p.measured_speedup == pytest.approx(measured_tps / 2.0) and p.measured_tau == measured_tau
        assert p.measured_over_predicted == pytest.approx(p.measured_speedup / p.predicted_speedup)
    # nothing drafted in the fit: no prediction
    assert prediction(dataclasses.replace(fit, drafted_per_step=0.0), fit_base, fit, test_base).predicted_speedup is None
