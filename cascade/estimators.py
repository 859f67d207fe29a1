"""Online estimates of acceptance (α̂) for the tree policies, and the two curve fits the cost models use.

Acceptance, per key (a drafter and a depth, or a drafter and a sibling rank), two estimates:

* an exponential moving average of the judged outcomes (fast to adapt, biased early);
* a Beta(a, b) posterior updated only with *judged* nodes. Censoring: a node below a rejected
  node, or a sibling after the accepted one under recursive rejection, is never judged; it is
  not counted as a failure (which would bias α̂ down). The posterior mean is the estimate the
  policy uses; the EMA is logged next to it.

Costs live in ``cascade.costs`` (measured robustly, or a device's roofline); this module keeps
the two fits their curves use: :func:`isotonic` (non-decreasing) and :func:`convex_minorant`
(the lower hull).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from cascade.types import AlphaEstimate


@dataclass
class Acceptance:
    prior: tuple[float, float] = (1.0, 1.0)
    decay: float = 0.9
    a: float = field(init=False)
    b: float = field(init=False)
    ema: float | None = field(default=None, init=False)
    n: int = field(default=0, init=False)

    def __post_init__(self) -> None:
        self.a, self.b = self.prior

    def update(self, accepted: bool) -> None:
        self.a += accepted
        self.b += not accepted
        self.n += 1
        x = float(accepted)
        self.ema = x if self.ema is None else self.decay * self.ema + (1 - self.decay) * x

    @property
    def mean(self) -> float:
        return self.a / (self.a + self.b)


class AcceptanceTable:
    """α̂ per (drafter, key); unseen keys start from the prior (or from ``default`` per drafter)."""

    def __init__(self, prior: tuple[float, float] = (1.0, 1.0), decay: float = 0.9) -> None:
        self.prior, self.decay = prior, decay
        self.table: dict[tuple[str, str], Acceptance] = {}

    def get(self, drafter: str, key: str, prior: tuple[float, float] | None = None) -> Acceptance:
        """The estimate of (drafter, key), created from ``prior`` (default: the table's) when new."""
        k = (drafter, key)
        if k not in self.table:
            self.table[k] = Acceptance(prior or self.prior, self.decay)
        return self.table[k]

    def mean(self, drafter: str, key: str, prior: tuple[float, float] | None = None) -> float:
        e = self.table.get((drafter, key))
        if e is None:
            a, b = prior or self.prior
            return a / (a + b)
        return e.mean

    def counts(self, drafter: str, key: str) -> tuple[float, int]:
        """(accepted, judged) observations of (drafter, key), without the prior."""
        e = self.table.get((drafter, key))
        return (0.0, 0) if e is None else (e.a - e.prior[0], e.n)

    def seen(self, drafter: str, key: str) -> bool:
        e = self.table.get((drafter, key))
        return e is not None and e.n > 0

    def update(self, drafter: str, key: str, accepted: bool, prior: tuple[float, float] | None = None) -> None:
        self.get(drafter, key, prior).update(accepted)

    def snapshot(self) -> dict[str, dict[str, AlphaEstimate]]:
        """drafter -> key -> α̂ of every (drafter, key) observed at least once."""
        out: dict[str, dict[str, AlphaEstimate]] = {}
        for (d, k), e in sorted(self.table.items()):
            if e.n:
                out.setdefault(d, {})[k] = AlphaEstimate(round(e.mean, 4), None if e.ema is None else round(e.ema, 4), e.n)
        return out


def isotonic(values: list[float], weights: list[float]) -> list[float]:
    """The non-decreasing sequence closest to ``values`` in weighted least squares (pool adjacent
    violators)."""
    blocks: list[list[float]] = []  # [weighted sum, weight, how many values]
    for v, w in zip(values, weights):
        blocks.append([v * w, w, 1])
        while len(blocks) > 1 and blocks[-2][0] / blocks[-2][1] > blocks[-1][0] / blocks[-1][1]:
            s, w2, c = blocks.pop()
            blocks[-1][0] += s
            blocks[-1][1] += w2
            blocks[-1][2] += c
    return [s / w for s, w, c in blocks for _ in range(c)]


def convex_minorant(xs: list[float], ys: list[float]) -> list[float]:
    """The greatest convex function below the points (xs increasing), at each x: the lower hull."""
    if not xs:
        return []
    hull: list[int] = []
    for i in range(len(xs)):
        while len(hull) > 1:
            a, b = hull[-2], hull[-1]
            # drop b when it lies on or above the segment from a to i
            if (ys[b] - ys[a]) * (xs[i] - xs[a]) >= (ys[i] - ys[a]) * (xs[b] - xs[a]):
                hull.pop()
            else:
                break
        hull.append(i)
    out = []
    for a, b in zip(hull, hull[1:]):
        out += [ys[a] + (ys[b] - ys[a]) * (xs[j] - xs[a]) / (xs[b] - xs[a]) for j in range(a, b)]
    return out + [ys[hull[-1]]]
