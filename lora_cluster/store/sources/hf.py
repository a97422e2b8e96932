"""Adapters in a Hugging Face hub repo (`hf://org/name[@revision][/sub/folder]`), via huggingface_hub.

Files come through huggingface_hub's own cache (`HF_HUB_CACHE` / `HF_HOME`), which acts as this
source's disk tier (it is not counted in `disk_cache_bytes`; manage it with the `hf cache` tools).
With `HF_HUB_OFFLINE=1` (read at each call) only the local cache is used, so a replica without hub
access serves whatever was pre-populated there. Only the files the store needs are fetched
(`allow_patterns`): configs for a listing, then config, weights and checksums for a load. LFS
files sit in the cache under their sha256 (`blobs/<sha256>`), so that digest is verified on load.

Adapter `x` is the repo sub-folder `x`; a repo whose root is an adapter offers it under the repo's
name (`hf://org/my-adapter` serves adapter id `my-adapter`). Tokens: `HF_TOKEN` as usual.
Imports only `sources.base` of the sources package (huggingface_hub itself is imported on use).
"""

from __future__ import annotations

import os
from pathlib import Path

from lora_cluster.adapter_format import CONFIG_FILE, WEIGHTS_FILE
from lora_cluster.errors import AdapterLoadError, ConfigError
from lora_cluster.store.checksum import CHECKSUMS_FILE, SIDECAR_SUFFIX, declared_digests, is_sha256
from lora_cluster.store.crypto import ENC_WEIGHTS_FILE
from lora_cluster.store.sources.base import AdapterInfo, Located, info_from_config, weights_name

_FILES = (CONFIG_FILE, WEIGHTS_FILE, ENC_WEIGHTS_FILE, CHECKSUMS_FILE)


def hub_offline() -> bool:
    return os.environ.get("HF_HUB_OFFLINE", "").strip().upper() in {"1", "ON", "YES", "TRUE"}


class HfSource:
    """An `AdapterSource` over one hub repo (see the module docstring)."""

    remote = True

    def __init__(self, uri: str):
        parts = uri.removeprefix("hf://").strip("/").split("/")
        if len(parts) < 2 or not parts[0] or not parts[1]:
            raise ConfigError(f"adapter source {uri!r}: expected hf://org/name[@revision][/sub/folder]")
        name, _, revision = parts[1].partition("@")
        self.uri = uri.rstrip("/")
        self.repo_id, self.name = f"{parts[0]}/{name}", name
        self.revision = revision or None
        self.subdir = "/".join(parts[2:])

    def __repr__(self) -> str:
        return f"HfSource({self.uri})"

    def _prefix(self, subpath: str) -> str:
        return "/".join(p for p in (self.subdir, subpath) if p)

    def _snapshot(self, adapter_id: str, patterns: list[str]) -> Path | None:
        """The repo's snapshot folder holding (at least) the files matching `patterns`; None when
        the repo or revision does not exist (or, offline, is not in the cache)."""
        from huggingface_hub import snapshot_download
        from huggingface_hub.errors import (
            GatedRepoError,
            HfHubHTTPError,
            LocalEntryNotFoundError,
            RepositoryNotFoundError,
            RevisionNotFoundError,
        )

        try:
            return Path(snapshot_download(
                self.repo_id, revision=self.revision, allow_patterns=patterns,
                cache_dir=os.environ.get("HF_HUB_CACHE") or None, local_files_only=hub_offline()))
        except GatedRepoError as e:
            raise AdapterLoadError(adapter_id, f"{self.uri}: access to the gated repo was refused") from e
        except (LocalEntryNotFoundError, RepositoryNotFoundError, RevisionNotFoundError):
            return None
        except (HfHubHTTPError, OSError, ValueError) as e:
            reason = (e.strerror if isinstance(e, OSError) else None) or str(e)  # strerror: no cache path
            raise AdapterLoadError(adapter_id, f"{self.uri}: {type(e).__name__}: {reason}") from e

    def _patterns(self, prefix: str, names: tuple[str, ...]) -> list[str]:
        names = (*names, *(n + SIDECAR_SUFFIX for n in names))
        return [f"{prefix}/{n}" if prefix else n for n in names]

    def locate(self, adapter_id: str, subpath: str) -> Located | None:
        snapshot = self._snapshot(adapter_id, self._patterns(self._prefix(subpath), (CONFIG_FILE,))
                                  + self._patterns(self._prefix(""), (CONFIG_FILE,)))
        if snapshot is None:
            return None
        root = snapshot / self.subdir if self.subdir else snapshot
        if (root / subpath / CONFIG_FILE).is_file():
            return Located(subpath)
        if subpath == self.name and (root / CONFIG_FILE).is_file():
            return Located("")  # a repo whose root is the adapter, asked for by the repo's name
        return None

    def local_folder(self, adapter_id: str, located: Located) -> tuple[Path, dict[str, str]]:
        """Fetch the adapter into the hub cache (offline: find it there) and return its folder and
        the sha256 digests known from the cache's blob names."""
        prefix = self._prefix(located.subpath)
        snapshot = self._snapshot(adapter_id, self._patterns(prefix, _FILES))
        if snapshot is None:
            raise AdapterLoadError(adapter_id, f"{self.uri}: the repo or revision disappeared")
        folder = snapshot / prefix if prefix else snapshot
        digests = {}
        for path in folder.iterdir() if folder.is_dir() else ():
            blob = path.resolve().name
            if path.is_symlink() and is_sha256(blob):
                digests[path.name] = blob
        return folder, digests

    def adapter_ids(self) -> list[str]:
        return [info.adapter_id for info in self.adapters()]  # the local hub cache: no network

    def adapters(self) -> list[AdapterInfo]:
        snapshot = self._snapshot("*", [f"*{CONFIG_FILE}", f"*{CHECKSUMS_FILE}"])
        if snapshot is None:
            return []
        root = snapshot / self.subdir if self.subdir else snapshot
        infos = []
        for config in sorted(root.glob(f"**/{CONFIG_FILE}")):
            folder = config.parent
            rel = folder.relative_to(root).as_posix()
            adapter_id = self.name if rel == "." else rel
            sizes = {p.name: p.stat().st_size for p in folder.iterdir() if p.is_file()}
            weights = weights_name(sizes)
            try:
                sha = declared_digests(adapter_id, folder, [weights] if weights else []).get(weights or "")
            except Exception:
                sha = None
            sub = self._prefix("" if rel == "." else rel)
            location = (f"hf://{self.repo_id}" + (f"@{self.revision}" if self.revision else "")
                        + (f"/{sub}" if sub else ""))
            infos.append(info_from_config(adapter_id, location, self.uri, config.read_bytes(), sizes, sha,
                                          None))
        return infos
