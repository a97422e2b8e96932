"""Device-resident adapter slots, allocated once at start with fixed addresses.

For each projection `m`, `a[m]` is [num_layers, num_slots, max_rank, in_features] and `b[m]` is
[num_layers, num_slots, out_features, max_rank] (a transposed view, see below). Loading an adapter
copies its weights into a slot (scaling folded into B, rows/columns past its rank and projections
it does not target zeroed); nothing is allocated per switch, so the tensors the forward pass reads
never move.

Invariants: a slot holds at most one adapter version; an adapter id maps to at most one slot (its
current version); a slot with references (running sequences) is never overwritten; eviction picks
the least recently used unreferenced slot. An adapter whose id now names newer weights is
*retired* while sequences still use it: the id no longer maps to the slot (new requests load the
new version elsewhere), the running sequences keep their slot, and the slot is freed when the last
of them releases it. An optional `SlotPolicy` (the loader's, see `engine.loader`) refines victim
choice: its `protected` adapters (pinned, or used by a queued request) are never evicted, victims
go by lowest `priority` (then LRU), and it is told of every placement and removal (`on_device`).
"""

from __future__ import annotations

import time
from collections.abc import Callable

import torch

from lora_cluster.adapter_format import LoraWeights, ModelShapes
from lora_cluster.engine.loader import SlotPolicy
from lora_cluster.errors import AdapterCapacityError


