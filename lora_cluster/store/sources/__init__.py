"""Adapter sources by URI: `open_source(uri)` and the types every source shares.

URIs (the `adapter_source` config field; a list, first source offering an id wins):
* `/path` or `file:///path` — a local folder; adapter `x` is the sub-folder `/path/x` (`local`).
* `s3://bucket/prefix` — adapter `x` is the key prefix `prefix/x/` (boto3, standard AWS config; `s3`).
* `hf://org/name[@revision][/sub/folder]` — a Hugging Face hub repo; adapter `x` is its sub-folder
  `x`, and a repo whose root is an adapter offers it under the repo's name (`hf`).
`register(adapter_id, location)` takes the same URIs pointing at one adapter (the location is the
adapter itself). Every source lists its adapters with rank, target modules, size and checksum
without reading weights. A source is `remote` when its files must come through the store's disk
cache (S3) or the hub cache (hub); a local folder is read in place.

Layout (no import cycle): `base` holds the `AdapterSource` protocol, `FileInfo`, `Located`,
`AdapterInfo` and the helpers the implementations share; `local`, `s3` and `hf` import only `base`
(never this package's `__init__`); this module imports the implementations for `open_source`.
"""

from __future__ import annotations

from lora_cluster.errors import ConfigError
from lora_cluster.store.sources.base import AdapterInfo, AdapterSource, FileInfo, Located
from lora_cluster.store.sources.hf import HfSource
from lora_cluster.store.sources.local import LocalSource
from lora_cluster.store.sources.s3 import S3Source


def open_source(uri: str, **remote_options: object) -> AdapterSource:
    """The source for `uri`; `remote_options` (retries, backoff_s, timeout_s, sleep, on_retry) go to
    S3 and are ignored by the other sources. An unknown scheme is ConfigError."""
    if uri.startswith("s3://"):
        return S3Source(uri, **remote_options)  # type: ignore[arg-type]
    if uri.startswith("hf://"):
        return HfSource(uri)
    if "://" in uri and not uri.startswith("file://"):
        raise ConfigError(f"adapter source {uri!r}: unsupported scheme (use a folder, file://, s3:// or hf://)")
    return LocalSource(uri)


__all__ = [
    "AdapterInfo",
    "AdapterSource",
    "FileInfo",
    "HfSource",
    "LocalSource",
    "Located",
    "S3Source",
    "open_source",
]
