import pytest
import torch

from cascade.models import perturbed_copy, tiny_llama

torch.set_num_threads(2)


@pytest.fixture(scope="session")
def tiny_target():
    """Float64 tiny random Llama, vocabulary 32: greedy equality is exact."""
    return tiny_llama(vocab_size=32, seed=0)


@pytest.fixture(scope="session")
def tiny_close_drafter(tiny_target):
    """Agrees with the target often (greedy alpha ~0.3-0.7), but not always."""
    return perturbed_copy(tiny_target, noise=0.05, seed=1)


@pytest.fixture(scope="session")
def tiny_far_drafter():
    """An unrelated random model with the same vocabulary: mostly rejected."""
    return tiny_llama(vocab_size=32, seed=7)
