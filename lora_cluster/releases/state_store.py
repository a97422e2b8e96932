"""The durable release state: one JSON document, in a folder or an S3 object, written only over the
version it was read at (compare-and-swap), so that two ingresses never overwrite each other.

Kinds (`open_state_store`, the `release_state_uri` config field):
* a folder (`/path`, `file:///path`): the file `<path>/releases.json`. A write takes an exclusive
  lock on `<path>/releases.json.lock` (`fcntl.flock`: every process on the host, and NFS clients
  that honour it), checks that the document's `generation` is still the one read, writes a
  temporary file beside it, fsyncs it and renames it over the document (atomic: a reader sees the
  old document or the new one, never a torn one).
* S3 (`s3://bucket/prefix`): the object `prefix/releases.json`. A write is one PUT with
  `If-Match: <the ETag read>` (`If-None-Match: *` when there was no object): S3's conditional write
  (AWS since 2024, MinIO, moto); a 412 means another writer came first.
* memory (`MemoryStateStore`): this process's, for an ingress without `release_state_uri`.

Contract: `read()` is `(document or None, tag)`; `write(document, tag)` stores it and returns the new
tag, or raises `StateConflict` when the document changed since `tag` was read (the caller reads
again, re-applies its change and retries). Any other failure is `ReleaseStateUnavailableError`.
The calls block: the ingress runs them off its event loop.
"""

from __future__ import annotations

import fcntl
import json
import os
import threading
import uuid
from pathlib import Path
from typing import Any, Protocol

from lora_cluster.errors import ConfigError, ReleaseStateUnavailableError
from lora_cluster.s3_client import LazyS3Client

STATE_FILE = "releases.json"
SOURCE_FOLDER = ".lora-cluster"  # under the first adapter source, for `release_state_uri: adapter_source`
Document = dict[str, Any]


class StateConflict(Exception):
    """The document changed since it was read (another ingress wrote it): read again and retry."""


class StateStore(Protocol):
    """A document with compare-and-swap writes (module docstring)."""

    where: str  # the location, for logs and errors (no credentials)
    kind: str  # folder, s3 or memory: what the releases API shows

    def read(self) -> tuple[Document | None, str | None]: ...

    def write(self, document: Document, tag: str | None) -> str: ...


class MemoryStateStore:
    """The document in this process: the same contract, no durability."""

    where = kind = "memory"

    def __init__(self) -> None:
        self._document: Document | None = None
        self._generation = 0
        self._lock = threading.Lock()

    def read(self) -> tuple[Document | None, str | None]:
        with self._lock:
            if self._document is None:
                return None, None
            return json.loads(json.dumps(self._document)), str(self._generation)

    def write(self, document: Document, tag: str | None) -> str:
        with self._lock:
            current = str(self._generation) if self._document is not None else None
            if tag != current:
                raise StateConflict(f"memory: generation {current}, written over {tag}")
            self._document, self._generation = json.loads(json.dumps(document)), self._generation + 1
            return str(self._generation)


class FolderStateStore:
    """`releases.json` in a folder (module docstring); the tag is the document's `generation`."""

    kind = "folder"

    def __init__(self, folder: Path):
        self.folder = folder
        self.path, self.lock = folder / STATE_FILE, folder / (STATE_FILE + ".lock")
        self.where = str(self.path)

    def read(self) -> tuple[Document | None, str | None]:
        try:
            text = self.path.read_text()
        except FileNotFoundError:
            return None, None
        except OSError as exc:
            raise ReleaseStateUnavailableError(self.where, type(exc).__name__) from exc
        try:
            document = json.loads(text)
        except ValueError as exc:
            raise ReleaseStateUnavailableError(self.where, "not a JSON document") from exc
        return document, str(document.get("generation", 0))

    def write(self, document: Document, tag: str | None) -> str:
        try:
            self.folder.mkdir(parents=True, exist_ok=True)
            with open(self.lock, "a") as lock:
                fcntl.flock(lock, fcntl.LOCK_EX)
                try:
                    current = self.read()[1]
                    if current != tag:
                        raise StateConflict(f"{self.where}: generation {current}, written over {tag}")
                    generation = int(tag or 0) + 1
                    temp = self.folder / f"{STATE_FILE}.tmp-{uuid.uuid4().hex[:8]}"
                    with open(temp, "w") as out:
                        json.dump({**document, "generation": generation}, out)
                        out.flush()
                        os.fsync(out.fileno())
                    os.replace(temp, self.path)
                finally:
                    fcntl.flock(lock, fcntl.LOCK_UN)
        except OSError as exc:
            raise ReleaseStateUnavailableError(self.where, type(exc).__name__) from exc
        return str(generation)


