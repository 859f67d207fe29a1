"""Behaviour unchanged across refactors: the tokens of ten methods on the tiny models (greedy, and
sampled with fixed seeds) and of three on the real 1.5B / 0.5B equal the golden files
(tests/golden.py wrote them at f1b2d85, before the Backend value, the C++ split and the decode
loop's split; `python tests/golden.py check --real` runs both)."""

import pytest

import golden


def test_tiny_methods_generate_the_golden_tokens():
    assert golden.differences("tiny") == []


@pytest.mark.real
@pytest.mark.slow  # the 1.5B and the 0.5B (1.6 GB fetched once): not in the default suite
def test_real_models_generate_the_golden_tokens():
    assert golden.differences("real") == []
