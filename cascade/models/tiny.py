"""Tiny random Llama-family models built in code, for tests and ``debug=tiny`` runs.

Initialised with a larger ``initializer_range`` than a real model so that next-token
distributions are far from uniform: greedy decisions are then robust and sampling tests
distinguish right from wrong distributions.
"""

from __future__ import annotations

import torch
from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM

from cascade.models.lm import CausalLM
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
) -> CausalLM:
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
    return CausalLM(model=model, tokenizer=None, name=name or f"tiny-llama-s{seed}")


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
