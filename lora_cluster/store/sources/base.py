"""What every adapter source shares: the `AdapterSource` protocol, what a lookup and a listing
report, and the helpers that pick an adapter's files from a listing of names.

This module imports no source implementation; `local`, `s3` and `hf` import only this module (and
the format, checksum and crypto conventions), and the package's `open_source` imports them.

Invariants of a source:
* `locate(adapter_id, subpath)` answers for one adapter, `adapters()` for all of them; neither
  reads weights (listings come from configs, sizes and declared checksums only).
* `remote` sources (S3, hub) hand their files to the store through a cache (the store's disk cache
  for S3, the hub cache for the hub); a local folder is read in place.
* Every error names the adapter it is about.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

from lora_cluster.adapter_format import CONFIG_FILE, WEIGHTS_FILE
from lora_cluster.store.checksum import CHECKSUMS_FILE, SIDECAR_SUFFIX
from lora_cluster.store.crypto import ENC_WEIGHTS_FILE


@dataclass(frozen=True)
class FileInfo:
    """One file of an adapter as a remote listing reports it."""

    size: int
    etag: str | None = None
    sha256: str | None = None  # declared by the source (object metadata), when known


@dataclass(frozen=True)
class Located:
    """Where a source found an adapter: `subpath` under its root ('' = the root itself)."""

    subpath: str
    files: dict[str, FileInfo] = field(default_factory=dict)  # remote sources: the listing


@dataclass(frozen=True)
class AdapterInfo:
    """One adapter as a listing reports it (no weights were read)."""

    adapter_id: str
    location: str  # URI of the adapter itself (usable with `register`)
    source: str  # URI of the source that offers it
    rank: int | None
    target_modules: tuple[str, ...]
    size_bytes: int  # bytes of the adapter's files (config, weights, checksums)
    sha256: str | None  # declared sha256 of the weights file, when the source provides one
    etag: str | None  # the object store's ETag of the weights file (S3), when known
    encrypted: bool
    base_model: str | None = None


class AdapterSource(Protocol):
    """A place adapters come from, named by a URI (see `lora_cluster.store.sources`)."""

    uri: str
    remote: bool

    def locate(self, adapter_id: str, subpath: str) -> Located | None:
        """The adapter at `subpath` ('' = the root), or None when this source does not offer it;
        errors name `adapter_id`."""
        ...

    def adapters(self) -> list[AdapterInfo]:
        """Every adapter this source offers, from configs and metadata only."""
        ...

    def adapter_ids(self) -> list[str]:
        """The ids `adapters()` would describe, without reading any config (a listing only)."""
        ...


def wanted_files(names: set[str] | dict[str, object]) -> list[str]:
    """Files of an adapter folder the store needs: config, weights (plain and/or encrypted),
    the checksums file and the sidecars of those."""
    core = [n for n in (CONFIG_FILE, WEIGHTS_FILE, ENC_WEIGHTS_FILE, CHECKSUMS_FILE) if n in names]
    return core + [n + SIDECAR_SUFFIX for n in core if n + SIDECAR_SUFFIX in names]


def weights_name(names: set[str] | dict[str, object]) -> str | None:
    """The adapter's weights file among `names`: the plaintext one when present, else the encrypted
    one, else None (a listing reports such a folder; loading it is refused)."""
    if WEIGHTS_FILE in names:
        return WEIGHTS_FILE
    return ENC_WEIGHTS_FILE if ENC_WEIGHTS_FILE in names else None


def info_from_config(adapter_id: str, location: str, source: str, config_text: str | bytes,
                     sizes: dict[str, int], sha256: str | None, etag: str | None) -> AdapterInfo:
    """An `AdapterInfo` from an adapter's config text and its file sizes. A config that does not
    parse lists the adapter without rank or target modules (loading it reports the error)."""
    try:
        config = json.loads(config_text)
    except ValueError:
        config = {}
    config = config if isinstance(config, dict) else {}
    targets = config.get("target_modules") or []
    return AdapterInfo(
        adapter_id=adapter_id, location=location, source=source,
        rank=config.get("r") if isinstance(config.get("r"), int) else None,
        target_modules=tuple(sorted(targets)) if isinstance(targets, list) else (str(targets),),
        size_bytes=sum(sizes[n] for n in wanted_files(sizes)),
        sha256=sha256, etag=etag, encrypted=weights_name(sizes) == ENC_WEIGHTS_FILE,
        base_model=config.get("base_model_name_or_path"),
    )


def folder_of(uri: str) -> Path:
    """The local folder a `/path` or `file:///path` URI names, `~` expanded as a shell does: a
    `~user` of no user on this host stays as written (a folder that does not exist, so an adapter
    registered there is unknown, never a server error)."""
    path = Path(uri.removeprefix("file://"))
    try:
        return path.expanduser()
    except RuntimeError:  # pathlib's answer for a home it cannot determine
        return path
