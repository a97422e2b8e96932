"""The controller process's garbage collector: the young generation's threshold.

CPython collects its youngest generation after every 700 net allocations of container objects (its
default, `gc.get_threshold()[0]`). The controller's inputs allocate many containers that live until
the next input (each park's claims per replica, each report's adapter sets, the queue's entries),
so at 700 a young collection ran every few of its calls, each walking the survivors again, and
promoting them to older generations that are walked again in turn. A threshold in the tens of
thousands lets most of them die first: fewer, longer collections (`controller_gc_threshold`; the
figures in docs/scale.md). The older generations keep CPython's thresholds.

The live controller actor sets it for its process (`set_young_threshold`); the simulator sets it for
the span of its run (`young_threshold`), since its controller calls are timed in the simulating
process (`sim.cluster_policy`), where collections charge whatever code is running. No Ray, no torch.
"""

from __future__ import annotations

import gc
from collections.abc import Iterator
from contextlib import contextmanager


def set_young_threshold(threshold: int) -> tuple[int, int, int]:
    """Set the youngest generation's threshold to `threshold` (the others kept); returns the three
    thresholds as they were."""
    before: tuple[int, int, int] = gc.get_threshold()
    gc.set_threshold(threshold, before[1], before[2])
    return before


@contextmanager
def young_threshold(threshold: int) -> Iterator[None]:
    """`set_young_threshold` for the span of a `with` block, the thresholds as they were after it,
    on every path out."""
    before = set_young_threshold(threshold)
    try:
        yield
    finally:
        gc.set_threshold(*before)
