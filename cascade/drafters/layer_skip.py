"""Self-drafting with an early exit of the target: the layer-skip drafter (and Kangaroo's adapter).

``LayerSkipDrafter(exit_layer)`` drafts with the target's first ``exit_layer`` decoder layers,
then its final norm and LM head: the target's own weights (no copy) and the target's own KV
cache for the committed prefix, so drafting needs no prefill. Cache discipline (see
``Drafter.bind``): at a draft's start the cache holds the committed prefix (P positions) in every
layer; drafting appends positions to layers ``< exit_layer`` only, and they are cropped back to
P before ``propose``/``score`` returns, so the target's verification finds its cache as it left
it. P is read from the last layer, which drafting never touches (hence ``exit_layer`` must be
below the number of layers).

What turns the exit's hidden states into logits is a strategy object: ``PlainExit`` (the
target's final norm and LM head) or, with ``adapter`` (an ``ExitAdapter``, Kangaroo),
``AdapterExit``: one extra attention layer and norm before the LM head. The adapter's own small KV cache needs the exit
hidden states of every committed position; the drafter asks the decode loop for them
(``hidden_layer``), which reads them from the target's own forwards (``CausalLM.forward(...,
return_hidden=exit_layer)``): the prompt's at prefill, the committed path's after each
verification, in tree order for a tree. So the adapter needs no prefill of the shallow layers,
and works inside token trees. It cannot be a lower level of a vertical cascade: the level above
it is not the target, so nobody hands it the target's exit states (refused with an error).
"""

from __future__ import annotations

import torch

from cascade.drafters.base import DraftStart, Outcome, SharesCache
from cascade.drafters.lm_base import LMDrafter
from cascade.drafters.stopping import StopPolicy
from cascade.models.heads.adapter import ExitAdapter
from cascade.models.layers import crop_layers, decoder_parts, head_logits, layer_lengths, run_layers
from cascade.models.lm import CausalLM


class PlainExit:
    """The target's final norm and LM head on the exit's hidden states (plain layer skip)."""

    kind = "layer_skip"
    hidden_layer = None  # reads nothing from the target's forwards
    adapter = None

    def bind(self, target: CausalLM, exit_layer: int) -> None:
        pass

    def reset(self) -> None:
        pass

    def prefill(self, hidden: torch.Tensor | None) -> None:
        pass

    def keep(self, hidden: torch.Tensor | None) -> None:
        pass

    def sync(self, model: CausalLM, committed: int, name: str) -> None:
        pass

    def logits(self, model: CausalLM, hidden: torch.Tensor, positions: torch.Tensor, last: int | None = None,
               mask: torch.Tensor | None = None) -> torch.Tensor:
        """[n or last, V] logits of the exit's hidden states [n, H] (only the ``last`` rows' when given)."""
        return head_logits(model, hidden if last is None else hidden[-last:])

    def crop(self, committed: int) -> None:
        pass


class AdapterExit:
    """Kangaroo: an ``ExitAdapter`` (its own KV cache over the exit hidden states of every
    committed position, handed over by the decode loop) between the exit and the LM head."""

    kind = "kangaroo"

    def __init__(self, spec: ExitAdapter | str, exit_layer: int) -> None:
        """spec: an ``ExitAdapter``, a checkpoint path (``python -m cascade.train_adapter``) or
        "init" (untrained, built from the target's layer ``exit_layer`` when bound)."""
        self.spec = spec
        self.hidden_layer = exit_layer  # the target's states after exit_layer layers
        self.adapter: ExitAdapter | None = spec if isinstance(spec, ExitAdapter) else None
        self.reset()

    def bind(self, target: CausalLM, exit_layer: int) -> None:
        if self.spec == "init":
            self.adapter = ExitAdapter.from_target(target, exit_layer)
        elif isinstance(self.spec, str):
            self.adapter = ExitAdapter.load(self.spec, target)
        self.adapter.for_exit(target, exit_layer)
        self.reset()

    def reset(self) -> None:
        self._hidden: torch.Tensor | None = None  # [T, H] exit hidden states of the committed positions 0..T-1
        self._cache = self.adapter.new_cache() if self.adapter is not None else None

    def prefill(self, hidden: torch.Tensor | None) -> None:
        """The prompt's exit hidden states ([len(prompt) - 1, H])."""
        self._hidden = hidden

    def keep(self, hidden: torch.Tensor | None) -> None:
        """Append the exit hidden states of positions just committed ([m, H])."""
        if hidden is not None:
            self._hidden = hidden if self._hidden is None else torch.cat([self._hidden, hidden])

    def sync(self, model: CausalLM, committed: int, name: str) -> None:
        """Bring the adapter's cache to the ``committed`` positions (target states only)."""
        done = self.adapter.cache_len(self._cache)
        if done > committed:
            self.adapter.crop(self._cache, committed)
        elif done < committed:
            have = 0 if self._hidden is None else self._hidden.shape[0]
            if have < committed:
                raise RuntimeError(
                    f"{name} has the target's exit hidden states of {have} of {committed} committed positions: "
                    "a Kangaroo adapter must draft directly for the target (alone, in a tree or a horizontal "
                    "schedule), not as the lower level of a vertical cascade"
                )
            self.adapter.extend(model, self._hidden[done:committed], torch.arange(done, committed), self._cache)

    def logits(self, model: CausalLM, hidden: torch.Tensor, positions: torch.Tensor, last: int | None = None,
               mask: torch.Tensor | None = None) -> torch.Tensor:
        """The adapter sees every row (its cache grows with them); logits of the ``last`` rows."""
        out = self.adapter.logits(model, hidden, positions, self._cache, attention_mask=mask)
        return out if last is None else out[-last:]

    def crop(self, committed: int) -> None:
        if self.adapter.cache_len(self._cache) > committed:
            self.adapter.crop(self._cache, committed)