class AdapterPool:
    def __init__(
        self,
        shapes: ModelShapes,
        *,
        num_slots: int,
        max_rank: int,
        dtype: torch.dtype,
        device: torch.device,
        clock: Callable[[], float] = time.monotonic,
        policy: SlotPolicy | None = None,
    ):
        self.num_slots, self.max_rank = num_slots, max_rank
        self.policy = policy
        n = shapes.num_layers
        self.a = {
            m: torch.zeros((n, num_slots, max_rank, i), dtype=dtype, device=device)
            for m, (i, _) in shapes.modules.items()
        }
        # B is stored [layers, slots, max_rank, out] and exposed transposed: a slot's [r, out] block is
        # then contiguous, which makes the expand GEMM's weight a plain (non-transposed) operand.
        self.b = {
            m: torch.zeros((n, num_slots, max_rank, o), dtype=dtype, device=device).mT
            for m, (_, o) in shapes.modules.items()
        }
        # module -> rank of that projection in each slot (0: not targeted / empty)
        self.module_ranks = {m: [0] * num_slots for m in shapes.modules}
        # module -> rank rows that may be non-zero in each slot (>= module_ranks; an evicted adapter's
        # rows stay until the slot is reused, and only they are cleared then)
        self._written = {m: [0] * num_slots for m in shapes.modules}
        self._owner: list[str | None] = [None] * num_slots  # current or retired adapter of each slot
        self._version = [0] * num_slots
        self._retired = [False] * num_slots
        self._refs = [0] * num_slots
        self._last_used = [0.0] * num_slots
        self._slot_of: dict[str, int] = {}
        self._clock = clock

    def slot_of(self, adapter_id: str) -> int | None:
        """The slot holding the adapter's current version, or None."""
        return self._slot_of.get(adapter_id)

    def version_of(self, adapter_id: str) -> int | None:
        """The version of the adapter's weights in its slot (None: not resident)."""
        slot = self._slot_of.get(adapter_id)
        return None if slot is None else self._version[slot]

    def resident(self) -> list[str]:
        return list(self._slot_of)

    def _victim(self) -> int | None:
        free = [s for s in range(self.num_slots) if self._owner[s] is None]
        if free:
            return free[0]
        idle = [s for s in range(self.num_slots) if self._refs[s] == 0 and not self._retired[s]]
        if self.policy is None:
            return min(idle, key=self._last_used.__getitem__, default=None)
        p = self.policy
        idle = [s for s in idle if not p.protected(self._owner[s])]
        return min(idle, key=lambda s: (p.priority(self._owner[s]), self._last_used[s]), default=None)

    def can_allocate(self) -> bool:
        return self._victim() is not None

    @property
    def num_free(self) -> int:
        """Slots that an allocation could use now (empty or unreferenced)."""
        return sum(1 for s in range(self.num_slots) if self._refs[s] == 0)

    def allocate(self, weights: LoraWeights) -> int:
        """Copy `weights` into a slot (evicting the LRU idle adapter if needed) and return the slot.
        The adapter must not be resident (evict or retire its old version first)."""
        if weights.adapter_id in self._slot_of:
            raise RuntimeError(f"adapter {weights.adapter_id!r} is already resident (evict or retire it)")
        if weights.rank > self.max_rank:
            raise AdapterCapacityError(weights.adapter_id, f"rank {weights.rank} > slot rank {self.max_rank}")
        slot = self._victim()
        if slot is None:
            raise AdapterCapacityError(
                weights.adapter_id, f"all {self.num_slots} adapter slots (max_loras) are in use"
            )
        old = self._owner[slot]
        if old is not None:
            del self._slot_of[old]
            if self.policy is not None:
                self.policy.on_device(old, False)
        for m in self.a:
            stale = self._written[m][slot]
            if stale:
                self.a[m][:, slot, :stale].zero_()
                self.b[m][:, slot, :, :stale].zero_()
            self.module_ranks[m][slot] = self._written[m][slot] = weights.module_rank(m)
        for (layer, m), wa in weights.a.items():
            r = wa.shape[0]
            self.a[m][layer, slot, :r].copy_(wa)
            self.b[m][layer, slot, :, :r].copy_(weights.b[(layer, m)] * weights.scaling[m])
        self._owner[slot] = weights.adapter_id
        self._version[slot] = weights.version
        self._slot_of[weights.adapter_id] = slot
        self._last_used[slot] = self._clock()
        if self.policy is not None:
            self.policy.on_device(weights.adapter_id, True)
        return slot

    def acquire(self, adapter_id: str) -> int:
        """Take a reference on a resident adapter (a running sequence uses it)."""
        slot = self._slot_of[adapter_id]
        self._refs[slot] += 1
        self._last_used[slot] = self._clock()
        return slot

    def release(self, slot: int) -> None:
        """Drop a reference taken by `acquire`; a retired slot is freed with its last reference."""
        if self._refs[slot] <= 0:
            raise RuntimeError(f"slot {slot} ({self._owner[slot]!r}) released more often than acquired")
        self._refs[slot] -= 1
        if self._refs[slot] == 0 and self._retired[slot]:
            self._clear(slot)

    def retire(self, adapter_id: str) -> None:
        """The adapter id now names newer weights: detach it from its slot (see the module docstring).
        An unreferenced slot is freed at once."""
        slot = self._slot_of.pop(adapter_id, None)
        if slot is None:
            return
        if self.policy is not None:
            self.policy.on_device(adapter_id, False)
        if self._refs[slot] == 0:
            self._clear(slot)
        else:
            self._retired[slot] = True

    def _clear(self, slot: int) -> None:
        self._owner[slot] = None
        self._retired[slot] = False
        for m in self.module_ranks:
            self.module_ranks[m][slot] = 0

    def evict(self, adapter_id: str) -> bool:
        """Drop an unreferenced adapter from its slot; False when it is in use or not resident."""
        slot = self._slot_of.get(adapter_id)
        if slot is None or self._refs[slot] > 0:
            return False
        del self._slot_of[adapter_id]
        self._clear(slot)
        if self.policy is not None:
            self.policy.on_device(adapter_id, False)
        return True

    def refs(self, adapter_id: str) -> int:
        slot = self._slot_of.get(adapter_id)
        return 0 if slot is None else self._refs[slot]

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (*self.a.values(), *self.b.values()))
