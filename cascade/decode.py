"""`generate()`: the speculative decoding loop (and, with no drafter, the autoregressive baseline).

Cache invariant: before each step the target's KV cache holds every token of the sequence but
the last one. A step feeds ``[last] + draft`` (n+1 tokens) in one forward and gets the target's
distributions at ``last`` and at every drafted node (a token tree gets tree positions and a
tree-attention mask; a chain is the tree ``[-1, 0, 1, ...]`` and needs neither). The verifier
(``cascade.verify``) judges the draft, the cache keeps the accepted path (``Verifier.commit``), and
the recovered/bonus token becomes the new ``last``. The autoregressive baseline is the same loop
with an empty draft, so both share every line of code but the drafter calls.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from tqdm.auto import tqdm

from cascade.costs import ForwardShape, VirtualClock, running_on
from cascade.drafters.base import Drafter, DraftStart, Outcome, check_target
from cascade.metrics import summarize
from cascade.models.lm import CausalLM, observe_forwards
from cascade.sampling import make_generator
from cascade.summary import RunStats
from cascade.types import DraftBlock, ForwardCall, SamplingConfig, Scored, StepRecord
from cascade.verify import EXACT, Verifier, verifier_named


@dataclass
class Generation:
    """Result of one ``generate`` call."""

    tokens: list[int]  # new token ids (EOS included when generation stopped on it)
    prompt_len: int
    steps: list[StepRecord]
    wall_time_s: float  # prefills + all steps
    prefill_time_s: float  # the target's prefill of the prompt
    stop_reason: str  # "eos" | "max_new_tokens"
    sampling: SamplingConfig = field(default_factory=SamplingConfig)
    drafter_prefill_time_s: float = 0.0  # the drafter's catch-up on the prompt (Drafter.start)
    clock: str = "measured"  # "measured" (wall clock) or "predicted:<device>": every time above is a prediction
    forward_shapes: dict[str, ForwardShape] = field(default_factory=dict)  # each model that ran, as a roofline sees it

    def summary(self) -> RunStats:
        return summarize([self])


def _now(device: torch.device) -> float:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter()


def _prompt_ids(input_ids) -> list[int]:
    if isinstance(input_ids, torch.Tensor):
        if input_ids.dim() == 2:
            if input_ids.shape[0] != 1:
                raise ValueError(
                    f"batch size {input_ids.shape[0]} is not supported: cascade.generate decodes one "
                    "sequence at a time (batch size 1); loop over prompts instead"
                )
            input_ids = input_ids[0]
        if input_ids.dim() != 1:
            raise ValueError(f"input_ids must be [n] or [1, n], got shape {tuple(input_ids.shape)}")
        ids = [int(t) for t in input_ids.tolist()]
    else:
        ids = list(input_ids)
        if ids and isinstance(ids[0], (list, tuple)):
            raise ValueError("batch size > 1 is not supported: pass one prompt (a flat list of token ids)")
        ids = [int(t) for t in ids]
    if not ids:
        raise ValueError("empty prompt: input_ids must hold at least one token")
    return ids


def _validate(target: CausalLM, prompt: list[int], max_new_tokens: int) -> None:
    if not isinstance(max_new_tokens, int) or max_new_tokens <= 0:
        raise ValueError(f"max_new_tokens must be a positive integer, got {max_new_tokens!r}")
    if len(prompt) + max_new_tokens > target.max_context:
        raise ValueError(
            f"prompt ({len(prompt)} tokens) + max_new_tokens ({max_new_tokens}) exceeds the context "
            f"of {target.name!r} ({target.max_context} positions)"
        )
    bad = [t for t in prompt if not 0 <= t < target.vocab_size]
    if bad:
        raise ValueError(f"prompt holds token ids outside the vocabulary [0, {target.vocab_size}): {bad[:5]}")


def _cut(tokens: list[int], eos: set[int], limit: int) -> tuple[list[int], bool]:
    """Emitted tokens up to and including the first EOS, at most ``limit``; and whether EOS was hit."""
    for i, t in enumerate(tokens[:limit]):
        if t in eos:
            return tokens[: i + 1], True
    return tokens[:limit], False


def generate(
    target: CausalLM,
    input_ids,
    drafter: Drafter | None = None,
    max_new_tokens: int = 64,
    sampling: SamplingConfig = SamplingConfig(),
    seed: int | None = None,
    generator: torch.Generator | None = None,
    eos_token_id: int | list[int] | None = None,
    stop_on_eos: bool = True,
    progress: bool = False,
    verifier: Verifier | str = EXACT,
    clock: VirtualClock | None = None,
) -> Generation:
    """Generate up to ``max_new_tokens`` tokens after ``input_ids`` (batch size 1).

    With ``drafter=None`` this is plain autoregressive decoding. Output is distributed exactly as
    the target's (greedy: identical tokens). ``eos_token_id`` defaults to the target's EOS ids;
    ``generator`` (or ``seed``) is the only source of randomness. ``verifier`` holds the
    acceptance rules (``cascade.verify``: token-wise by default; ``"block"`` / ``"traversal"`` name block and
    traversal verification, equally exact). ``sampling``: the
    temperature / top-k / top-p as one ``SamplingConfig`` (greedy by default; what ``cascade.run``
    instantiates from the ``sampling`` config group).
    ``clock``: a :class:`~cascade.costs.VirtualClock` makes every recorded time a prediction for
    its device (each model forward priced by the roofline, plus the device's host work per step);
    the tokens are the same as without it.
    """
    if not isinstance(sampling, SamplingConfig):
        raise TypeError(f"sampling must be a SamplingConfig (temperature, top_k, top_p), got {type(sampling).__name__}")
    prompt = _prompt_ids(input_ids)
    _validate(target, prompt, max_new_tokens)
    verifier = verifier_named(verifier)
    if eos_token_id is None:
        eos = target.eos_token_ids if stop_on_eos else set()
    else:
        eos = {eos_token_id} if isinstance(eos_token_id, int) else set(eos_token_id)
    gen = generator if generator is not None else make_generator(seed, target.device)
    if drafter is not None:
        check_target(drafter, target)
        if drafter.drafts_trees and not verifier.trees:
            raise ValueError(f"{drafter.name} drafts token trees, which this verification rule cannot judge "
                             "(block verification judges chains): use traversal verification (verify=traversal)")
    device = target.device
    recorder = _ForwardRecorder()
    with observe_forwards(recorder):
        if clock is None:
            return _decode(target, prompt, drafter, max_new_tokens, sampling, gen, eos, verifier, progress,
                           lambda: _now(device), None, recorder)
        with observe_forwards(clock.forward), running_on(clock):  # each forward advances the clock by its roofline
            return _decode(target, prompt, drafter, max_new_tokens, sampling, gen, eos, verifier, progress,
                           clock.now, clock, recorder)


class _ForwardRecorder:
    """The model forwards of the step in progress (``StepRecord.forwards``) and each model's shape."""

    def __init__(self) -> None:
        self.calls: list[ForwardCall] = []
        self.shapes: dict[str, ForwardShape] = {}

    def __call__(self, owner, name: str, shape, inputs: int, context: int) -> None:
        if name not in self.shapes:
            self.shapes[name] = shape()
        self.calls.append(ForwardCall(name, inputs, context))

    def take(self) -> list[ForwardCall]:
        calls, self.calls = self.calls, []
        return calls


@dataclass
class _Loop:
    """What one generation's steps share (fixed for the generation) and its KV cache."""

    target: CausalLM
    drafter: Drafter | None
    verifier: Verifier
    sampling: SamplingConfig
    gen: torch.Generator
    eos: set[int]
    now: Callable[[], float]  # the wall clock, or a virtual clock's predictions
    clock: VirtualClock | None
    recorder: _ForwardRecorder
    cache: object = None

    @property
    def hidden_layer(self):
        return self.drafter.hidden_layer if self.drafter is not None else None


def _decode(target: CausalLM, prompt: list[int], drafter: Drafter | None, max_new_tokens: int,
            sampling: SamplingConfig, gen: torch.Generator, eos: set[int], verifier: Verifier, progress: bool,
            now, clock: VirtualClock | None, recorder: _ForwardRecorder) -> Generation:
    """The loop itself, timed by ``now`` (the wall clock, or ``clock``'s predictions): 0. prefill,
    then steps (1 propose, 2 verify, 3 accept, 4 commit, 5 observe) until ``max_new_tokens`` or EOS.
    Autoregressive decoding is the same loop with no drafter (every block empty)."""
    loop = _Loop(target, drafter, verifier, sampling, gen, eos, now, clock, recorder)
    t_start = now()
    t_prefilled, t_ready = _prefill(loop, prompt)
    seq, new, steps = list(prompt), [], []
    stop_reason = "max_new_tokens"
    bar = tqdm(total=max_new_tokens, desc="generate", unit="tok", disable=not progress, leave=False)
    while len(new) < max_new_tokens:
        record, hit_eos = _step(loop, seq, max_new_tokens - len(new), len(steps))  # appends to seq
        new += record.emitted_tokens
        steps.append(record)
        bar.update(record.emitted)
        if hit_eos:
            stop_reason = "eos"
            break
    bar.close()
    return Generation(new, len(prompt), steps, now() - t_start, t_prefilled - t_start, stop_reason, sampling,
                      drafter_prefill_time_s=t_ready - t_prefilled, clock="measured" if clock is None else clock.label,
                      forward_shapes=recorder.shapes)


def _prefill(loop: _Loop, prompt: list[int]) -> tuple[float, float]:
    """0. prefill: the target's cache gets all but the last prompt token; then the drafter catches
    up on the prompt (its own cache, or the target's hidden states it asked for). Returns the
    times the target's and the drafter's prefills ended."""
    loop.cache = loop.target.new_cache()
    hidden = None
    if len(prompt) > 1:
        out = loop.target.forward(prompt[:-1], loop.cache, keep_last=1, return_hidden=loop.hidden_layer)
        hidden = out[1] if loop.hidden_layer is not None else None
    t_prefilled = loop.now()
    if loop.drafter is not None:
        loop.drafter.start(DraftStart(loop.target, loop.cache, list(prompt), loop.sampling, loop.gen, hidden))
    t_ready = loop.now()
    loop.recorder.take()  # the prefills' forwards are not a step's
    return t_prefilled, t_ready


def _step(loop: _Loop, seq: list[int], room: int, index: int) -> tuple[StepRecord, bool]:
    """One target forward's step after ``seq`` with ``room`` tokens left to emit: appends what it
    emits to ``seq`` (the list the drafter is shown) and returns its record and whether it emitted EOS."""
    target, drafter, verifier, now = loop.target, loop.drafter, loop.verifier, loop.now
    t0 = now()
    # 1. propose: never deeper than can still be emitted (one slot is kept for the bonus token)
    budget = room - 1
    block = drafter.propose(seq, budget) if drafter is not None and budget > 0 else DraftBlock.empty()
    if block.depth > budget:
        raise RuntimeError(f"drafter {block.drafter!r} proposed {block.depth} tokens deep with a budget of {budget}")
    draft = block.tokens.tolist()
    t1 = now()
    # 2. verify: one target forward over [last] + draft -> logits [n+1, V] (a tree with its
    #    positions and tree-attention mask)
    past, root = len(seq) - 1, seq[-1]
    out = verifier.forward(target, loop.cache, root, block, return_hidden=loop.hidden_layer)
    logits, hidden = out if loop.hidden_layer is not None else (out, None)
    t2 = now()
    # 3. accept
    result = verifier.accept(block, logits, loop.sampling, loop.gen)
    t_accepted = now()
    # 4. commit: the cache keeps the sequence plus the accepted path (compacted in place)
    keep = verifier.commit(target, loop.cache, past, result)
    accepted = [draft[i] for i in result.path]
    emitted, hit_eos = _cut(accepted + [result.next_token], loop.eos, room)
    seq += emitted
    # 5. observe: the drafter learns what was accepted, the forward's time, its inputs and
    #    logits, and (if it asked) the target's hidden states at the committed positions
    if drafter is not None:
        drafter.observe(Outcome(seq, result, verify_time_s=t2 - t1, hidden=None if hidden is None else hidden[keep],
                                scored=Scored([root] + draft, logits)))
    if loop.clock is not None:
        loop.clock.host(loop.clock.device.host_step_s)
    t3 = now()
    record = StepRecord(
        step=index, drafter=block.drafter, drafted=block.k, accepted=result.num_accepted,
        emitted=len(emitted), draft_tokens=draft, emitted_tokens=emitted,
        target_argmax=logits.argmax(-1).tolist(), draft_time_s=t1 - t0, target_time_s=t2 - t1,
        step_time_s=t3 - t0, parents=list(block.parents), accepted_path=list(result.path), stop=block.stop,
        cascade=block.cascade, segments=block.segments, tree=block.tree, accept_time_s=t_accepted - t2,
        forwards=loop.recorder.take(),
    )
    return record, hit_eos
