"""The KV cache layer cascade's models write: keys and values in a preallocated buffer that
doubles when full (appends in place), cropped by shortening its filled part. ``CausalLM`` makes
caches of these layers and owns them (``cascade.models.lm``); the lean forward writes a call's
keys and values straight into the reserved positions (``reserve``)."""

from __future__ import annotations

import torch
from transformers.cache_utils import DynamicLayer

INITIAL_CAPACITY = 256  # positions a cache layer's buffer holds before it first doubles


class PreallocatedLayer(DynamicLayer):
    """A ``DynamicLayer`` whose keys and values live in a buffer [B, Hkv, capacity, D] that doubles
    when full: appending n positions writes them in place, where ``DynamicLayer`` concatenates
    the whole cache (every layer, every token). ``keys`` / ``values`` are views of the filled
    part; crop shortens the filled part; assigning them (transformers' resets) copies in."""

    def __init__(self) -> None:
        self._k: torch.Tensor | None = None  # [B, Hkv, capacity, D]
        self._v: torch.Tensor | None = None
        self.length = 0
        super().__init__()

    @property
    def keys(self) -> torch.Tensor | None:
        return None if self._k is None else self._k[:, :, : self.length]

    @keys.setter
    def keys(self, value: torch.Tensor | None) -> None:
        self._assign("_k", value)

    @property
    def values(self) -> torch.Tensor | None:
        return None if self._v is None else self._v[:, :, : self.length]

    @values.setter
    def values(self, value: torch.Tensor | None) -> None:
        self._assign("_v", value)

    @torch.inference_mode()  # the buffers are inference tensors (made inside forwards)
    def _assign(self, buffer: str, value: torch.Tensor | None) -> None:
        if value is None or value.numel() == 0:
            if value is None:
                setattr(self, buffer, None)
            self.length = 0
            return
        self._reserve(value, value.shape[-2])
        getattr(self, buffer)[:, :, : value.shape[-2]].copy_(value)
        self.length = value.shape[-2]

    def _reserve(self, like: torch.Tensor, needed: int) -> None:
        for name in ("_k", "_v"):
            buf = getattr(self, name)
            if buf is None or buf.shape[2] < needed:
                capacity = max(INITIAL_CAPACITY, needed, 2 * (0 if buf is None else buf.shape[2]))
                grown = like.new_empty(*like.shape[:2], capacity, like.shape[-1])
                if buf is not None:
                    grown[:, :, : self.length].copy_(buf[:, :, : self.length])
                setattr(self, name, grown)

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        self.device = key_states.device
        self.is_initialized = True

    @torch.inference_mode()
    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        n = key_states.shape[-2]
        self._reserve(key_states, self.length + n)
        self._k[:, :, self.length: self.length + n].copy_(key_states)
        self._v[:, :, self.length: self.length + n].copy_(value_states)
        self.length += n
        return self.keys, self.values

    @torch.inference_mode()
    def reserve(self, like: torch.Tensor, n: int) -> tuple[torch.Tensor, torch.Tensor, int]:
        """Room for ``n`` more positions, claimed: returns the key and value buffers
        [B, Hkv, capacity, D] (shaped and typed like ``like``, [B, Hkv, *, D]) and the first new
        position; the layer then holds ``start + n`` positions, and the caller writes positions
        [start, start + n) of both buffers before anything reads them (the lean forward's
        ``layer_step``): :meth:`update` without its copies."""
        if not self.is_initialized:
            self.lazy_initialization(like, like)
        start = self.length
        self._reserve(like, start + n)
        self.length = start + n
        return self._k, self._v, start

    def get_seq_length(self) -> int:
        return self.length

    def crop(self, tokens_to_remove: int) -> None:
        if tokens_to_remove > 0:
            raise ValueError("crop takes a negative count of positions to remove (as transformers' DynamicLayer)")
        self.length = max(0, self.length + tokens_to_remove)

    def reset(self) -> None:
        self.length = 0
