"""A local folder of adapters (`/path` or `file:///path`), read in place (it is its own disk tier).

Adapter `x` is the sub-folder `/path/x` (nested ids `org/x` are nested folders); the first source
folder holding the id wins, exactly like `FolderAdapterLoader`. The listing reads configs and
declared checksums only; a bad checksums file is reported when the adapter is loaded, not listed.
Imports only `sources.base` of the sources package.
"""

from __future__ import annotations

from pathlib import Path

from lora_cluster.adapter_format import CONFIG_FILE
from lora_cluster.store.checksum import declared_digests
from lora_cluster.store.sources.base import AdapterInfo, Located, folder_of, info_from_config, weights_name


class LocalSource:
    """An `AdapterSource` over one local folder (see the module docstring)."""

    remote = False

    def __init__(self, uri: str):
        self.uri = uri
        self.root = folder_of(uri)

    def __repr__(self) -> str:
        return f"LocalSource({self.root})"

    def folder(self, subpath: str) -> Path:
        return self.root / subpath if subpath else self.root

    def locate(self, adapter_id: str, subpath: str) -> Located | None:
        return Located(subpath) if self.folder(subpath).is_dir() else None

    def local_folder(self, adapter_id: str, located: Located) -> tuple[Path, dict[str, str]]:
        """The adapter's folder, read in place (no digests known beyond those it declares)."""
        return self.folder(located.subpath), {}

    def adapter_ids(self) -> list[str]:
        if not self.root.is_dir():
            return []
        configs = self.root.glob(f"**/{CONFIG_FILE}")
        ids = (config.parent.relative_to(self.root).as_posix() for config in configs)
        return sorted(self.root.name if i == "." else i for i in ids)

    def adapters(self) -> list[AdapterInfo]:
        if not self.root.is_dir():
            return []
        infos = []
        for config in sorted(self.root.glob(f"**/{CONFIG_FILE}")):
            folder = config.parent
            adapter_id = folder.relative_to(self.root).as_posix()
            adapter_id = self.root.name if adapter_id == "." else adapter_id
            sizes = {p.name: p.stat().st_size for p in folder.iterdir() if p.is_file()}
            weights = weights_name(sizes)
            try:
                sha = declared_digests(adapter_id, folder, [weights] if weights else []).get(weights or "")
            except Exception:  # a bad checksums file is reported when the adapter is loaded
                sha = None
            infos.append(info_from_config(adapter_id, folder.as_uri(), self.uri, config.read_bytes(), sizes,
                                          sha, None))
        return infos
