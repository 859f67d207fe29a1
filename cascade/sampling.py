"""Logits -> probabilities under a :class:`SamplingConfig`, and sampling with an explicit generator.

Pure functions. The same processing is applied to the target's and the drafter's logits, so the
``p`` and ``q`` that the verifier compares are the distributions tokens are really drawn from.
Temperature, top-k and top-p reuse transformers' logits warpers (same semantics as
``model.generate``), applied in that order.
"""

from __future__ import annotations

import torch
from transformers.generation.logits_process import (
    LogitsProcessorList,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

from cascade.types import SamplingConfig


def _warpers(cfg: SamplingConfig) -> LogitsProcessorList:
    warpers = LogitsProcessorList()
    if cfg.temperature != 1.0:
        warpers.append(TemperatureLogitsWarper(cfg.temperature))
    if cfg.top_k is not None:
        warpers.append(TopKLogitsWarper(cfg.top_k))
    if cfg.top_p is not None and cfg.top_p < 1.0:
        warpers.append(TopPLogitsWarper(cfg.top_p))
    return warpers


def _as_float(logits: torch.Tensor) -> torch.Tensor:
    # bf16/fp16 softmax loses mass in the tail; compute probabilities in at least fp32.
    return logits if logits.dtype in (torch.float32, torch.float64) else logits.float()


def one_hot_rows(tokens, like: torch.Tensor) -> torch.Tensor:
    """[n, V] the distribution a deterministic draft was drawn from: one-hot on each of ``tokens``
    ([n] ids, a list or tensor), in ``like``'s dtype and device (``like``: [..., V])."""
    ids = torch.as_tensor(tokens, dtype=torch.long, device=like.device).reshape(-1)
    return torch.nn.functional.one_hot(ids, like.shape[-1]).to(like.dtype)


def logits_to_probs(logits: torch.Tensor, cfg: SamplingConfig) -> torch.Tensor:
    """Processed probabilities.

    logits: [..., V]. Returns [..., V] (float32 or float64). Greedy configs return the one-hot
    distribution on the argmax, which is what greedy decoding samples from.
    """
    logits = _as_float(logits)
    if cfg.greedy:
        return torch.nn.functional.one_hot(logits.argmax(-1), logits.shape[-1]).to(logits.dtype)
    flat = logits.reshape(-1, logits.shape[-1])  # [N, V]
    # The warpers never read input_ids for temperature/top-k/top-p; pass an empty placeholder.
    dummy_ids = torch.empty((flat.shape[0], 0), dtype=torch.long, device=flat.device)
    scores = _warpers(cfg)(dummy_ids, flat)
    return torch.softmax(scores, dim=-1).reshape(logits.shape)


def sample(probs: torch.Tensor, generator: torch.Generator | None) -> torch.Tensor:
    """Draw one token per row. probs: [..., V] -> [...] int64."""
    flat = probs.reshape(-1, probs.shape[-1])
    out = torch.multinomial(flat, 1, generator=generator).squeeze(-1)
    return out.reshape(probs.shape[:-1])


def make_generator(seed: int | None, device: torch.device | str = "cpu") -> torch.Generator:
    """A generator seeded once per generation (never reseeded inside the loop)."""
    gen = torch.Generator(device=device)
    if seed is None:
        gen.seed()
    else:
        gen.manual_seed(int(seed))
    return gen
