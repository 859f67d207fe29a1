"""Online estimates of acceptance (α̂) and cost (ĉ) for the dynamic tree policy.

Acceptance, per key (a drafter and a depth, or a drafter and a sibling rank), two estimates:

* an exponential moving average of the judged outcomes (fast to adapt, biased early);
* a Beta(a, b) posterior updated only with *judged* nodes. Censoring: a node below a rejected
  node, or a sibling after the accepted one under recursive rejection, is never judged; it is
  not counted as a failure (which would bias α̂ down). The posterior mean is the estimate the
  policy uses; the EMA is logged next to it.

Cost, in seconds, measured around the calls:

* each drafter's time per expansion call (EMA);
* a forward's time as a function of its input count n (:class:`CostCurve`: an EMA per measured
  n, piecewise linear between them), for the target's verification (optionally seeded by a
  calibration pass that times forwards of a few sizes before decoding) and for each LM drafter.
"""

from __future__ import annotations

from collections import deque
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


class CostCurve:
    """t(n): a forward's seconds as a function of its input count n, from measurements per n.

    Not a line: on CPUs a forward is bandwidth-bound up to a few inputs (each extra input costs a
    small fraction of a step) and compute-bound beyond (each costs much more), so one least-
    squares line over 1..32 inputs overprices the first nodes of a tree and underprices the step
    itself. Each measured n keeps an EMA of its seconds; the curve through them is

    1. made non-decreasing by isotonic regression (pool adjacent violators, each size weighted by
       how often it was measured, at most 10): a single slow reading at one size is averaged
       with its neighbours instead of raising every larger size to it;
    2. replaced by its greatest convex minorant (the lower hull), and interpolated linearly:
       measured forwards can step up (e.g. 2 -> 3 inputs costs half a step, 3 -> 8 nearly
       nothing); priced by the raw local slope, the node at the step looks too dear to a policy
       that adds nodes one at a time while each pays, which then never reaches the cheap nodes
       behind it. The hull spreads the step over the nodes up to where it is paid off: each node's
       price is its share of the cheapest extension, and marginal prices rise with n, as a
       greedy marginal rule needs.

    Only sizes measured within the last ``window`` updates enter the curve. A host's speed drifts,
    and a size that is no longer measured (a calibration point the policy never visits again, such
    as a one-input verification under a tree policy that always drafts) would keep its old value
    forever; the hull then hangs on it. In ``results/kernels/dytc/gsm8k`` a calibration at one input,
    20 ms below every live verification, priced each node of DyTC's trees at 0.075 of a step
    where the live verifications of 2-9 inputs cost about 0.01 more per node.

    Flat below the smallest n in the curve (a single size: proportional growth), extended with the
    last segment's slope beyond the largest."""

    def __init__(self, decay: float = 0.8, window: int = 32) -> None:
        if window < 1:
            raise ValueError(f"window must be >= 1, got {window}")
        self.decay, self.window = decay, window
        self.seconds: dict[int, float] = {}  # n -> EMA seconds
        self.counts: dict[int, int] = {}
        self.last: dict[int, int] = {}  # n -> the update count when n was last measured
        self.updates = 0
        self.obs: deque[tuple[int, float]] = deque(maxlen=64)  # the latest raw measurements (n, seconds)

    def update(self, n: int, seconds: float) -> None:
        self.updates += 1
        self.obs.append((n, seconds))
        old = self.seconds.get(n)
        self.seconds[n] = seconds if old is None else self.decay * old + (1 - self.decay) * seconds
        self.counts[n] = self.counts.get(n, 0) + 1
        self.last[n] = self.updates

    def current(self) -> list[int]:
        """The sizes in the curve: measured within the last ``window`` updates, increasing."""
        return sorted(n for n, at in self.last.items() if self.updates - at < self.window)

    @property
    def sizes(self) -> int:
        """How many distinct input counts the curve is made of now."""
        return len(self.current())

    def points(self) -> list[tuple[int, float]]:
        """(n, seconds) in increasing n: the isotonic fit's convex minorant at every current n."""
        ns = self.current()
        monotone = _isotonic([self.seconds[n] for n in ns], [min(self.counts[n], 10) for n in ns])
        return list(zip(ns, _convex_minorant(ns, monotone)))

    def predict(self, n: float) -> float | None:
        pts = self.points()
        if not pts:
            return None
        if n <= pts[0][0] or len(pts) == 1:
            return pts[0][1] if n <= pts[0][0] else pts[0][1] * n / pts[0][0]  # one size: proportional growth
        for (n0, t0), (n1, t1) in zip(pts, pts[1:]):
            if n <= n1:
                return t0 + (t1 - t0) * (n - n0) / (n1 - n0)
        (n0, t0), (n1, t1) = pts[-2], pts[-1]
        return t1 + (t1 - t0) / (n1 - n0) * (n - n1)

    def snapshot(self) -> dict[int, float]:
        return {n: round(t, 6) for n, t in self.points()}


def _isotonic(values: list[float], weights: list[float]) -> list[float]:
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


def _convex_minorant(xs: list[float], ys: list[float]) -> list[float]:
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


class DrafterCost:
    """EMA of each drafter's seconds per call (drafters without a forward: one proposal)."""

    def __init__(self, decay: float = 0.8) -> None:
        self.decay = decay
        self.seconds: dict[str, float] = {}

    def update(self, drafter: str, seconds: float) -> None:
        old = self.seconds.get(drafter)
        self.seconds[drafter] = seconds if old is None else self.decay * old + (1 - self.decay) * seconds

    def get(self, drafter: str) -> float | None:
        return self.seconds.get(drafter)
