"""Adapters in an S3-compatible object store (`s3://bucket/prefix`): AWS S3, MinIO, Ceph, ...

The client comes from boto3's standard configuration: the credential chain (env, shared config and
credentials files, SSO, instance/container roles), `AWS_REGION` / `AWS_DEFAULT_REGION`, and the
endpoint override `AWS_ENDPOINT_URL_S3` or `AWS_ENDPOINT_URL` (MinIO, Ceph), plus botocore's own
request retries (`AWS_MAX_ATTEMPTS`, `AWS_RETRY_MODE`).

Adapter `x` is the key prefix `prefix/x/`. Locating it is one LIST call (sizes, ETags); a download
GETs only the files the store needs (`base.wanted_files`), streams each into the caller's staging
folder while hashing it, checks its length and its `sha256` user metadata when present (kept
next to the cached file as a `<file>.sha256` sidecar, so the declaration travels with it), and
retries transient failures — including a connection cut in the middle of a body, which botocore
does not retry — with exponential backoff (`retry`). Errors: a missing key is
`AdapterNotFoundError`; access denied, missing credentials or exhausted retries are
`AdapterLoadError`; a digest mismatch is `AdapterIntegrityError`; a prefix with pickle weights or no
weights is refused before any download (`adapter_format.weights_file_or_refuse`). Listing reads each
`adapter_config.json` once per ETag (cached) and the `checksums.sha256` objects, never weights.
Imports only `sources.base` of the sources package.
"""

from __future__ import annotations

import hashlib
import http.client
import logging
import os
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import urllib3.exceptions
from botocore.exceptions import BotoCoreError, ClientError, NoCredentialsError, PartialCredentialsError

from lora_cluster.adapter_format import CONFIG_FILE, WEIGHTS_FILE, weights_file_or_refuse
from lora_cluster.errors import AdapterLoadError, AdapterNotFoundError, ConfigError
from lora_cluster.s3_client import LazyS3Client
from lora_cluster.store.checksum import (
    CHECKSUMS_FILE,
    S3_METADATA_KEY,
    SIDECAR_SUFFIX,
    parse_checksums,
    sha256_file,
    verify,
)
from lora_cluster.store.crypto import ENC_WEIGHTS_FILE
from lora_cluster.store.retry import with_retries
from lora_cluster.store.sources.base import (
    AdapterInfo,
    FileInfo,
    Located,
    info_from_config,
    wanted_files,
    weights_name,
)

log = logging.getLogger(__name__)
_TRANSIENT_CODES = {"SlowDown", "Throttling", "ThrottlingException", "RequestTimeout", "RequestTimeTooSkewed",
                    "InternalError", "ServiceUnavailable", "503", "500", "502", "504"}
_NOT_FOUND_CODES = {"NoSuchKey", "404", "NotFound", "NoSuchBucket"}
CONFIG_READERS = 8  # concurrent GETs of adapter configs when describing thousands of adapters


class _ShortRead(Exception):
    """The body ended before Content-Length bytes arrived (treated as transient)."""


def is_transient(error: BaseException) -> bool:
    if isinstance(error, (NoCredentialsError, PartialCredentialsError)):
        return False
    if isinstance(error, ClientError):
        code = str(error.response.get("Error", {}).get("Code", ""))
        status = error.response.get("ResponseMetadata", {}).get("HTTPStatusCode", 0)
        return code in _TRANSIENT_CODES or status >= 500
    return isinstance(error, (BotoCoreError, urllib3.exceptions.HTTPError, http.client.HTTPException,
                              ConnectionError, TimeoutError, _ShortRead))


