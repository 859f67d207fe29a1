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
hidden states of every committed position; the drafter asks the decode loop for them
(``hidden_layer``), which reads them from the target's own forwards (``CausalLM.forward(...,
return_hidden=exit_layer)``): the prompt's at prefill, the committed path's after each
verification, in tree order for a tree. So the adapter needs no prefill of the shallow layers,
and works inside token trees. It cannot be a lower level of a vertical cascade: the level above
it is not the target, so nobody hands it the target's exit states (refused with an error).
"""

from __future__ import annotations

import torch

from cascade.drafters.lm_base import LMDrafter
from cascade.drafters.stopping import StopPolicy
from cascade.models.adapter import ExitAdapter
from cascade.models.layers import crop_layers, decoder_parts, head_logits, layer_lengths, run_layers
from cascade.models.lm import CausalLM
from cascade.types import SamplingConfig, Scored


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
        self.kind = "kangaroo" if adapter is not None else "layer_skip"
        self.name = name or f"{self.kind}(exit={exit_layer})"
        self.model: CausalLM | None = None
        self.cache = None
        self.reset(SamplingConfig(), None)

    @property
    def hidden_layer(self) -> int | None:
        """The adapter reads the target's hidden states after ``exit_layer`` layers."""
        return self.exit_layer if self._adapter_spec is not None else None

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

    def reset(self, sampling: SamplingConfig, generator: torch.Generator | None) -> None:
        super().reset(sampling, generator)
        self._hidden = None  # [T, H] exit hidden states of the committed positions 0..T-1 (adapter only)
        self._adapter_cache = self.adapter.new_cache() if self.adapter is not None else None
        self._committed_len: int | None = None  # cache length when the current draft started

    def prefill(self, prompt: list[int], hidden: torch.Tensor | None = None) -> None:
        """Nothing to compute: the target's prefill filled the shared cache. An adapter keeps the
        prompt's exit hidden states (``hidden``: [len(prompt) - 1, H])."""
        if self.adapter is not None:
            self._hidden = hidden

    def observe(self, context: list[int], result, verify_time_s: float | None = None,
                hidden: torch.Tensor | None = None, scored: Scored | None = None) -> None:
        super().observe(context, result, verify_time_s, hidden, scored)
        if self.adapter is not None and hidden is not None:  # [m, H] the positions just committed
            self._hidden = hidden if self._hidden is None else torch.cat([self._hidden, hidden])

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
            have = 0 if self._hidden is None else self._hidden.shape[0]
            if have < committed:
                raise RuntimeError(
                    f"{self.name} has the target's exit hidden states of {have} of {committed} committed positions: "
                    "a Kangaroo adapter must draft directly for the target (alone, in a tree or a horizontal "
                    "schedule), not as the lower level of a vertical cascade"
                )
            self.adapter.extend(self.model, self._hidden[done:committed], torch.arange(done, committed), self._adapter_cache)

    def _run(self, context: list[int], extra: list[int] | tuple) -> torch.Tensor:
        """Logits after ``context`` and each token of ``extra`` [len(extra) + 1, V]; leaves the
        new positions in the first ``exit_layer`` layers (and the adapter's cache) until
        ``_end_draft``."""
        if self.cache is None:
            raise RuntimeError(f"{self.name} is not bound to a target cache: use it through cascade.generate")
        self._committed_len = p = self._committed()
        if len(context) <= p:
            raise ValueError(f"context ({len(context)} tokens) must extend the committed prefix ({p} positions)")
        if self.adapter is not None:
            self._sync_adapter(p)
        new = context[p:] + list(extra)
        hidden = run_layers(self.model, new, self.cache, self.exit_layer)  # [len(new), H]
        keep = len(extra) + 1
        if self.adapter is None:
            return head_logits(self.model, hidden[-keep:])
        # the adapter sees every new position: its own cache grows with them
        return self.adapter.logits(self.model, hidden, torch.arange(p, p + len(new)), self._adapter_cache)[-keep:]

    def score(self, context: list[int], extra: list[int] | tuple = ()) -> torch.Tensor:
        try:
            return self._run(context, extra)  # [len(extra) + 1, V]
        finally:
            self._end_draft()

    def _start_draft(self, context: list[int]) -> torch.Tensor:
        return self._run(context, ())[-1]

    def _continue(self, token: int) -> torch.Tensor:
        position = torch.tensor([layer_lengths(self.cache)[0]])
        hidden = run_layers(self.model, [token], self.cache, self.exit_layer)  # [1, H]
        if self.adapter is None:
            return head_logits(self.model, hidden)[-1]
        return self.adapter.logits(self.model, hidden, position, self._adapter_cache)[-1]

    def _forward_nodes(self, tokens: list[int], positions: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        hidden = run_layers(self.model, tokens, self.cache, self.exit_layer, position_ids=positions, attention_mask=mask)  # [w, H]
        if self.adapter is None:
            return head_logits(self.model, hidden)
        return self.adapter.logits(self.model, hidden, positions, self._adapter_cache, attention_mask=mask)

    def _end_draft(self) -> None:
        """Remove the draft-time positions (idempotent)."""
        if self._committed_len is None:
            return
        crop_layers(self.cache, self.exit_layer, self._committed_len)
        if self.adapter is not None and self.adapter.cache_len(self._adapter_cache) > self._committed_len:
            self.adapter.crop(self._adapter_cache, self._committed_len)
        self._committed_len = None

    def propose(self, context: list[int], budget: int):
        try:
            return super().propose(context, budget)
        finally:
            self._end_draft()  # also when drafting raised: the target finds its cache as it left it
