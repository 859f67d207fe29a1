"""Bad input gets a clear error, before anything runs."""

import types

import pytest
import torch

from cascade import generate, load_model
from cascade.drafters import NGramDrafter, SmallLMDrafter
from cascade.models import tiny_llama
from cascade.models.lm import CausalLM
from cascade.types import SamplingConfig


def test_unknown_model_name():
    with pytest.raises(ValueError, match="unknown model 'no-such-model'.*zoo name"):
        load_model("no-such-model")


def test_missing_gguf_file(tmp_path):
    with pytest.raises(FileNotFoundError, match="GGUF file not found"):
        load_model(tmp_path / "absent.gguf")


def test_drafter_with_other_vocabulary_size(tiny_target):
    other = tiny_llama(vocab_size=48, seed=2)
    with pytest.raises(ValueError, match="vocabulary size 48.*32"):
        generate(tiny_target, [1, 2], drafter=SmallLMDrafter(other), max_new_tokens=4)


def test_drafter_with_same_size_other_tokenizer(tiny_target):
    def fake_tok(vocab):
        return types.SimpleNamespace(get_vocab=lambda: vocab)

    base = {f"t{i}": i for i in range(32)}
    swapped = dict(base, t0=1, t1=0)
    target = CausalLM(tiny_target.model, fake_tok(base), "target")
    drafter_lm = CausalLM(tiny_target.model, fake_tok(swapped), "drafter")
    with pytest.raises(ValueError, match="different tokenizers"):
        generate(target, [1, 2], drafter=SmallLMDrafter(drafter_lm), max_new_tokens=4)
    generate(target, [1, 2], drafter=SmallLMDrafter(CausalLM(tiny_target.model, fake_tok(dict(base)), "d")), max_new_tokens=2)


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(input_ids=[]), "empty prompt"),
        (dict(input_ids=torch.tensor([[1, 2], [3, 4]])), "batch size 2 is not supported"),
        (dict(input_ids=[[1, 2], [3, 4]]), "batch size > 1"),
        (dict(input_ids=[1] * 600), "exceeds the context"),
        (dict(input_ids=[1, 2], max_new_tokens=0), "max_new_tokens must be a positive integer"),
        (dict(input_ids=[1, 2], max_new_tokens=-3), "max_new_tokens must be a positive integer"),
        (dict(input_ids=[1, 99]), "outside the vocabulary"),
    ],
)
def test_generate_rejects_bad_input(tiny_target, kwargs, match):
    with pytest.raises(ValueError, match=match):
        generate(tiny_target, drafter=NGramDrafter(), **kwargs)


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(temperature=-0.5), "temperature must be a finite number >= 0"),
        (dict(temperature=float("nan")), "temperature must be a finite number >= 0"),
        (dict(temperature=1.0, top_p=0.0), r"top_p must lie in \(0, 1\]"),
        (dict(temperature=1.0, top_p=1.5), r"top_p must lie in \(0, 1\]"),
        (dict(temperature=1.0, top_k=0), "top_k must be a positive integer"),
    ],
)
def test_bad_sampling_settings_are_refused(kwargs, match):
    with pytest.raises(ValueError, match=match):
        SamplingConfig(**kwargs)


def test_generate_takes_sampling_one_way(tiny_target):
    """Sampling settings arrive as one SamplingConfig; loose scalars or a dict are refused."""
    with pytest.raises(TypeError, match="temperature"):
        generate(tiny_target, [1, 2], temperature=1.0)
    with pytest.raises(TypeError, match="sampling must be a SamplingConfig"):
        generate(tiny_target, [1, 2], sampling={"temperature": 1.0})


def test_bad_drafter_settings():
    with pytest.raises(ValueError, match="k"):
        NGramDrafter(k=0)
    with pytest.raises(ValueError, match="min_ngram"):
        NGramDrafter(max_ngram=1, min_ngram=2)
    with pytest.raises(ValueError, match="stop_below"):
        SmallLMDrafter(tiny_llama(), stop_below=1.5)
