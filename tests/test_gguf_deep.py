"""Sampling losslessness on a GGUF-quantized target: the deep cells' harness (tests/deep_stats.py,
tests/test_lossless_deep.py) with the damped tiny Llama written as a GGUF file (Q8_0 attention,
Q5_0 gate / up, Q4_1 down and LM head, Q8_0 embedding; q / k rows permuted as llama.cpp's
converter writes them) and decoded on the ``gguf`` backend by a chain, a static tree and DyTC.
Each cell's law of 6 tokens is compared with the exact law of an independent float64 model
holding the file's weights as the ``gguf`` package dequantizes them."""

import pytest
import torch

from cascade.models import perturbed_copy
from cascade.models.backends.native import native_kernels
from deep_stats import exact_law, lossless_pvalue, sample_outputs
from gguf_files import LEGACY, gguf_copy, reference_model
from test_lossless_deep import L, PROMPTS, SETTINGS, V, _assert_lossless, damped, methods

pytestmark = pytest.mark.skipif(native_kernels() is None, reason="cascade's native kernels do not build here")
CELLS = [("chain_small_lm", "temperature", 0), ("static_tree", "top_k", 1), ("dynamic_tree", "top_p", 0)]


@pytest.fixture(scope="module")
def gguf_models(tmp_path_factory):
    target, file = gguf_copy(damped, tmp_path_factory.mktemp("gguf_deep") / "damped.gguf", LEGACY, seed=11)
    reference = reference_model(target, file)
    assert reference.model.config.vocab_size == V
    # drafters close to the file's model (accepted often, rejected at every depth), as in the deep cells
    return target, reference, perturbed_copy(reference, 0.35, seed=3), perturbed_copy(reference, 0.6, seed=4)


@pytest.mark.parametrize("method,setting,prompt", CELLS)
def test_deep_drafts_on_a_gguf_target_are_lossless(method, setting, prompt, gguf_models):
    target, reference, close, far = gguf_models
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        samples = sample_outputs(target, methods(target, close, far)[method], PROMPTS[prompt], L, 1000, 0, SETTINGS[setting])
    finally:
        torch.set_num_threads(threads)
    p = lossless_pvalue(samples, exact_law(reference.model, PROMPTS[prompt], L, **SETTINGS[setting]))
    _assert_lossless(method, f"gguf target {method}/{setting}/prompt {prompt}", samples, p, setting)


def test_a_broken_rule_is_caught_on_the_gguf_target(gguf_models):
    """The same cell with a broken verification rule (q read at the wrong position) fails: the
    test has power on this target."""
    from broken_doubles import VERIFIERS as BROKEN

    target, reference, close, far = gguf_models
    samples = sample_outputs(target, methods(target, close, far)["chain_small_lm"], PROMPTS[0], L, 1000, 0,
                             SETTINGS["temperature"], verifier=BROKEN["q_wrong_position"])
    assert lossless_pvalue(samples, exact_law(reference.model, PROMPTS[0], L, **SETTINGS["temperature"])) < 1e-3
