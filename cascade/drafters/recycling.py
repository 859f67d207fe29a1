"""Token Recycling (Luo et al., 2024): drafts read out of a table of the verifier's own top tokens.

The table ``[V, r]`` holds, per token id, the ``r`` tokens the verifying model ranked highest
the last time that token was one of its inputs. Every verification forward computes logits after
every input anyway (the last committed token and each draft node); ``observe`` gets them as a
``Scored`` record and overwrites the rows of those inputs with their top-``r``: no forward of
its own. The table is kept across generations (``reset`` does not clear it), and can be saved
and loaded.

A proposal is a chain (``tree=None``: ``k`` rank-1 steps from the last committed token) or a
static tree (``tree=(w_1, w_2, ...)``: every node at depth d - 1 gets the first ``w_d`` entries
of its token's row). The table also keeps the verifier's probability of each entry (raw
softmax, when it was recorded); with ``min_prob`` > 0 a path stops where the product of those
probabilities along it falls below ``min_prob`` (on CPUs, where every verified token costs,
drafting only where the verifier was confident pays; the recorded probability is from another
context, so this is a heuristic, and it cannot affect which tokens are emitted). Drafts are deterministic (``q=None``: one-hot for the verifier), so the
drafter is lossless under sampling too, whatever the table holds. Unknown rows (tokens never
seen as an input) end a path; with an empty table the proposal is empty (a plain step, which
fills the row of the last token).

As a lower level of a vertical cascade its verifier is the level above (the small LM): the
table then learns that model's ranking, which is what accepts its drafts.
"""

from __future__ import annotations

from pathlib import Path

import torch

from cascade.drafters.base import ChecksTarget, Drafter, Outcome
from cascade.models.lm import CausalLM
from cascade.types import DraftBlock

UNKNOWN = -1


class TokenRecyclingDrafter(Drafter, ChecksTarget):
    kind = "token_recycling"

    def __init__(self, r: int = 8, k: int = 4, tree: tuple[int, ...] | list[int] | None = None,
                 min_prob: float = 0.0, table: str | None = None, vocab_size: int | None = None,
                 name: str = "recycling") -> None:
        """r: tokens kept per row. k: chain length (``tree=None``). tree: children per node at
        each depth (each <= r); the tree's depth is ``len(tree)``. table: a file written by
        ``save`` to start from (the vocabulary must match). min_prob: stop a path whose recorded
        probability falls below it (0: never). vocab_size: allocate the table now (otherwise at
        ``check_compatible``, from the target)."""
        if not 0.0 <= min_prob < 1.0:
            raise ValueError(f"min_prob must lie in [0, 1), got {min_prob}")
        if r < 1:
            raise ValueError(f"r (tokens per table row) must be >= 1, got {r}")
        if tree is None and k < 1:
            raise ValueError(f"k (chain length) must be >= 1, got {k}")
        if tree is not None:
            tree = tuple(int(w) for w in tree)
            if not tree or any(not 1 <= w <= r for w in tree):
                raise ValueError(f"tree widths must lie in 1..r={r}, got {tree}")
        self.r, self.tree, self.name, self.min_prob = r, tree, name, min_prob
        self.k = len(tree) if tree is not None else k
        self.table: torch.Tensor | None = None  # [V, r] int64, UNKNOWN where unseen
        self.probs: torch.Tensor | None = None  # [V, r] float32, the verifier's probability of each entry
        if vocab_size is not None:
            self._allocate(vocab_size)
        if table is not None:
            self.load(table)

    # ---- table -------------------------------------------------------------------------------
    def _allocate(self, vocab_size: int) -> None:
        self.table = torch.full((vocab_size, self.r), UNKNOWN, dtype=torch.long)
        self.probs = torch.zeros((vocab_size, self.r), dtype=torch.float32)

    @property
    def drafts_trees(self) -> bool:
        return self.tree is not None

    def check_compatible(self, target: CausalLM) -> None:
        if self.table is None:
            self._allocate(target.vocab_size)
        elif self.table.shape[0] != target.vocab_size:
            raise ValueError(f"{self.name}: table has {self.table.shape[0]} rows, target vocabulary is {target.vocab_size}")

    @property
    def filled(self) -> int:
        """Rows learned so far."""
        return 0 if self.table is None else int((self.table[:, 0] != UNKNOWN).sum())

    def save(self, path: str | Path) -> None:
        """Write the table (atomically: a temporary file renamed)."""
        if self.table is None:
            raise ValueError(f"{self.name}: nothing to save, the table is not allocated yet")
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(path.name + ".tmp")
        torch.save({"r": self.r, "table": self.table, "probs": self.probs}, tmp)
        tmp.replace(path)

    def load(self, path: str | Path) -> None:
        path = Path(path)
        if not path.is_file():
            raise FileNotFoundError(f"{self.name}: no table at {path}")
        saved = torch.load(path, weights_only=True)
        table = saved["table"]
        if table.dim() != 2 or saved["r"] != table.shape[1]:
            raise ValueError(f"{path}: not a token-recycling table")
        if saved["r"] < self.r:
            raise ValueError(f"{path}: holds r={saved['r']} tokens per row, this drafter needs r={self.r}")
        if self.table is not None and self.table.shape[0] != table.shape[0]:
            raise ValueError(f"{path}: {table.shape[0]} rows, expected {self.table.shape[0]}")
        self.table = table[:, : self.r].clone()
        self.probs = saved["probs"][:, : self.r].clone().float()

    def observe(self, outcome: Outcome) -> None:
        """Overwrite the rows of the verified inputs with the verifier's top-r after each."""
        scored = outcome.scored
        if scored is None or self.table is None:
            return
        logits = scored.logits.detach().float()  # [n+1, V]
        top = torch.topk(logits, min(self.r, logits.shape[-1]), dim=-1)  # [n+1, r']
        probs = torch.exp(top.values - torch.logsumexp(logits, -1, keepdim=True))  # softmax of the top entries only
        rows = torch.tensor(scored.inputs, dtype=torch.long)
        r = top.indices.shape[-1]
        self.table[rows, :r] = top.indices.to("cpu", torch.long)  # a repeated input: the last row wins
        self.probs[rows, :r] = probs.to("cpu")

    # ---- drafting ------------------------------------------------------------------------------
    def propose(self, context: list[int], budget: int) -> DraftBlock:
        if self.table is None:
            raise RuntimeError(f"{self.name}: call check_compatible (cascade.generate does) before proposing")
        widths = self.tree if self.tree is not None else (1,) * self.k
        tokens: list[int] = []
        parents: list[int] = []
        frontier = [(-1, context[-1], 1.0)]  # (node index, its token, recorded path probability); -1 = the root
        for width in widths[: min(budget, len(widths))]:
            nxt = []
            for node, token, reach in frontier:
                for child, prob in zip(self.table[token, :width].tolist(), self.probs[token, :width].tolist()):
                    if child == UNKNOWN or reach * prob < self.min_prob:
                        break  # entries are in decreasing probability: the rest are lower
                    tokens.append(child)
                    parents.append(node)
                    nxt.append((len(tokens) - 1, child, reach * prob))
            frontier = nxt
            if not frontier:
                break
        return DraftBlock(torch.tensor(tokens, dtype=torch.long), None, self.name, parents=parents)

    @property
    def budget(self) -> int:
        """Most nodes per proposal."""
        if self.tree is None:
            return self.k
        total, level = 0, 1
        for w in self.tree:
            level *= w
            total += level
        return total
