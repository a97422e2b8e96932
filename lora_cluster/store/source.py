"""Adapter sources by URI, the `AdapterSource` protocol and what a listing reports.

URIs (the `adapter_source` config field; a list, first source offering an id wins):
* `/path` or `file:///path` — a local folder; adapter `x` is the sub-folder `/path/x`.
* `s3://bucket/prefix` — adapter `x` is the key prefix `prefix/x/` (boto3, standard AWS config).
* `hf://org/name[@revision][/sub/folder]` — a Hugging Face hub repo; adapter `x` is its sub-folder
  `x`, and a repo whose root is an adapter offers it under the repo's name.
`register(adapter_id, location)` takes the same URIs pointing at one adapter (the location is the
adapter itself). Every source lists its adapters with rank, target modules, size and checksum
without reading weights. A source is `remote` when its files must come through the store's disk
cache (S3) or the hub cache (hub); a local folder is read in place.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

from lora_cluster.adapter_format import CONFIG_FILE, PICKLE_FILES, WEIGHTS_FILE
from lora_cluster.errors import ConfigError
from lora_cluster.store.checksum import CHECKSUMS_FILE, SIDECAR_SUFFIX
from lora_cluster.store.crypto import ENC_WEIGHTS_FILE


@dataclass(frozen=True)
class FileInfo:
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
    uri: str
    remote: bool

    def locate(self, adapter_id: str, subpath: str) -> Located | None:
        """The adapter at `subpath` ('' = the root), or None when this source does not offer it;
        errors name `adapter_id`."""
        ...

    def adapters(self) -> list[AdapterInfo]:
        """Every adapter this source offers, from configs and metadata only."""
        ...


def wanted_files(names: set[str] | dict[str, object]) -> list[str]:
    """Files of an adapter folder the store needs: config, weights (plain and/or encrypted),
    the checksums file and the sidecars of those."""
    core = [n for n in (CONFIG_FILE, WEIGHTS_FILE, ENC_WEIGHTS_FILE, CHECKSUMS_FILE) if n in names]
    return core + [n + SIDECAR_SUFFIX for n in core if n + SIDECAR_SUFFIX in names]


def weights_name(names: set[str] | dict[str, object]) -> str | None:
    if WEIGHTS_FILE in names:
        return WEIGHTS_FILE
    return ENC_WEIGHTS_FILE if ENC_WEIGHTS_FILE in names else None


def has_pickle_only(names: set[str] | dict[str, object]) -> str | None:
    return next((p for p in PICKLE_FILES if p in names), None) if weights_name(names) is None else None


def info_from_config(adapter_id: str, location: str, source: str, config_text: str | bytes,
                     sizes: dict[str, int], sha256: str | None, etag: str | None) -> AdapterInfo:
    """An `AdapterInfo` from an adapter's config text and its file sizes."""
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


def open_source(uri: str, **remote_options: object) -> AdapterSource:
    """The source for `uri`; `remote_options` (retries, backoff_s, timeout_s, sleep, stats) go to S3."""
    from lora_cluster.store.hf_source import HfSource
    from lora_cluster.store.local_source import LocalSource
    from lora_cluster.store.s3_source import S3Source

    if uri.startswith("s3://"):
        return S3Source(uri, **remote_options)  # type: ignore[arg-type]
    if uri.startswith("hf://"):
        return HfSource(uri)
    if "://" in uri and not uri.startswith("file://"):
        raise ConfigError(f"adapter source {uri!r}: unsupported scheme (use a folder, file://, s3:// or hf://)")
    return LocalSource(uri)


def is_plain_folder(uri: str) -> bool:
    return "://" not in uri or uri.startswith("file://")


def folder_of(uri: str) -> Path:
    return Path(uri.removeprefix("file://")).expanduser()
