"""`CausalLM`: the one wrapper every model goes through, as target or inside a drafter.

It exposes what speculative decoding needs and nothing model-specific: one forward over new
tokens at explicit positions on top of a KV cache (with an optional 4D attention mask for
trees, and optionally one layer's hidden states for self-drafters), and the cache operations:
length, crop to an accepted prefix, compaction to an accepted tree path. The cache is edited
only inside this package: here (crop, compaction), by its preallocated layers (kv_cache.py), by
the forwards that write them (lean.py) and by the layer-access helpers (layers.py: a layer
skip's own entries, removed before it returns). Model quirks (loading, tokenizers, layer access)
live in this package only.
"""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass, field

import torch
from transformers import DynamicCache, PreTrainedModel, PreTrainedTokenizerBase
from transformers.cache_utils import DynamicLayer

# FINAL_HIDDEN (return_hidden's "after the final norm") is defined beside the direct forward
from cascade.costs import ForwardShape
from cascade.models.backends.backend import Backend
from cascade.models.backends.direct import FINAL_HIDDEN, DirectDecoder, checked_direct_decoder
from cascade.models.kv_cache import PreallocatedLayer
from cascade.models.backends.lean import LeanDecoder

# What a forward may return beside its logits: None, one layer (``L`` after the first L decoder
# layers, or FINAL_HIDDEN), or several layers' states concatenated in the order given (EAGLE-3
# reads three; FINAL_HIDDEN may come last), [n, len(layers) * H].
HiddenLayers = int | tuple[int, ...] | None


def hidden_layers(return_hidden: HiddenLayers) -> tuple[int, ...]:
    """``return_hidden`` as a tuple of layer indices (empty for None)."""
    if return_hidden is None:
        return ()
    return tuple(return_hidden) if isinstance(return_hidden, tuple) else (return_hidden,)


# Who is told of every model forward (a virtual clock prices them: ``cascade.costs.VirtualClock``):
# callbacks ``(owner, name, shape, inputs, context)``, registered for a block by ``observe_forwards``;
# ``owner`` is the model (or draft head) that ran, ``shape()`` computes its ``ForwardShape``.
_FORWARD_OBSERVERS: list = []


@contextmanager
def observe_forwards(callback):
    """Within: ``callback(owner, name, shape, inputs, context)`` at every ``CausalLM.forward`` of
    any model and every draft head's forward (``notify_forward``)."""
    _FORWARD_OBSERVERS.append(callback)
    try:
        yield
    finally:
        _FORWARD_OBSERVERS.remove(callback)


def notify_forward(owner, name: str, shape, inputs: int, context: int) -> None:
    """Tell the observers that ``owner`` (called ``name``) ran a forward of ``inputs`` inputs over
    ``context`` cached positions (``shape()``: its ``cascade.costs.ForwardShape``, asked for only
    when needed)."""
    for observer in list(_FORWARD_OBSERVERS):
        observer(owner, name, shape, inputs, context)


