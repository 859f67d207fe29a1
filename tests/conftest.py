import os

import pytest
import torch

from cascade.models import perturbed_copy, tiny_llama

# Under pytest-xdist every worker is a process of its own: one torch thread each (and in the
# subprocesses tests start), so that two workers on two cores do not oversubscribe them.
if os.environ.get("PYTEST_XDIST_WORKER"):
    os.environ["OMP_NUM_THREADS"] = "1"
    torch.set_num_threads(1)
else:
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


@pytest.fixture(autouse=True)
def _one_thread_per_xdist_worker():
    """A test that sets torch's threads (``cascade.run`` takes ``threads`` from its config) does
    not leave them for the worker's next tests."""
    yield
    if os.environ.get("PYTEST_XDIST_WORKER"):
        torch.set_num_threads(1)


@pytest.fixture
def no_model_loading(monkeypatch):
    """Any model load (the run's target, or a method's models through ``cascade.models``) fails the
    test: what it checks must be refused before any model loads."""
    import cascade.models
    import cascade.models.loading
    from cascade import run as run_mod

    def refuse(*a, **k):
        raise AssertionError("a model was loaded before the bad input was found")

    for module in (run_mod, cascade.models, cascade.models.loading):
        monkeypatch.setattr(module, "load_model", refuse)
