"""The adapter store's CPU policy: its torch work runs on one intra-op thread.

Parsing, validating, quantizing, dequantizing and merging an adapter run with one intra-op thread in
the calling thread (`torch.set_num_threads` is per thread with OpenMP), so a load in one of the
engine's loader threads never competes with the step loop's parallel kernels for the cores.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch


@contextlib.contextmanager
def single_threaded() -> Iterator[None]:
    """Run torch ops of the calling thread on one intra-op thread (OpenMP: per thread), then restore."""
    before = torch.get_num_threads()
    if before > 1:
        torch.set_num_threads(1)
    try:
        yield
    finally:
        if before > 1:
            torch.set_num_threads(before)
