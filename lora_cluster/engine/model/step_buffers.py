"""Step metadata in buffers allocated once: every index list of a step in one host-to-device copy.

An engine step needs a dozen small integer tensors (token ids, positions, KV indices, block tables,
LoRA segments of each projection). Made one by one with `torch.tensor(..., device="cuda")` each is
a device allocation plus a synchronous copy. `StepBuffers.pack` instead writes all of them into one
host staging buffer (pinned on CUDA) and copies it with one non-blocking transfer into a device
buffer that lives as long as the engine (it grows, rarely, when a step needs more room); the
tensors handed back are views of that device buffer. On CPU the views are of the staging tensor
itself, with no copy at all.

Invariant: the views of a pack are valid until the next `pack` (the engine runs one step at a time:
the previous step's forward pass has finished, its logits read on the host, before the next pack).
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence

import torch


class StepBuffers:
    """Packs lists of ints into int64 tensors on `device` (see the module docstring)."""

    def __init__(self, device: torch.device, capacity: int = 1 << 14):
        self.device = device
        self._cuda = device.type == "cuda"
        self._host = torch.empty(0, dtype=torch.int64)
        self._dev = torch.empty(0, dtype=torch.int64, device=device)
        if self._cuda:
            self._grow(capacity)

    def _grow(self, n: int) -> None:
        size = max(n, 2 * self._dev.numel())
        self._host = torch.empty(size, dtype=torch.int64, pin_memory=True)
        self._dev = torch.empty(size, dtype=torch.int64, device=self.device)

    def pack(self, lists: Sequence[Sequence[int]]) -> list[torch.Tensor]:
        """One int64 tensor on the device per list, all views of one buffer filled by one copy."""
        flat = torch.tensor(list(itertools.chain.from_iterable(lists)), dtype=torch.int64)
        if self._cuda:
            n = flat.numel()
            if n > self._dev.numel():
                self._grow(n)
            self._host[:n].copy_(flat)
            self._dev[:n].copy_(self._host[:n], non_blocking=True)
            flat = self._dev
        sizes = [len(v) for v in lists]
        offsets = [0, *itertools.accumulate(sizes)]
        return [flat[a:b] for a, b in itertools.pairwise(offsets)]
