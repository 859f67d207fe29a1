"""Tiny random Llama-family models built in code, for tests and ``debug=tiny`` runs.

Initialised with a larger ``initializer_range`` than a real model so that next-token
distributions are far from uniform: greedy decisions are then robust and sampling tests
distinguish right from wrong distributions.
"""

from __future__ import annotations

import json

import torch
from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

from cascade.models.lm import CausalLM
from cascade.models.vocabulary import ByteVocabulary
from cascade.models.devices import resolve_device, resolve_dtype


def tiny_llama(
    vocab_size: int = 64,
    hidden_size: int = 32,
    num_layers: int = 2,
    num_heads: int = 4,
    num_kv_heads: int = 2,
    max_context: int = 512,
    seed: int = 0,
    init_range: float = 0.25,
    dtype: str | torch.dtype = "float64",
    device: str | torch.device | None = "cpu",
    eos_token_id: int | None = None,
    name: str | None = None,
    tokenizer: PreTrainedTokenizerFast | None = None,
) -> CausalLM:
    """``tokenizer``: the model's tokenizer (``vocab_size`` is then its length); None: the
    model's ids are bytes (``CausalLM.encode``)."""
    if tokenizer is not None:
        vocab_size = len(tokenizer)
    config = LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        intermediate_size=2 * hidden_size,
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=num_kv_heads,
        max_position_embeddings=max_context,
        initializer_range=init_range,
        tie_word_embeddings=False,
        bos_token_id=None,
        eos_token_id=eos_token_id,
        pad_token_id=None,
    )
    config._attn_implementation = "sdpa"
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config).to(resolve_dtype(dtype)).to(resolve_device(device)).eval()
    model.generation_config = GenerationConfig(eos_token_id=eos_token_id)
    return CausalLM(model=model, tokenizer=tokenizer, name=name or f"tiny-llama-s{seed}")


# What the tiny tokenizers learn their merges from: a little Python and English.
TINY_CORPUS = (
    "def add(a, b):\n    return a + b\n\n",
    "def fibonacci(n):\n    if n < 2:\n        return n\n    return fibonacci(n - 1) + fibonacci(n - 2)\n",
    "for i in range(10):\n    print(i, i * i)\n",
    "The quick brown fox jumps over the lazy dog. The dog sleeps; the fox runs home.\n",
    "Question: how many apples are there in total if there are three baskets of four? Answer: 12.\n",
)


def tiny_bpe_tokenizer(vocab_size: int = 320, seed: int = 0) -> PreTrainedTokenizerFast:
    """A byte-level BPE tokenizer: the 256 bytes plus ``vocab_size - 256`` merges learned from
    ``TINY_CORPUS``, its ids shuffled by ``seed``. Two sizes share their first merges, so two
    such tokenizers are different vocabularies with a large intersection under different ids
    (what cross-tokenizer drafting is tested on)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    if vocab_size < 256:
        raise ValueError(f"a byte-level vocabulary has at least 256 tokens, got vocab_size={vocab_size}")
    trained = Tokenizer(models.BPE())
    trained.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    trained.train_from_iterator(TINY_CORPUS, trainer)
    spec = json.loads(trained.to_str())["model"]
    strings = sorted(spec["vocab"], key=spec["vocab"].get)
    order = torch.randperm(len(strings), generator=torch.Generator().manual_seed(seed)).tolist()
    vocab = {text: order[i] for i, text in enumerate(strings)}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[tuple(m) for m in spec["merges"]]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    return PreTrainedTokenizerFast(tokenizer_object=tok)


def text_aligned_copy(base: CausalLM, tokenizer: PreTrainedTokenizerFast, noise: float = 0.0, seed: int = 1,
                      name: str | None = None) -> CausalLM:
    """``base`` re-expressed in another byte-level vocabulary: a token that is the same byte
    string in both keeps its embedding and LM-head rows, any other gets random ones; every weight
    then gets relative noise ``noise``. A drafter with another tokenizer that agrees with ``base``
    on the text they share, often but not always."""
    source, dest = ByteVocabulary.of_model(base), ByteVocabulary.of_tokenizer(tokenizer)
    rows = {source.key(i): i for i in range(source.size) if source.token_bytes[i]}
    config = LlamaConfig(**{**base.model.config.to_dict(), "vocab_size": len(tokenizer)})
    config._attn_implementation = base.model.config._attn_implementation
    gen = torch.Generator().manual_seed(seed)
    model = LlamaForCausalLM(config).to(base.dtype).eval()
    state = {k: v for k, v in base.model.state_dict().items() if "embed_tokens" not in k and "lm_head" not in k}
    model.load_state_dict(state, strict=False)
    with torch.no_grad():
        for new, old in ((model.model.embed_tokens.weight, base.model.model.embed_tokens.weight),
                         (model.lm_head.weight, base.model.lm_head.weight)):
            new.copy_(torch.randn(new.shape, generator=gen, dtype=torch.float64).to(new.dtype) * old.std())
            for d in range(dest.size):
                i = rows.get(dest.key(d))
                if i is not None:
                    new[d] = old[i]
        for param in model.parameters():
            jitter = torch.randn(param.shape, generator=gen, dtype=torch.float64).to(param.dtype)
            param.add_(noise * param.abs().mean() * jitter)
    model.generation_config = GenerationConfig(**base.model.generation_config.to_dict())
    return CausalLM(model=model.to(base.device), tokenizer=tokenizer, name=name or f"{base.name}-as-{len(tokenizer)}")


def perturbed_copy(base: CausalLM, noise: float, seed: int = 1, name: str | None = None) -> CausalLM:
    """A copy of ``base`` with Gaussian noise of relative scale ``noise`` on every weight.

    A drafter that agrees with the target often but not always: exercises both acceptance and
    rejection in tests.
    """
    config = base.model.config
    gen = torch.Generator().manual_seed(seed)
    model = LlamaForCausalLM(config).to(base.dtype).to(base.device).eval()
    model.load_state_dict(base.model.state_dict())
    with torch.no_grad():
        for param in model.parameters():
            jitter = torch.randn(param.shape, generator=gen, dtype=torch.float64).to(param.dtype)
            param.add_(noise * param.abs().mean() * jitter.to(param.device))
    model.generation_config = GenerationConfig(**base.model.generation_config.to_dict())
    return CausalLM(model=model, tokenizer=None, name=name or f"{base.name}-perturbed{noise}")
