"""Device-resident adapter slots, allocated once at start with fixed addresses.

For each projection `m`, `a[m]` is [num_layers, num_slots rows, max_rank, in_features] and `b[m]`
is [num_layers, num_slots rows, out_features, max_rank] (a transposed view, see below), indexed by *row*,
not by slot: `rows[m][slot]` is the row of the slot's adapter in m's tensors, -1 when the adapter
does not target m. Each storage unit (a fused group, whose members share one stacked A, or a single
projection) gives rows only to the adapters that target it, the lowest free row first, so the
adapters of a projection sit in few consecutive rows and a batched matmul over a span of rows reads
no other adapter's zero padding (`lora_kernels.slot_batch`: the demo zoo's adapters target 2 to 7
of the 7 projections; docs/bench_decode.md). Loading an adapter copies its weights into its rows
(scaling folded into B, rows/columns past its rank zeroed); nothing is allocated per switch, so the
tensors the forward pass reads never move. A DoRA adapter's magnitude becomes a per-row scale
folded into B plus `dora[m]` (g - 1 per layer, slot and output feature; see `adapters.dora`).

On a mixture of experts, each slot also holds LoRA on every expert's projections (`expert_a[u]`
[num_layers, rows, experts, max_rank, in], `expert_b[u]` [num_layers, rows, experts, out,
max_rank], u = "experts.gate_up_proj" / "experts.down_proj", one unit "experts" for their rows):
an adapter's `experts.{e}.{param}` weights land in expert e of its row (`engine.model.moe` reads them).

Invariants: a slot holds at most one adapter version; an adapter id maps to at most one slot (its
current version); a slot with references (running sequences) is never overwritten; eviction picks
the least recently used unreferenced slot. An adapter whose id now names newer weights is
*retired* while sequences still use it: the id no longer maps to the slot (new requests load the
new version elsewhere), the running sequences keep their slot, and the slot is freed when the last
of them releases it. An optional `SlotPolicy` (the store's, see `store.ports`) refines victim
choice: its `protected` adapters (pinned, or used by a queued request) are never evicted, victims
go by lowest `priority` (then LRU), and it is told of every placement and removal (`on_device`).
"""

from __future__ import annotations

import time
from collections.abc import Callable

import torch

from lora_cluster.adapter_experts import expert_unit
from lora_cluster.adapter_format import LoraWeights, ModelShapes
from lora_cluster.engine.adapters import dora
from lora_cluster.errors import AdapterCapacityError, AdapterFormatError
from lora_cluster.store.ports import SlotPolicy

# fused projections of one input: the LoRA layer runs one shrink per group (see `AdapterPool.a_fused`)
FUSED_GROUPS = {"qkv": ("q_proj", "k_proj", "v_proj"), "gate_up": ("gate_proj", "up_proj")}


