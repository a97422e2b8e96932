"""Where the release state is kept: the rule behind `release_state_uri`, its default `auto` included.

* A folder, `file://`, `s3://bucket/prefix` or `adapter_source` (a `.lora-cluster` folder or key
  prefix under the first adapter source): there (`state_store.open_state_store`).
* Empty: this ingress's memory, as the user asked (releases need one ingress replica; lost on a
  restart).
* `auto` (the default) picks, in order:
  1. the `.lora-cluster` folder under the first adapter source that is a local folder this process
     may write: beside the adapters it releases, so it lives as long as they do (a KubeRay rollout
     keeps it when that folder is a persistent volume, as a folder source on several nodes is);
  2. with one ingress replica only, the `.lora-cluster` folder under the adapter store's disk tier
     folder (`disk_cache_dir`; it survives a restart of the ingress on its node). The disk tier is
     node-local: with several ingress replicas, on several nodes, each would keep a document of its
     own and follow different releases, so it is not used then;
  3. memory, with one WARNING at the ingress's start saying why (the caller logs `reason`), and the
     releases API naming the kind (`memory`).
  S3 sources are never picked by `auto`: their credentials are often read-only and telling would
  take a write; `adapter_source` or an `s3://` URI asks for S3 explicitly.
Nothing is written here: a folder is created at the state's first write. The checks read the
filesystem (blocking): the ingress runs them in its constructor, off the event loop.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from lora_cluster.releases.state_store import SOURCE_FOLDER

AUTO = "auto"


@dataclass(frozen=True)
class StateLocation:
    """The state's place: `uri` for `open_state_store` ("" = memory), its `kind` (`folder`, `s3`,
    `memory`, as the releases API shows it) and why it was chosen (logged; no credentials)."""

    uri: str
    kind: str
    reason: str


def locate_state(uri: str, adapter_sources: list[str], disk_folder: str | None,
                 several_ingresses: bool) -> StateLocation:
    """`release_state_uri` resolved by the rule of the module docstring; `disk_folder`: the disk
    tier's folder (None: the store has no disk tier); `several_ingresses`: the ingress may run more
    than one replica."""
    if uri != AUTO:
        first = adapter_sources[0] if adapter_sources else ""
        remote = uri.startswith("s3://") or (uri == "adapter_source" and first.startswith("s3://"))
        return StateLocation(uri, "memory" if not uri else "s3" if remote else "folder", "release_state_uri")
    for source in adapter_sources:
        folder = _local_folder(source)
        if folder is not None and folder.is_dir() and _writable(folder / SOURCE_FOLDER):
            return StateLocation(str(folder / SOURCE_FOLDER), "folder",
                                 "auto: the first writable folder adapter source")
    if disk_folder is not None and not several_ingresses and _writable(Path(disk_folder) / SOURCE_FOLDER):
        return StateLocation(str(Path(disk_folder) / SOURCE_FOLDER), "folder",
                             "auto: the adapter store's disk tier folder (no writable folder adapter source)")
    why = "no adapter source is a folder this process may write"
    if disk_folder is not None and several_ingresses:
        why += ", and the disk tier folder is node-local while several ingress replicas run"
    elif disk_folder is not None:
        why += ", nor is the disk tier folder"
    return StateLocation("", "memory", f"auto: {why}")


def _local_folder(source: str) -> Path | None:
    """A local folder source's path (None for s3://, hf:// and other remote sources)."""
    if source.startswith("file://"):
        return Path(source.removeprefix("file://")).expanduser()
    return None if "://" in source else Path(source).expanduser()


def _writable(path: Path) -> bool:
    """This process may create or write `path`: it, or its nearest existing parent, is a folder it
    may write into."""
    for candidate in (path, *path.parents):
        if candidate.exists():
            return candidate.is_dir() and os.access(candidate, os.W_OK | os.X_OK)
    return False
