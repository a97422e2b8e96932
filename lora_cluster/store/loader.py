"""What the engine needs from wherever adapters come from: the `AdapterLoader` protocol.

It lives with the store that implements it; the engine imports it from here (downward). The caller
wires a loader into the engine (`engine.factory.build_engine(adapter_loader=...)`, which by default
wires `store.build_adapter_loader`); the engine never builds or inspects one beyond this
protocol. Implementations: the tiered adapter store (`lora_cluster.store.TieredAdapterStore`, the
default) and the plain folder loader (`lora_cluster.store.folder_loader.FolderAdapterLoader`).
Importing this module imports no torch.

Contract:
* `load` runs on the engine's loader threads, never on the step loop; it is thread-safe, validates
  what it returns and raises an `AdapterError` naming the adapter. The weights carry the adapter's
  `version` at the time they were read.
* `version(adapter_id)` changes whenever what the id names changes (re-registered, unregistered,
  invalidated). The engine compares it with the version of the weights in a device slot or a
  finished host fetch, and never serves an older version to a new request.
* `slot_policy()` is the device pool's victim policy (None: plain LRU).
* `define_merge(spec)` remembers a merged adapter (`lora_cluster.request.merge_spec.MergeSpec`) and returns
  its id, which `load` and `version` then serve like any other id (thread-safe, no I/O).
* `request_started` / `request_finished` bracket each request of an adapter (so no tier evicts what
  a queued or running request needs); `load_abandoned` says that weights returned by `load` will
  not be placed (their request went away), so the loader can count them against its budgets again.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    from lora_cluster.adapter_format import LoraWeights
    from lora_cluster.request.merge_spec import MergeSpec


class SlotPolicy(Protocol):
    """How the device pool picks victims among idle slots."""

    def protected(self, adapter_id: str) -> bool:
        """Never evict this adapter (pinned, or a queued request needs it)."""
        ...

    def priority(self, adapter_id: str) -> float:
        """Victims go lowest priority first (then least recently used)."""
        ...

    def on_device(self, adapter_id: str, resident: bool) -> None:
        """The pool placed (True) or dropped (False) the adapter."""
        ...


class AdapterLoader(Protocol):
    def load(self, adapter_id: str) -> LoraWeights:
        """Fetch, validate and return the adapter's host weights (blocking, thread-safe)."""
        ...

    def version(self, adapter_id: str) -> int:
        """The current version of `adapter_id` (cheap, no I/O, thread-safe)."""
        ...

    def list_adapters(self) -> list[str]:
        """Ids of the adapters the sources offer (blocking: may list a remote source)."""
        ...

    def register(self, adapter_id: str, location: str) -> None:
        """Serve `adapter_id` from `location` (vLLM's load_lora_adapter); validates before returning."""
        ...

    def unregister(self, adapter_id: str) -> bool:
        """Forget a registered adapter id; False when it was not registered."""
        ...

    def define_merge(self, spec: MergeSpec) -> str:
        """Remember a merge of adapters; returns its adapter id (thread-safe, no I/O)."""
        ...

    def slot_policy(self) -> SlotPolicy | None:
        """The device pool's victim policy, or None for least-recently-used."""
        ...

    def request_started(self, adapter_id: str) -> None:
        """A request for `adapter_id` was queued."""
        ...

    def request_finished(self, adapter_id: str) -> None:
        """That request finished, failed or was aborted (called once per `request_started`)."""
        ...

    def load_abandoned(self, adapter_id: str) -> None:
        """Weights that `load` returned will not be placed on the device."""
        ...

    def snapshot(self) -> dict[str, Any]:
        """Counters for metrics (`{"tiers": {...}, ...}`; empty when the loader keeps none)."""
        ...

    def close(self) -> None:
        """Stop background work."""
        ...


class StatelessHooks:
    """The `AdapterLoader` hooks of a loader that keeps no per-request state, no slot policy, no
    counters and no background work: each does nothing. A plain loader inherits them and supplies
    only what it really does (`load`, `version`, `list_adapters`, `register`, ...)."""

    def slot_policy(self) -> SlotPolicy | None:
        return None

    def request_started(self, adapter_id: str) -> None:
        return None

    def request_finished(self, adapter_id: str) -> None:
        return None

    def load_abandoned(self, adapter_id: str) -> None:
        return None

    def snapshot(self) -> dict[str, Any]:
        return {}

    def close(self) -> None:
        return None