class LayerSkipDrafter(LMDrafter, SharesCache):
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
        self.exit: PlainExit | AdapterExit = PlainExit() if adapter is None else AdapterExit(adapter, exit_layer)
        self.kind = self.exit.kind
        self.name = name or f"{self.kind}(exit={exit_layer})"
        self.model: CausalLM | None = None
        self.cache = None
        self._committed_len: int | None = None  # cache length when the current draft started

    @property
    def adapter(self) -> ExitAdapter | None:
        return self.exit.adapter

    @property
    def hidden_layer(self) -> int | None:
        """An adapter reads the target's hidden states after ``exit_layer`` layers."""
        return self.exit.hidden_layer

    # ---- binding to the target ----------------------------------------------------------
    def check_compatible(self, target: CausalLM) -> None:
        n = decoder_parts(target).num_layers
        if self.exit_layer >= n:
            raise ValueError(f"exit_layer {self.exit_layer} must be below the target's {n} layers ({target.name!r})")
        self.exit.bind(target, self.exit_layer)
        self.model = target

    def draft_cache(self):
        return None if self.cache is None else (self.model, self.cache)

    def start(self, run: DraftStart) -> None:
        """Drafts on ``run.target``'s cache (the target's, or a cascade's upper level's)."""
        if self.model is not run.target:
            self.check_compatible(run.target)
        self.cache = run.cache
        self.exit.reset()
        self._committed_len = None
        super().start(run)

    def _prefill(self, run: DraftStart) -> None:
        """Nothing to compute: the target's prefill filled the shared cache. An adapter keeps the
        prompt's exit hidden states (``run.hidden``: [len(prompt) - 1, H])."""
        self.exit.prefill(run.hidden)

    def observe(self, outcome: Outcome) -> None:
        super().observe(outcome)
        self.exit.keep(outcome.hidden)  # [m, H] the positions just committed (adapter only)

    def sync(self, context: list[int]) -> int:
        return self._committed()  # the cache is always left at the committed prefix

    # ---- drafting ------------------------------------------------------------------------
    def _committed(self) -> int:
        return layer_lengths(self.cache)[-1] if len(self.cache.layers) else 0

    def _run(self, context: list[int], extra: list[int] | tuple) -> torch.Tensor:
        """Logits after ``context`` and each token of ``extra`` [len(extra) + 1, V]; leaves the
        new positions in the first ``exit_layer`` layers (and the adapter's cache) until
        ``_end_draft``."""
        if self.cache is None:
            raise RuntimeError(f"{self.name} is not bound to a target cache: use it through cascade.generate")
        self._committed_len = p = self._committed()
        if len(context) <= p:
            raise ValueError(f"context ({len(context)} tokens) must extend the committed prefix ({p} positions)")
        self.exit.sync(self.model, p, self.name)
        new = context[p:] + list(extra)
        hidden = run_layers(self.model, new, self.cache, self.exit_layer)  # [len(new), H]
        return self.exit.logits(self.model, hidden, torch.arange(p, p + len(new)), last=len(extra) + 1)

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
        return self.exit.logits(self.model, hidden, position)[-1]

    def _forward_nodes(self, tokens: list[int], positions: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        hidden = run_layers(self.model, tokens, self.cache, self.exit_layer, position_ids=positions, attention_mask=mask)  # [w, H]
        return self.exit.logits(self.model, hidden, positions, mask=mask)

    def _end_draft(self) -> None:
        """Remove the draft-time positions (idempotent)."""
        if self._committed_len is None:
            return
        crop_layers(self.cache, self.exit_layer, self._committed_len)
        self.exit.crop(self._committed_len)
        self._committed_len = None

    def propose(self, context: list[int], budget: int):
        try:
            return super().propose(context, budget)
        finally:
            self._end_draft()  # also when drafting raised: the target finds its cache as it left it
