"""Self-drafting with an early exit of the target: the layer-skip drafter (and Kangaroo's adapter).

``LayerSkipDrafter(exit_layer)`` drafts with the target's first ``exit_layer`` decoder layers,
then its final norm and LM head: the target's own weights (no copy) and the target's own KV
cache for the committed prefix, so drafting needs no prefill. Cache discipline (see
``Drafter.bind``): at a draft's start the cache holds the committed prefix (P positions) in every
layer; drafting appends positions to layers ``< exit_layer`` only, and they are cropped back to
P before ``propose``/``score`` returns, so the target's verification finds its cache as it left
it. P is read from the last layer, which drafting never touches (hence ``exit_layer`` must be
below the number of layers).

With ``adapter`` (an ``ExitAdapter``, Kangaroo), the exit's hidden states go through one extra
attention layer and norm before the LM head. The adapter's own small KV cache needs the exit
hidden states of every committed position; they are captured from the target's own forwards
(a forward hook on layer ``exit_layer - 1``), so the adapter needs no prefill of the shallow
layers either. The capture assumes chain verification (contiguous positions).
"""

from __future__ import annotations

import torch

from cascade.drafters.lm_base import LMDrafter
from cascade.drafters.stopping import StopPolicy
from cascade.models.adapter import ExitAdapter
from cascade.models.layers import crop_layers, decoder_parts, head_logits, layer_lengths, run_layers
from cascade.models.lm import CausalLM
from cascade.types import SamplingConfig


class LayerSkipDrafter(LMDrafter):
    """Drafts with the first ``exit_layer`` layers of the target (see the module docstring)."""

    def __init__(
        self,
        exit_layer: int,
        k: int = 4,
        sample: bool = True,
        stop: StopPolicy | None = None,
        stop_below: float | None = None,
        adapter: ExitAdapter | str | None = None,
        name: str | None = None,
    ) -> None:
        """adapter: an ``ExitAdapter``, a checkpoint path (from ``python -m cascade.train_adapter``),
        "init" (untrained, built from the target's layer ``exit_layer``), or None (plain exit)."""
        super().__init__(k=k, sample=sample, stop=stop, stop_below=stop_below)
        if not isinstance(exit_layer, int) or exit_layer < 1:
            raise ValueError(f"exit_layer must be a positive integer, got {exit_layer!r}")
        self.exit_layer = exit_layer
        self._adapter_spec = adapter
        self.adapter: ExitAdapter | None = adapter if isinstance(adapter, ExitAdapter) else None
        kind = "kangaroo" if adapter is not None else "layer_skip"
        self.name = name or f"{kind}(exit={exit_layer})"
        self.model: CausalLM | None = None
        self.cache = None
        self._hook = None
        self._drafting = False
        self.reset(SamplingConfig(), None)

    # ---- binding to the target ----------------------------------------------------------
    def check_compatible(self, target: CausalLM) -> None:
        n = decoder_parts(target).num_layers
        if self.exit_layer >= n:
            raise ValueError(f"exit_layer {self.exit_layer} must be below the target's {n} layers ({target.name!r})")
        if self._adapter_spec == "init":  # untrained, initialised from the target's next layer
            self.adapter = ExitAdapter.from_target(target, self.exit_layer)
        elif isinstance(self._adapter_spec, str):  # a checkpoint path: load it for this target
            self.adapter = ExitAdapter.load(self._adapter_spec, target)
        if self.adapter is not None:
            self.adapter.check_target(target, self.exit_layer)
        self.model = target

    def bind(self, target: CausalLM, cache) -> None:
        if self.model is not target:
            self.check_compatible(target)
        self.cache = cache
        if self.adapter is not None and self._hook is None:
            layer = decoder_parts(target).layers[self.exit_layer - 1]
            self._hook = layer.register_forward_hook(self._capture, with_kwargs=True)

    def close(self) -> None:
        """Remove the capture hook from the target (adapter drafters)."""
        if self._hook is not None:
            self._hook.remove()
            self._hook = None

    def reset(self, sampling: SamplingConfig, generator: torch.Generator | None) -> None:
        super().reset(sampling, generator)
        self._hidden = None  # [T, H] exit hidden states of positions 0..T-1 (adapter only)
        self._adapter_cache = self.adapter.new_cache() if self.adapter is not None else None

    def _capture(self, module, args, kwargs, output) -> None:
        """Forward hook on layer exit_layer - 1: keep the target's exit hidden states."""
        if self._drafting or self.cache is None:
            return
        hidden = (output[0] if isinstance(output, tuple) else output)[0].detach()  # [n, H]
        start = int(kwargs["position_ids"].reshape(-1)[0])
        keep = self._hidden[:start] if self._hidden is not None else hidden[:0]
        if keep.shape[0] != start:
            return  # not a contiguous continuation (another cache): ignore
        self._hidden = torch.cat([keep, hidden])

    def sync(self, context: list[int]) -> int:
        return self._committed()  # the cache is always left at the committed prefix

    # ---- drafting ------------------------------------------------------------------------
    def _committed(self) -> int:
        return layer_lengths(self.cache)[-1] if len(self.cache.layers) else 0

    def _sync_adapter(self, committed: int) -> None:
        done = self.adapter.cache_len(self._adapter_cache)
        if done > committed:
            self.adapter.crop(self._adapter_cache, committed)
        elif done < committed:
            if self._hidden is None or self._hidden.shape[0] < committed:
                raise RuntimeError("the adapter lacks exit hidden states of the committed prefix (was the drafter bound?)")
            self.adapter.extend(self.model, self._hidden[done:committed], torch.arange(done, committed), self._adapter_cache)

    def score(self, context: list[int], extra: list[int] | tuple = ()) -> torch.Tensor:
        if self.cache is None:
            raise RuntimeError(f"{self.name} is not bound to a target cache: use it through cascade.generate")
        self._committed_len = p = self._committed()
        if len(context) <= p:
            raise ValueError(f"context ({len(context)} tokens) must extend the committed prefix ({p} positions)")
        if self.adapter is not None:
            self._sync_adapter(p)
        new = context[p:] + list(extra)
        was = self._drafting
        self._drafting = True
        try:
            hidden = run_layers(self.model, new, self.cache, self.exit_layer)  # [len(new), H]
            keep = len(extra) + 1
            if self.adapter is None:
                logits = head_logits(self.model, hidden[-keep:])
            else:  # the adapter sees every new position: its own cache grows with them
                logits = self.adapter.logits(self.model, hidden, torch.arange(p, p + len(new)), self._adapter_cache)[-keep:]
        finally:
            self._drafting = was
        if not self._in_draft:
            self._end_draft()
        return logits  # [len(extra) + 1, V]

    def _continue(self, token: int) -> torch.Tensor:
        self._drafting = True
        try:
            position = torch.tensor([layer_lengths(self.cache)[0]])
            hidden = run_layers(self.model, [token], self.cache, self.exit_layer)  # [1, H]
            if self.adapter is None:
                return head_logits(self.model, hidden)[-1]
            return self.adapter.logits(self.model, hidden, position, self._adapter_cache)[-1]
        finally:
            self._drafting = False

    def _end_draft(self) -> None:
        crop_layers(self.cache, self.exit_layer, self._committed_len)
        if self.adapter is not None:
            self.adapter.crop(self._adapter_cache, self._committed_len)

    _in_draft = False

    def propose(self, context: list[int], budget: int):
        self._in_draft = True
        try:
            return super().propose(context, budget)
        finally:
            self._in_draft = False
            if self.cache is not None and hasattr(self, "_committed_len"):
                self._end_draft()