class AdapterPool:
    """The device slots of adapters and their rows (see the module docstring)."""

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
        base_weight: Callable[[int, str], torch.Tensor] | None = None,
    ):
        self.num_slots, self.max_rank = num_slots, max_rank
        self.policy = policy
        self._base_weight = base_weight  # (layer, projection) -> base weight [out, in], for DoRA
        self._allocate(shapes, dtype, device)
        self._index_units(shapes)
        self.dora_slots = [False] * num_slots  # whether each slot's live adapter is DoRA
        # module -> rank of that projection in each slot (0: not targeted / empty)
        self.module_ranks = {m: [0] * num_slots for m in [*shapes.modules, *self.expert_a]}
        # module -> rank rows that may be non-zero in each row of its tensors (an evicted adapter's rows
        # stay until the row is reused, and only they are cleared then)
        self._written = {m: [0] * num_slots for m in self.module_ranks}
        self._owner: list[str | None] = [None] * num_slots  # current or retired adapter of each slot
        self._version = [0] * num_slots
        self._retired = [False] * num_slots
        self._refs = [0] * num_slots
        self._last_used = [0.0] * num_slots
        self._slot_of: dict[str, int] = {}
        self._clock = clock

    def _allocate(self, shapes: ModelShapes, dtype: torch.dtype, device: torch.device) -> None:
        """The LoRA tensors of every slot row (see the module docstring), zero, allocated once."""
        n, num_slots, max_rank = shapes.num_layers, self.num_slots, self.max_rank
        # Fused groups (q/k/v, gate/up: one input) store A rank-major, [layers, rows, rank, member, in]:
        # `a_fused[g]` [layers, rows, rank * members, in] has the ranks < r of every member in its first
        # members * r rows (one shrink for the group, see engine.model.lora_layer); `a[m]` is member m's view.
        self.groups = {
            g: ms for g, ms in FUSED_GROUPS.items()
            if all(m in shapes.modules for m in ms) and len({shapes.modules[m][0] for m in ms}) == 1
        }  # fmt: skip
        self.a_fused: dict[str, torch.Tensor] = {}
        self.a: dict[str, torch.Tensor] = {}
        for g, ms in self.groups.items():
            shape = (n, num_slots, max_rank, len(ms), shapes.modules[ms[0]][0])
            stacked = torch.zeros(shape, dtype=dtype, device=device)
            self.a_fused[g] = stacked.flatten(2, 3)
            self.a.update({m: stacked[:, :, :, j] for j, m in enumerate(ms)})
        for m, (i, _) in shapes.modules.items():
            if m not in self.a:
                self.a[m] = torch.zeros((n, num_slots, max_rank, i), dtype=dtype, device=device)
        # LoRA on the experts (mixtures of experts): per projection, every expert of every slot's row
        self.expert_a: dict[str, torch.Tensor] = {}
        self.expert_b: dict[str, torch.Tensor] = {}
        for p, (i, o) in shapes.expert_modules.items():
            experts = (n, num_slots, shapes.experts, max_rank)
            self.expert_a[f"experts.{p}"] = torch.zeros((*experts, i), dtype=dtype, device=device)
            self.expert_b[f"experts.{p}"] = torch.zeros((*experts, o), dtype=dtype, device=device).mT
        # B is stored [layers, rows, max_rank, out] and exposed transposed: a row's [r, out] block is
        # then contiguous, which makes the expand GEMM's weight a plain (non-transposed) operand.
        self.b = {
            m: torch.zeros((n, num_slots, max_rank, o), dtype=dtype, device=device).mT
            for m, (_, o) in shapes.modules.items()
        }
        # DoRA (`adapters.dora`): g - 1 per [layer, slot, output feature] of each projection, indexed by
        # *slot*; the extra last slot row stays zero (the index of base rows), as do plain LoRA slots
        self.dora = {
            m: torch.zeros((n, num_slots + 1, o), dtype=dtype, device=device)
            for m, (_, o) in shapes.modules.items()
        }

    def _index_units(self, shapes: ModelShapes) -> None:
        """The storage units (a fused group, a single projection, the experts) and their row lists."""
        grouped = {m for ms in self.groups.values() for m in ms}
        self.units = {**self.groups, **{m: (m,) for m in shapes.modules if m not in grouped}}
        if self.expert_a:
            self.units["experts"] = tuple(self.expert_a)
        # projection or group -> row of each slot (-1: none); the members of a unit share one list
        self.rows: dict[str, list[int]] = {}
        self._row_slot: dict[str, list[int]] = {}  # unit -> slot of each row (-1: free)
        for u, ms in self.units.items():
            self._row_slot[u] = [-1] * self.num_slots
            shared = [-1] * self.num_slots
            self.rows.update({k: shared for k in (u, *ms)})

    def slot_of(self, adapter_id: str) -> int | None:
        """The slot holding the adapter's current version, or None."""
        return self._slot_of.get(adapter_id)

    def version_of(self, adapter_id: str) -> int | None:
        """The version of the adapter's weights in its slot (None: not resident)."""
        slot = self._slot_of.get(adapter_id)
        return None if slot is None else self._version[slot]

    def slot_version(self, slot: int) -> int:
        """The version of the weights a slot holds (its current or retired adapter's)."""
        return self._version[slot]

    def slot_rank(self, slot: int) -> int:
        """The LoRA rank a slot runs with (its largest projection rank); 0 for the base model (-1)."""
        return 0 if slot < 0 else max((ranks[slot] for ranks in self.module_ranks.values()), default=0)

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

    def next_victim(self) -> str | None:
        """The adapter the next `reserve` would evict; None when an empty slot is free or no slot can
        be taken (`can_allocate` tells which)."""
        slot = self._victim()
        return None if slot is None else self._owner[slot]

    @property
    def num_free(self) -> int:
        """Slots that an allocation could use now (empty or unreferenced)."""
        return sum(1 for s in range(self.num_slots) if self._refs[s] == 0)

    def allocate(self, weights: LoraWeights) -> int:
        """Copy `weights` into a slot (evicting the LRU idle adapter if needed) and return the slot.
        The adapter must not be resident (evict or retire its old version first)."""
        slot = self.reserve(weights)
        self.write(slot, weights)
        self.commit(slot, weights)
        return slot

    def reserve(self, weights: LoraWeights) -> int:
        """Take a slot for `weights` (evicting a victim) without copying yet: the adapter maps to the
        slot, which holds one reference for the copy and runs nothing (ranks 0) until `commit`."""
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
        for m in self.module_ranks:
            self.module_ranks[m][slot] = 0
        self.dora_slots[slot] = False
        self._free_rows(slot)
        for u, ms in self.units.items():
            if any(weights.module_rank(m) for m in ms):
                row = self._row_slot[u].index(-1)  # a unit has a row per slot: one is free
                self._row_slot[u][row] = slot
                self.rows[u][slot] = row
        self._owner[slot] = weights.adapter_id
        self._version[slot] = weights.version
        self._retired[slot] = False
        self._slot_of[weights.adapter_id] = slot
        self._refs[slot] += 1
        self._last_used[slot] = self._clock()
        return slot

    def write(self, slot: int, weights: LoraWeights) -> None:
        """Copy `weights` into the rows of a slot reserved for them; touches no other slot's rows (safe
        on a copy thread while a forward pass reads the others)."""
        for m in self.module_ranks:
            row = self.rows[m][slot]
            if row < 0:
                continue
            stale, rank = self._written[m][row], weights.module_rank(m)
            self._written[m][row] = max(stale, rank)
            if stale and m in self.expert_a:
                self.expert_a[m][:, row, :, :stale].zero_()
                self.expert_b[m][:, row, :, :, :stale].zero_()
            elif stale:
                self.a[m][:, row, :stale].zero_()
                self.b[m][:, row, :, :stale].zero_()
        for t in self.dora.values():
            t[:, slot].zero_()
        if weights.magnitude and self._base_weight is None:
            raise AdapterFormatError(weights.adapter_id, "DoRA needs the base weights, which this pool lacks")
        for (layer, m), wa in weights.a.items():
            r, scaling, unit = wa.shape[0], weights.scaling[m], expert_unit(m)
            wb = weights.b[(layer, m)]
            wb = wb * scaling if scaling != 1 else wb
            magnitude = weights.magnitude.get((layer, m))
            if magnitude is not None:
                g = dora.row_scale(self._base_weight(layer, m), wa, wb, magnitude)
                self.dora[m][layer, slot].copy_(g - 1)
                wb = wb * g.to(wb.device)[:, None]
            if unit is not None:
                row, e = self.rows[unit][slot], int(m.split(".")[1])
                self.expert_a[unit][layer, row, e, :r].copy_(wa, non_blocking=True)
                self.expert_b[unit][layer, row, e, :, :r].copy_(wb, non_blocking=True)
                continue
            row = self.rows[m][slot]
            self.a[m][layer, row, :r].copy_(wa, non_blocking=True)
            self.b[m][layer, row, :, :r].copy_(wb, non_blocking=True)
        for m in self.module_ranks:
            row = self.rows[m][slot]
            if row >= 0:
                self._written[m][row] = weights.module_rank(m)

    def commit(self, slot: int, weights: LoraWeights) -> None:
        """The copy into a reserved slot is complete: its ranks go live and the copy's reference is
        dropped (a slot retired meanwhile is freed then)."""
        for m in self.module_ranks:
            self.module_ranks[m][slot] = weights.module_rank(m)
        self.dora_slots[slot] = bool(weights.magnitude)
        if not self._retired[slot] and self.policy is not None:
            self.policy.on_device(weights.adapter_id, True)
        self.release(slot)

    def abandon(self, slot: int) -> None:
        """A copy into a reserved slot failed: free the slot (its stale rows are cleared on reuse)."""
        owner = self._owner[slot]
        if owner is not None and self._slot_of.get(owner) == slot:
            del self._slot_of[owner]
        self._retired[slot] = True
        self.release(slot)

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
        self.dora_slots[slot] = False
        self._free_rows(slot)

    def _free_rows(self, slot: int) -> None:
        """Return the slot's rows to their units (their stale contents are cleared on reuse)."""
        for u in self.units:
            row = self.rows[u][slot]
            if row >= 0:
                self._row_slot[u][row] = -1
                self.rows[u][slot] = -1

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

    def fragmentation(self) -> float:
        """Internal fragmentation of the slots in use: the share of their bytes that holds padding,
        because every slot is sized for `max_rank` on every projection while an adapter uses its own
        rank and only the projections it targets. 1 - (bytes the live adapters need) / (bytes of their
        slots); 0.0 when no slot holds a live adapter. Empty slots are free memory, not fragmentation."""
        row_bytes = {m: a.shape[0] * (a.shape[-1] + self.b[m].shape[-2]) * a.element_size()
                     for m, a in self.a.items()}  # one rank row of one slot, over every layer
        for m, a in self.expert_a.items():  # every expert's rank row
            layers, _, experts, _, width = a.shape
            row_bytes[m] = layers * experts * (width + self.expert_b[m].shape[-2]) * a.element_size()
        live = [s for s in range(self.num_slots) if any(r[s] for r in self.module_ranks.values())]
        if not live:
            return 0.0
        needed = sum(self.module_ranks[m][s] * b for m, b in row_bytes.items() for s in live)
        return 1.0 - needed / (len(live) * self.max_rank * sum(row_bytes.values()))

    @property
    def nbytes(self) -> int:
        fused = {m for ms in self.groups.values() for m in ms}
        a = [*self.a_fused.values(), *(t for m, t in self.a.items() if m not in fused)]
        experts = (*self.expert_a.values(), *self.expert_b.values())
        tensors = (*a, *self.b.values(), *experts, *self.dora.values())
        return sum(t.numel() * t.element_size() for t in tensors)
