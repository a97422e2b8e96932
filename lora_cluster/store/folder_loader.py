"""The plain folder loader: adapters are sub-folders of local folders, read on every load.

No caches, no budgets: `adapter_store="folder"` selects it, for debugging and for tests that want
the engine without the tiered store. The first folder holding an id wins; `register` maps an id to
a folder of its own (vLLM's load_lora_adapter) and bumps the id's version. Merged adapters
(`define_merge`) are built from their adapters on every load. It serves the `WeightSource` and the
`AdapterCatalog` (`store.ports`); its residency hooks, counters and `close` do nothing
(`StatelessHooks`).
"""

from __future__ import annotations

import threading
from pathlib import Path

from lora_cluster.adapter_format import LoraWeights, ModelShapes, load_peft_adapter
from lora_cluster.errors import AdapterNotFoundError
from lora_cluster.request.adapter_id import check_adapter_id
from lora_cluster.request.merge_spec import MergeSpec
from lora_cluster.store.merged import MergedAdapters
from lora_cluster.store.ports import StatelessHooks
from lora_cluster.store.sources.base import folder_of
from lora_cluster.store.versions import Versions


class FolderAdapterLoader(StatelessHooks):
    """An `AdapterStore` over local folders (see the module docstring)."""

    def __init__(self, sources: list[str], shapes: ModelShapes, max_rank: int, *,
                 max_merged_adapters: int = 256, merge_seed: int = 0):
        self.folders = [folder_of(s) for s in sources]
        self.shapes, self.max_rank = shapes, max_rank
        self._registered: dict[str, Path] = {}
        self._versions = Versions()
        self._lock = threading.Lock()
        self.merged = MergedAdapters(max_entries=max_merged_adapters, load=self._load_plain,
                                     version=self._versions.get, versions=self._versions,
                                     in_use=lambda adapter_id: False, module_order=list(shapes.modules),
                                     max_rank=max_rank, seed=merge_seed)

    # ----- WeightSource -------------------------------------------------------------------

    def load(self, adapter_id: str) -> LoraWeights:
        check_adapter_id(adapter_id)
        if self.merged.spec(adapter_id) is not None:
            return self.merged.build(adapter_id)
        return self._load_plain(adapter_id)

    def _load_plain(self, adapter_id: str) -> LoraWeights:
        version = self._versions.get(adapter_id)
        with self._lock:
            folder = self._registered.get(adapter_id)
        if folder is None:
            folder = next((f / adapter_id for f in self.folders if (f / adapter_id).is_dir()), None)
        if folder is None:
            raise AdapterNotFoundError(adapter_id, "not found in the configured adapter sources")
        weights = load_peft_adapter(adapter_id, folder, self.shapes, self.max_rank)
        weights.version = version
        return weights

    def version(self, adapter_id: str) -> int:
        if self.merged.spec(adapter_id) is not None:
            return self.merged.version(adapter_id)
        return self._versions.get(adapter_id)

    # ----- AdapterCatalog -----------------------------------------------------------------

    def list_adapters(self) -> list[str]:
        with self._lock:
            seen: dict[str, None] = dict.fromkeys(self._registered)
        for folder in self.folders:
            if folder.is_dir():
                for cfg in sorted(folder.glob("**/adapter_config.json")):
                    seen.setdefault(cfg.parent.relative_to(folder).as_posix(), None)
        return list(seen)

    def register(self, adapter_id: str, location: str) -> None:
        check_adapter_id(adapter_id)
        try:
            folder = Path(location.removeprefix("file://")).expanduser()
        except RuntimeError:  # `~user` of no user on this host
            raise AdapterNotFoundError(adapter_id, "its lora_path is in the home of no user here") from None
        load_peft_adapter(adapter_id, folder, self.shapes, self.max_rank)  # refuse what would fail later
        with self._lock:
            self._registered[adapter_id] = folder
        self._versions.bump(adapter_id)

    def unregister(self, adapter_id: str) -> bool:
        check_adapter_id(adapter_id)
        with self._lock:
            found = self._registered.pop(adapter_id, None) is not None
        if found:
            self._versions.bump(adapter_id)
        return found

    def define_merge(self, spec: MergeSpec) -> str:
        return self.merged.define(spec)