@dataclass
class CausalLM:
    model: PreTrainedModel
    tokenizer: PreTrainedTokenizerBase | None
    name: str
    # The forward that runs: a LeanDecoder (native backends; ``cascade.models.backends.lean``), a
    # DirectDecoder (transformers' forward with its modules called directly; bitwise the same,
    # ``cascade.models.backends.direct``), or None: transformers' forward itself. Read as ``lean``; set
    # only through ``use_forward`` (the backend's loader, the direct forward's probe).
    _decoder: LeanDecoder | DirectDecoder | None = field(default=None, kw_only=True, repr=False)
    # At the first forward, with ``lean`` None: attach a DirectDecoder if it reproduces
    # transformers' forward bit for bit on a probe (else keep transformers'). False: leave ``lean``.
    auto_direct: bool = field(default=True, kw_only=True)
    # How the weights are held and multiplied (``cascade.models.backends.backend``): set by the loader that
    # applied it (``load_model``, ``quantized_copy``); None for a model built by hand.
    backend: Backend | None = field(default=None, kw_only=True)

    @property
    def lean(self) -> LeanDecoder | DirectDecoder | None:
        """The forward that runs (None: transformers')."""
        return self._decoder

    def use_forward(self, decoder: LeanDecoder | DirectDecoder | None) -> None:
        """The one way to set the forward that runs: a ``LeanDecoder``, a ``DirectDecoder`` or
        None (transformers'); no later automatic choice replaces it."""
        self._decoder = decoder
        self.auto_direct = False

    # ---- facts -------------------------------------------------------------------------
    @property
    def device(self) -> torch.device:
        # the input embedding's (where ``model.device``, the first parameter's, is too), without
        # walking the parameters on every forward
        embed = self.model.get_input_embeddings()
        weight = getattr(embed, "weight", None)
        return weight.device if isinstance(weight, torch.Tensor) else self.model.device

    @property
    def dtype(self) -> torch.dtype:
        return self.model.dtype

    @property
    def vocab_size(self) -> int:
        """Rows of the LM head, i.e. the length of every distribution this model produces."""
        return int(self.model.get_output_embeddings().out_features)

    @property
    def max_context(self) -> int:
        return int(getattr(self.model.config, "max_position_embeddings", 1 << 30))

    @property
    def eos_token_ids(self) -> set[int]:
        ids = getattr(self.model.generation_config, "eos_token_id", None)
        if ids is None:
            ids = getattr(self.model.config, "eos_token_id", None)
        if ids is None:
            return set()
        return {int(ids)} if isinstance(ids, int) else {int(i) for i in ids}

    # ---- cache ---------------------------------------------------------------------------
    def new_cache(self) -> DynamicCache:
        """A fresh KV cache: a ``DynamicCache`` whose layers are :class:`PreallocatedLayer`
        (appends in place). Refuses models with sliding-window layers: cropping and compacting
        such a layer would leave its bookkeeping (``cumulative_length``) stale."""
        cache = DynamicCache(config=self.model.config)
        sliding = [type(layer).__name__ for layer in cache.layers if type(layer) is not DynamicLayer]
        if sliding:
            raise NotImplementedError(
                f"model {self.name!r} has cache layers {sorted(set(sliding))} (sliding-window attention): "
                "cascade crops and compacts KV caches to accepted prefixes, which these layers do not support yet"
            )
        cache.layers = [PreallocatedLayer() for _ in cache.layers]
        return cache

    @staticmethod
    def cache_len(cache: DynamicCache) -> int:
        return int(cache.get_seq_length())

    @staticmethod
    def crop(cache: DynamicCache, length: int) -> None:
        """Keep the first ``length`` cached positions (the accepted prefix); drop the rest."""
        drop = int(cache.get_seq_length()) - length
        if drop < 0:
            raise ValueError(f"cannot crop a cache of {length + drop} positions to {length}")
        if drop:
            cache.crop(-drop)  # transformers 5: a negative count of tokens to remove

    @classmethod
    def compact(cls, cache: DynamicCache, past: int, keep: list[int]) -> None:
        """After a forward over n inputs on top of ``past`` cached positions, keep the ``past``
        positions plus the inputs ``keep`` (indices into those n inputs, increasing) in every
        layer; drop the rest. When ``keep`` is ``0 .. m-1`` (a chain's accepted prefix) this is
        a crop."""
        if keep == list(range(len(keep))):
            cls.crop(cache, past + len(keep))
            return
        idx = None
        for layer in cache.layers:
            if not getattr(layer, "is_initialized", True) or layer.keys is None or layer.keys.numel() == 0:
                continue
            if idx is None or idx.device != layer.keys.device:
                idx = torch.tensor(keep, device=layer.keys.device)
            kept_keys = layer.keys[..., past:, :].index_select(-2, idx)  # [B, Hkv, len(keep), D]
            kept_values = layer.values[..., past:, :].index_select(-2, idx)
            layer.crop(past - int(layer.get_seq_length()))
            layer.update(kept_keys, kept_values)

    # ---- forward -------------------------------------------------------------------------
    @torch.inference_mode()
    def forward(
        self,
        tokens: torch.Tensor | list[int],  # [n]
        cache: DynamicCache,
        position_ids: torch.Tensor | None = None,  # [n]; default: cache_len .. cache_len+n-1
        attention_mask: torch.Tensor | None = None,  # [1, 1, n, cache_len + n] float, 0 / -inf
        keep_last: int | None = None,
        return_hidden: HiddenLayers = None,
    ):
        """Run ``tokens`` on top of ``cache`` (which grows by n). Returns logits [n, V], or
        [keep_last, V] for the last positions only (the LM head is skipped on the others).

        ``return_hidden=L`` also returns the hidden states after the first ``L`` decoder layers
        (before the final norm), [n, H]: ``(logits, hidden)``; ``return_hidden=FINAL_HIDDEN``
        (-1) the last layer's after the final norm (the LM head's input). Self-drafters (an early
        exit with an adapter, a draft head) read the target's own states this way, in tree order
        for a tree forward. A tuple of layers returns their states concatenated, [n, len * H]
        (FINAL_HIDDEN may end it: EAGLE-3's training capture reads three layers and the LM head's
        input in one forward)."""
        device = self.device
        ids = torch.as_tensor(tokens, dtype=torch.long, device=device).reshape(1, -1)  # [1, n]
        n = ids.shape[1]
        if position_ids is None:
            start = self.cache_len(cache)
            position_ids = torch.arange(start, start + n, device=device)
        if return_hidden is not None:
            layers = int(self.model.config.num_hidden_layers)
            wanted = hidden_layers(return_hidden)
            bad = [i for i in wanted if not (i == FINAL_HIDDEN or 1 <= i < layers)]
            if bad or FINAL_HIDDEN in wanted[:-1] or (isinstance(return_hidden, tuple) and not wanted):
                raise ValueError(f"return_hidden must name layers in [1, {layers - 1}], FINAL_HIDDEN (-1) only last, "
                                 f"got {return_hidden}")
        self._choose_forward()
        if _FORWARD_OBSERVERS:
            notify_forward(self, self.name, lambda: ForwardShape.of(self), n, self.cache_len(cache))
        if self.lean is not None:
            return self.lean.forward(ids[0], cache, position_ids.reshape(-1).to(device), attention_mask,
                                     keep_last, return_hidden)
        return self.transformers_forward(ids[0], cache, position_ids, attention_mask, keep_last, return_hidden)

    def _choose_forward(self) -> None:
        if self.auto_direct:  # decided once, at the first forward
            self.auto_direct = False
            if self._decoder is None:
                observers = _FORWARD_OBSERVERS[:]
                _FORWARD_OBSERVERS.clear()  # the probe's forwards are not the caller's: no clock prices them
                try:
                    self._decoder = checked_direct_decoder(self)
                finally:
                    _FORWARD_OBSERVERS.extend(observers)

    @contextmanager
    def module_calls(self):
        """Within: a direct forward calls every module as a module, so that forward hooks (a
        profiler's, a diagnostic's) see each layer, attention, MLP and linear; bitwise the same
        forward. (The native lean forward calls kernels, not modules: unchanged.)"""
        self._choose_forward()
        saved = self._decoder
        if isinstance(saved, DirectDecoder):
            self._decoder = DirectDecoder(self.model, explicit=False)
        try:
            yield self
        finally:
            self._decoder = saved

    @torch.inference_mode()
    def transformers_forward(self, tokens: torch.Tensor | list[int], cache: DynamicCache,
                             position_ids: torch.Tensor | None = None, attention_mask: torch.Tensor | None = None,
                             keep_last: int | None = None, return_hidden: HiddenLayers = None):
        """:meth:`forward` through ``model(...)`` itself, whatever ``lean`` holds (the reference
        the lean and direct forwards are checked against)."""
        ids = torch.as_tensor(tokens, dtype=torch.long, device=self.device).reshape(1, -1)  # [1, n]
        if position_ids is None:
            start = self.cache_len(cache)
            position_ids = torch.arange(start, start + ids.shape[1], device=self.device)
        wanted = hidden_layers(return_hidden)
        out = self.model(
            input_ids=ids,
            cache=cache,
            position_ids=position_ids.reshape(1, -1).to(self.device),
            attention_mask=attention_mask,
            use_cache=True,
            logits_to_keep=keep_last or 0,
            output_hidden_states=return_hidden is not None,
        )
        if return_hidden is None:
            return out.logits[0]  # [n, V] or [keep_last, V]
        return out.logits[0], torch.cat([out.hidden_states[i][0] for i in wanted], -1)  # [n, V], [n, len(wanted) * H]

    def top2_gap(self, ids: list[int]) -> float:
        """Gap between the two largest next-token logits after ``ids``: how near a tie the greedy
        choice is (used to report greedy divergences caused by batched numerics)."""
        logits = self.forward(ids, self.new_cache(), keep_last=1)[-1].float()
        top = torch.topk(logits, 2).values
        return float(top[0] - top[1])

    def encode(self, text: str) -> list[int]:
        """Token ids of ``text``. Models without a tokenizer (tiny test models with a vocabulary of
        at least 256) use the UTF-8 bytes as ids."""
        if self.tokenizer is None:
            if self.vocab_size < 256:
                raise ValueError(f"model {self.name!r} has no tokenizer; pass token ids instead of text")
            return list(text.encode("utf-8"))
        return list(self.tokenizer(text, add_special_tokens=True)["input_ids"])

    def decode(self, ids: list[int]) -> str:
        if self.tokenizer is None:
            return " ".join(map(str, ids))
        return self.tokenizer.decode(ids, skip_special_tokens=False)
