"""What the engine and the replica need from wherever adapters come from: the store's ports.

Four small protocols, each served to the one caller that uses it, and two compositions of them
(and `ClusterTierPort`, what the cold tiers need from the cluster tier):
* `WeightSource` (`load`, `version`): an adapter's validated host weights and its current version;
  the engine's residency manager (`engine.adapters.residency`) fetches through it.
* `ResidencyHooks` (`slot_policy`, `request_started`, `request_finished`, `load_abandoned`): what
  the engine tells the store about device residency and requests, so that no tier evicts what a
  queued or running request needs; the engine (its device pool's victim policy) and its residency
  manager call them.
* `AdapterCatalog` (`list_adapters`, `register`, `unregister`, `define_merge`): which adapter ids
  exist; the replica (`serve.replica.deployment`) calls it directly, never through the engine.
* `StoreCounters` (`snapshot`): counters for metrics; the replica reads them.
* `EnginePort` = `WeightSource` + `ResidencyHooks` + `close`: what an `Engine` is wired with; the
  engine closes it when it closes.
* `AdapterStore` = `EnginePort` + `AdapterCatalog` + `StoreCounters`: a whole store, what
  `store.build_adapter_loader` builds: the tiered adapter store (`lora_cluster.store.TieredAdapterStore`,
  the default) and the plain folder loader (`lora_cluster.store.folder_loader.FolderAdapterLoader`).

The caller wires a store: `engine.factory.build_engine(adapter_loader=...)` takes an `EnginePort`
or a factory of one (by default `store.build_adapter_loader`), and the replica keeps the store
it built for its catalog and counters. They live with the store that implements them; the engine
imports them from here (downward). Importing this module imports no torch.

Contract:
* `load` runs on the engine's loader threads, never on the step loop; it is thread-safe, validates
  what it returns and raises an `AdapterError` naming the adapter. The weights carry the adapter's
  `version` at the time they were read.
* `version(adapter_id)` changes whenever what the id names changes (re-registered, unregistered,
  invalidated). The engine compares it with the version of the weights in a device slot or a
  finished host fetch, and never serves an older version to a new request.
* `slot_policy()` is the device pool's victim policy (None: plain LRU).
* `request_started` / `request_finished` bracket each request of an adapter (so no tier evicts what
  a queued or running request needs); `load_abandoned` says that weights returned by `load` will
  not be placed (their request went away), so the store can count them against its budgets again.
* `register` / `unregister` refuse an invalid id (`AdapterIdError`) and are thread-safe; they do
  blocking I/O (call them off any event loop and off the engine's step loop). A request queued after
  `register` returns gets the new weights (its `version` changed); running ones finish on theirs.
* `define_merge(spec)` remembers a merged adapter (`lora_cluster.request.merge_spec.MergeSpec`) and
  returns its id, which `load` and `version` then serve like any other id (thread-safe, no I/O).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    from pathlib import Path

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


class WeightSource(Protocol):
    """An adapter's host weights and its current version (see the module docstring)."""

    def load(self, adapter_id: str) -> LoraWeights:
        """Fetch, validate and return the adapter's host weights (blocking, thread-safe)."""
        ...

    def version(self, adapter_id: str) -> int:
        """The current version of `adapter_id` (cheap, no I/O, thread-safe)."""
        ...


class ResidencyHooks(Protocol):
    """What the engine reports about device residency and requests (see the module docstring)."""

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


class AdapterCatalog(Protocol):
    """Which adapter ids exist: listed, registered, merged (see the module docstring)."""

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


class StoreCounters(Protocol):
    """The store's counters, for metrics."""

    def snapshot(self) -> dict[str, Any]:
        """Counters for metrics (`{"tiers": {...}, ...}`; empty when the store keeps none)."""
        ...


class EnginePort(WeightSource, ResidencyHooks, Protocol):
    """What an `Engine` is wired with; the engine closes it when it closes."""

    def close(self) -> None:
        """Stop background work."""
        ...


class AdapterStore(EnginePort, AdapterCatalog, StoreCounters, Protocol):
    """A whole store: the engine's port, the replica's catalog and counters."""


class StatelessHooks:
    """The `ResidencyHooks`, counters and `close` of a store that keeps no per-request state, no slot
    policy, no counters and no background work: each does nothing. A plain store inherits them and
    supplies only what it really does (`load`, `version`, and its catalog, if it has one)."""

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


class ClusterTierPort(Protocol):
    """The cluster tier as the cold tiers use it (`cluster.cluster_tier`; the Ray edge:
    `serve.replica.cluster_tier.RayClusterTier`). Both calls block (a loader thread calls them, never an
    event loop) and never raise: a failure of the tier is a miss, and the source serves.

    * `fetch_into(adapter_id, dest, form)`: copy the published stored form of `adapter_id` into the
      folder `dest`, each file's sha256 verified against the publisher's; returns {file: sha256}, or
      None when it is not published in `form` or the copy failed. `form` is "files" (the source's
      files, as the disk tier keeps them) or "int8" (`store.int8_form`).
    * `publish(adapter_id, files, form)`: offer `files` ({name: bytes}, the stored form `form` of an
      adapter fetched from its source and admitted) to the tier; the tier publishes each adapter
      once, with each file's sha256, and counts `files`' bytes against its budget.
    """

    def fetch_into(self, adapter_id: str, dest: Path, form: str) -> dict[str, str] | None: ...

    def publish(self, adapter_id: str, files: dict[str, bytes], form: str) -> None: ...
