"""The offered workload: Poisson arrivals, Zipf adapter popularity, length distributions, a class mix.

* Arrivals: a Poisson process of rate `rate` (requests per simulated second).
* Adapters: `a0 .. a{M-1}`, drawn Zipf(A) (`popularity`): adapter `a{k}` with weight 1 / (k + 1)^A (so `a0` is
  the hottest). Each adapter's size is drawn once from the profile's adapter sizes.
* Lengths: prompt and output tokens log-normal (medians 200 and 100 tokens, sigma 0.8), clipped to
  [4, 1536] and [1, 512] (a chat-like mix with a long tail; prompt + output fits `max_model_len`).
* Classes: each request's SLA class is drawn from the mix (default 20% interactive, 50% standard,
  30% batch).

Everything is drawn from one `random.Random(seed)`: a seed gives the same requests every run.
"""

from __future__ import annotations

import bisect
import itertools
import math
import random
from collections.abc import Sequence

from lora_cluster.cluster.sla import SlaClass
from lora_cluster.sim.popularity import ZipfSampler

BlockKey = bytes | int  # a block's content key (`SimRequest.blocks`)
PROMPT_MEDIAN, OUTPUT_MEDIAN, LENGTH_SIGMA = 200.0, 100.0, 0.8
PROMPT_RANGE, OUTPUT_RANGE = (4, 1536), (1, 512)
DEFAULT_MIX = (("interactive", 0.2), ("standard", 0.5), ("batch", 0.3))


class SimRequest:
    """One request, from arrival to its end. Mutated by the replica that runs it."""

    __slots__ = ("adapter", "admitted_at", "arrival", "blocks", "cached", "finish_at", "finish_mark",
                 "first_token_at", "generated", "hit", "joined", "measured", "order", "output", "preempt_at",
                 "preemptions", "prefill_left", "prefix", "priority", "prompt", "reached_at", "replica",
                 "rid", "sla", "ticket")

    def __init__(self, rid: int, adapter: str, sla: SlaClass, prompt: int, output: int, arrival: float,
                 measured: bool):
        self.rid, self.adapter, self.sla, self.priority = rid, adapter, sla, sla.priority
        self.prompt, self.output, self.arrival, self.measured = prompt, output, arrival, measured
        self.replica: str | None = None
        self.ticket: str | None = None  # its cluster-queue ticket, if it was parked and granted
        self.order = 0  # arrival order at its replica (the engine's tie-break after priority)
        self.reached_at = 0.0  # when it reached its replica
        self.preempt_at = 0.0  # from when, waiting there, it may preempt less urgent work (its patience)
        self.hit = False  # its adapter was on its replica's device when it got there
        self.joined = False  # not a hit, but a fetch of its adapter there was under way (a delayed hit)
        self.admitted_at: float | None = None  # its first admission into a running batch (slot hold start)
        self.first_token_at: float | None = None
        self.finish_at: float | None = None
        self.generated = 0  # output tokens produced so far
        self.prefill_left = prompt  # tokens to (re)compute before the next token is sampled
        self.finish_mark = -1  # the replica's decode-step count at which it ends (-1: not decoding)
        self.preemptions = 0
        self.prefix: tuple[str, ...] = ()  # its prompt's routing keys (`prefix_keys.routing_keys`, chats)
        self.blocks: Sequence[BlockKey] = ()  # the engine's keys of its full blocks: prompt, answer
        self.cached = 0  # prompt tokens its replica's prefix cache held at its first admission

    def tpot_s(self) -> float | None:
        if self.finish_at is None or self.first_token_at is None or self.output < 2:
            return None
        return (self.finish_at - self.first_token_at) / (self.output - 1)


def _lognormal(rng: random.Random, median: float, bounds: tuple[int, int]) -> int:
    return min(bounds[1], max(bounds[0], round(rng.lognormvariate(math.log(median), LENGTH_SIGMA))))


def mean_lengths(samples: int = 20_000) -> tuple[float, float]:
    """Mean prompt and output tokens of the length distributions (a fixed sample, deterministic)."""
    rng = random.Random(12345)
    prompts = [_lognormal(rng, PROMPT_MEDIAN, PROMPT_RANGE) for _ in range(samples)]
    outputs = [_lognormal(rng, OUTPUT_MEDIAN, OUTPUT_RANGE) for _ in range(samples)]
    return sum(prompts) / samples, sum(outputs) / samples


class Workload:
    def __init__(self, *, adapters: int, zipf: float, rate: float, classes: Sequence[tuple[SlaClass, float]],
                 adapter_sizes: Sequence[int], seed: int, measure_from: float):
        if adapters < 1 or rate <= 0 or not classes:
            raise ValueError("a workload needs adapters >= 1, rate > 0 and at least one class")
        self.rate, self.measure_from = rate, measure_from
        self.rng = random.Random(seed)
        self.names = [f"a{k}" for k in range(adapters)]
        self._popularity = ZipfSampler(adapters, zipf)
        sizes = random.Random(seed + 1)
        self.sizes = {name: sizes.choice(adapter_sizes) for name in self.names}
        self._classes = [c for c, _ in classes]
        self._cum_classes = list(itertools.accumulate(w for _, w in classes))
        self._ids = itertools.count()
        self.next_at = self.rng.expovariate(rate)

    def pop(self) -> SimRequest:
        """The request arriving at `next_at`; draws the arrival after it."""
        rng, now = self.rng, self.next_at
        k = self._popularity.draw(rng)
        c = bisect.bisect(self._cum_classes, rng.random() * self._cum_classes[-1])
        adapter = self.names[k]
        sla = self._classes[min(c, len(self._classes) - 1)]
        prompt = _lognormal(rng, PROMPT_MEDIAN, PROMPT_RANGE)
        output = _lognormal(rng, OUTPUT_MEDIAN, OUTPUT_RANGE)
        req = SimRequest(next(self._ids), adapter, sla, prompt, output, now, now >= self.measure_from)
        self.next_at = now + rng.expovariate(self.rate)
        return req