class S3Source:
    """An `AdapterSource` over one bucket and prefix (see the module docstring)."""

    remote = True

    def __init__(
        self,
        uri: str,
        *,
        retries: int = 3,
        backoff_s: float = 0.5,
        timeout_s: float = 60.0,
        sleep: Callable[[float], None] = time.sleep,
        on_retry: Callable[[BaseException, int], None] = lambda error, attempt: None,
        client: Any = None,
    ):
        rest = uri.removeprefix("s3://")
        self.bucket, _, prefix = rest.partition("/")
        if not self.bucket:
            raise ConfigError(f"adapter source {uri!r}: expected s3://bucket[/prefix]")
        self.uri, self.prefix = uri.rstrip("/"), prefix.strip("/")
        self.retries, self.backoff_s, self.timeout_s = retries, backoff_s, timeout_s
        self._sleep, self._on_retry = sleep, on_retry
        self._s3 = LazyS3Client(client, connect_timeout_s=timeout_s, read_timeout_s=timeout_s)
        self._configs: dict[tuple[str, str], bytes] = {}  # (key, etag) -> config / checksums file bytes

    def __repr__(self) -> str:
        return f"S3Source({self.uri})"

    @property
    def client(self) -> Any:
        """One boto3 client per source (`lora_cluster.s3_client`)."""
        return self._s3.get()

    def _key(self, *parts: str) -> str:
        return "/".join(p.strip("/") for p in (self.prefix, *parts) if p)

    def _call(self, adapter_id: str, what: str, fn: Callable[[], Any]) -> Any:
        def give_up(error: BaseException, attempts: int) -> Exception:
            return AdapterLoadError(adapter_id,
                                    f"{what} failed after {attempts} attempts: {_describe(error)}")

        try:
            return with_retries(fn, retries=self.retries, backoff_s=self.backoff_s, is_transient=is_transient,
                                give_up=give_up, sleep=self._sleep, on_retry=self._on_retry)
        except ClientError as e:
            code = str(e.response.get("Error", {}).get("Code", ""))
            if code in _NOT_FOUND_CODES:
                raise AdapterNotFoundError(adapter_id, f"{what}: {code} ({_describe(e)})") from e
            raise AdapterLoadError(adapter_id, f"{what} failed: {_describe(e)}") from e
        except (NoCredentialsError, PartialCredentialsError) as e:
            raise AdapterLoadError(adapter_id, f"{what}: no usable AWS credentials ({e})") from e

    def _list(self, adapter_id: str, prefix: str, delimiter: str | None) -> list[dict]:
        def run() -> list[dict]:
            objects, token = [], None
            while True:
                kwargs: dict[str, Any] = {"Bucket": self.bucket, "Prefix": prefix}
                if delimiter:
                    kwargs["Delimiter"] = delimiter
                if token:
                    kwargs["ContinuationToken"] = token
                page = self.client.list_objects_v2(**kwargs)
                objects.extend(page.get("Contents", []))
                if not page.get("IsTruncated"):
                    return objects
                token = page["NextContinuationToken"]

        return self._call(adapter_id, f"listing s3://{self.bucket}/{prefix}", run)

    def locate(self, adapter_id: str, subpath: str) -> Located | None:
        base = self._key(subpath)
        prefix = f"{base}/" if base else ""
        files = {
            o["Key"][len(prefix):]: FileInfo(o["Size"], o.get("ETag", "").strip('"') or None)
            for o in self._list(adapter_id, prefix, "/")
        }
        return Located(subpath, files) if CONFIG_FILE in files else None

    def fetch(self, adapter_id: str, located: Located, dest: Path) -> dict[str, str]:
        """Download the adapter's needed files into `dest`; returns {file name: sha256 of its bytes}."""
        weights_file_or_refuse(adapter_id, located.files, (WEIGHTS_FILE, ENC_WEIGHTS_FILE),
                               where=self._location(located.subpath))
        names = wanted_files(located.files)
        digests = {name: self._download(adapter_id, self._key(located.subpath, name), dest / name,
                                        located.files[name].size)
                   for name in names}
        for sidecar in dest.glob(f"*{SIDECAR_SUFFIX}"):  # written from object metadata
            digests.setdefault(sidecar.name, sha256_file(sidecar))
        return digests

    def _download(self, adapter_id: str, key: str, path: Path, size: int) -> str:
        def run() -> str:
            response = self.client.get_object(Bucket=self.bucket, Key=key)
            expected = response.get("ContentLength", size)
            digest, n = hashlib.sha256(), 0
            with open(path, "wb") as f:
                for chunk in response["Body"].iter_chunks(1 << 20):
                    f.write(chunk)
                    digest.update(chunk)
                    n += len(chunk)
                f.flush()
                os.fsync(f.fileno())
            if n != expected:
                raise _ShortRead(f"got {n} of {expected} bytes")
            actual = digest.hexdigest()
            declared = (response.get("Metadata") or {}).get(S3_METADATA_KEY)
            verify(adapter_id, path.name, actual, declared)
            if declared:  # keep the source's declaration with the cached copy, as a sidecar
                path.with_name(path.name + SIDECAR_SUFFIX).write_text(f"{actual}  {path.name}\n")
            return actual

        return self._call(adapter_id, f"downloading s3://{self.bucket}/{key}", run)

    def _get_small(self, adapter_id: str, key: str) -> bytes:
        return self._call(adapter_id, f"reading s3://{self.bucket}/{key}",
                          lambda: self.client.get_object(Bucket=self.bucket, Key=key)["Body"].read())

    def _location(self, subpath: str) -> str:
        base = self._key(subpath)
        return f"s3://{self.bucket}/{base}" if base else f"s3://{self.bucket}"

    def _folders(self) -> tuple[str, dict[str, dict[str, dict]]]:
        """The key prefix and, per folder under it, its objects by file name (one paginated listing)."""
        base = self._key()
        prefix = f"{base}/" if base else ""
        folders: dict[str, dict[str, dict]] = {}
        for o in self._list("*", prefix, None):
            folder, _, name = o["Key"][len(prefix):].rpartition("/")
            folders.setdefault(folder, {})[name] = o
        return prefix, folders

    def adapter_ids(self) -> list[str]:
        """Folders holding a config, from the key listing alone (no object is read)."""
        _, folders = self._folders()
        return sorted(f for f, objects in folders.items() if f and CONFIG_FILE in objects)

    def adapters(self) -> list[AdapterInfo]:
        _, folders = self._folders()
        configs = {f: objs[CONFIG_FILE] for f, objs in folders.items() if f and CONFIG_FILE in objs}
        missing = {(o["Key"], o.get("ETag", "")): f for f, o in configs.items()
                   if (o["Key"], o.get("ETag", "")) not in self._configs}
        if missing:  # configs not read yet (by ETag): read them concurrently, not one round trip at a time
            with ThreadPoolExecutor(CONFIG_READERS, thread_name_prefix="s3-configs") as pool:
                bodies = pool.map(lambda item: self._get_small(item[1], item[0][0]), missing.items())
                for cache_key, body in zip(missing, bodies, strict=True):
                    self._configs[cache_key] = body
        infos = []
        for folder in sorted(folders):
            objects = folders[folder]
            if CONFIG_FILE not in objects or not folder:
                continue
            config = objects[CONFIG_FILE]
            cache_key = (config["Key"], config.get("ETag", ""))
            if cache_key not in self._configs:
                self._configs[cache_key] = self._get_small(folder, config["Key"])
            weights = weights_name(objects)
            sha = None
            if CHECKSUMS_FILE in objects and weights:
                sums = objects[CHECKSUMS_FILE]
                sums_key = (sums["Key"], sums.get("ETag", ""))
                if sums_key not in self._configs:
                    self._configs[sums_key] = self._get_small(folder, sums["Key"])
                text = self._configs[sums_key].decode(errors="replace")
                sha = parse_checksums(folder, text).get(weights)
            etag = objects[weights].get("ETag", "").strip('"') if weights else None
            infos.append(info_from_config(folder, self._location(folder), self.uri, self._configs[cache_key],
                                          {n: o["Size"] for n, o in objects.items()}, sha, etag))
        return infos


def _describe(error: BaseException) -> str:
    text = str(error) or type(error).__name__
    return text if len(text) < 300 else text[:300] + "…"