class S3StateStore:
    """`prefix/releases.json` in a bucket, written with S3's conditional PUT (module docstring); the
    tag is the object's ETag. The client comes from boto3's standard configuration, like the S3
    adapter source's."""

    kind = "s3"

    def __init__(self, bucket: str, prefix: str, client: Any = None):
        self.bucket, self.key = bucket, "/".join(p for p in (prefix.strip("/"), STATE_FILE) if p)
        self.where = f"s3://{bucket}/{self.key}"
        self._s3 = LazyS3Client(client, connect_timeout_s=10, read_timeout_s=10)

    @property
    def client(self) -> Any:
        return self._s3.get()

    def read(self) -> tuple[Document | None, str | None]:
        try:
            reply = self.client.get_object(Bucket=self.bucket, Key=self.key)
            body = reply["Body"].read()
        except Exception as exc:
            if _code(exc) in ("NoSuchKey", "404", "NotFound"):
                return None, None
            raise ReleaseStateUnavailableError(self.where, _code(exc) or type(exc).__name__) from exc
        try:
            return json.loads(body), str(reply["ETag"])
        except ValueError as exc:
            raise ReleaseStateUnavailableError(self.where, "not a JSON document") from exc

    def write(self, document: Document, tag: str | None) -> str:
        condition = {"IfNoneMatch": "*"} if tag is None else {"IfMatch": tag}
        try:
            reply = self.client.put_object(Bucket=self.bucket, Key=self.key, ContentType="application/json",
                                           Body=json.dumps(document).encode(), **condition)
        except Exception as exc:
            if _code(exc) in ("PreconditionFailed", "412", "ConditionalRequestConflict", "409"):
                raise StateConflict(f"{self.where}: changed since ETag {tag}") from exc
            raise ReleaseStateUnavailableError(self.where, _code(exc) or type(exc).__name__) from exc
        return str(reply["ETag"])


def _code(exc: BaseException) -> str:
    response = getattr(exc, "response", None)
    return str(response.get("Error", {}).get("Code", "")) if isinstance(response, dict) else ""


def open_state_store(uri: str, adapter_sources: list[str]) -> StateStore | None:
    """The store `release_state_uri` names (None: empty, the ingress's memory); `adapter_source`
    means a `.lora-cluster` folder (key prefix) under the first adapter source. ConfigError for a
    kind that cannot hold it (hf://, no source)."""
    if not uri:
        return None
    if uri == "adapter_source":
        if not adapter_sources or adapter_sources[0].startswith("hf://"):
            raise ConfigError("release_state_uri: adapter_source needs a folder or s3:// first adapter "
                              f"source, got {adapter_sources[:1]}")
        uri = adapter_sources[0].rstrip("/") + "/" + SOURCE_FOLDER
    if uri.startswith("s3://"):
        bucket, _, prefix = uri.removeprefix("s3://").partition("/")
        if not bucket:
            raise ConfigError(f"release_state_uri {uri!r}: expected s3://bucket[/prefix]")
        return S3StateStore(bucket, prefix)
    if "://" in uri and not uri.startswith("file://"):
        raise ConfigError(f"release_state_uri {uri!r}: use a folder, file:// or s3://")
    return FolderStateStore(Path(uri.removeprefix("file://")).expanduser())
