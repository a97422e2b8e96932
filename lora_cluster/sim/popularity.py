"""Zipf adapter popularity: the one sampler of the simulator, the benchmarks and the load tests.

Rank `k` (0-based, so rank 0 is the hottest) has weight `1 / (k + 1)^s`. A draw consumes exactly one
`rng.random()` and picks the rank that `random.Random.choices` picks with the same weights: the
cumulative weights are built the same way (`itertools.accumulate` over the same floats) and searched
the same way (`bisect` below the last index). So a seed gives the same sequence of ranks whether a
caller draws one at a time between other uses of its generator (the simulator's workload, the SLA
benchmark, a Locust user) or `k` at once (`draws`), and the same sequence the earlier hand-written
copies of this code produced; the docs' figures depend on that.

Extra weights after the `n` ranks (`extra_weights`) give a population beyond the adapters, e.g. the
soak test's base model, drawn as often as rank 0 (weight 1.0): its index is `n`.

Pure: the standard library only, importable without torch, numpy or Ray.
"""

from __future__ import annotations

import bisect
import itertools
import random
from collections.abc import Sequence


def zipf_weights(n: int, s: float) -> list[float]:
    """The unnormalized weights `1 / (k + 1)^s` of ranks `0 .. n-1`."""
    if n < 1:
        raise ValueError(f"Zipf popularity needs at least one rank, got n={n}")
    return [1.0 / (k + 1) ** s for k in range(n)]


def zipf_share(n: int, s: float, top: int) -> float:
    """The share of draws that go to the `top` most popular of `n` ranks (the hit-rate ceiling of
    `top` slots that always hold the hottest adapters)."""
    weights = zipf_weights(n, s)
    return sum(weights[:top]) / sum(weights)


class ZipfSampler:
    """Draws ranks `0 .. n-1` (and `n ..` for `extra_weights`) with probability proportional to
    their weights; one `rng.random()` per draw, the choice `rng.choices` makes with these weights."""

    def __init__(self, n: int, s: float, *, extra_weights: Sequence[float] = ()) -> None:
        if any(w < 0 for w in extra_weights):
            raise ValueError(f"extra weights must be >= 0, got {list(extra_weights)}")
        self.n, self.s = n, s
        self.weights = [*zipf_weights(n, s), *extra_weights]
        self._cum = list(itertools.accumulate(self.weights))
        self._total = self._cum[-1] + 0.0
        self._hi = len(self._cum) - 1

    def draw(self, rng: random.Random) -> int:
        """One rank."""
        return bisect.bisect(self._cum, rng.random() * self._total, 0, self._hi)

    def draws(self, rng: random.Random, k: int) -> list[int]:
        """`k` ranks: the same as `k` calls of `draw`."""
        return [self.draw(rng) for _ in range(k)]

    def share(self, top: int) -> float:
        """The share of draws that go to the `top` first indexes."""
        return sum(self.weights[:top]) / self._cum[-1]
