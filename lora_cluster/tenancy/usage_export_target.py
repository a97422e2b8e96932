"""Where the usage export's files go: a folder or an S3 prefix (`usage_export_uri`), each file written whole.

Kinds (`open_export_target`):
* a folder (`/path`, `file:///path`): `<path>/<key>`, written to a temporary file beside it, fsynced and
  renamed over the key (a reader sees the old file or the new one, never a torn one);
* S3 (`s3://bucket/prefix`): the object `prefix/<key>`, one PUT (S3 replaces an object whole). The
  client comes from boto3's standard configuration (credentials, region, `AWS_ENDPOINT_URL`), like the
  S3 adapter source's.

`put` blocks: the exporter calls it on a thread of its own.
"""

from __future__ import annotations

import os
import uuid
from pathlib import Path
from typing import Any

from lora_cluster.errors import ConfigError
from lora_cluster.s3_client import LazyS3Client


class FolderTarget:
    """Files under a folder (module docstring)."""

    def __init__(self, root: Path):
        self.root = root
        self.where = str(root)

    def put(self, key: str, data: bytes) -> None:
        path = self.root / key
        path.parent.mkdir(parents=True, exist_ok=True)
        temp = path.with_name(f".{path.name}.tmp-{uuid.uuid4().hex[:8]}")
        try:
            with open(temp, "wb") as out:
                out.write(data)
                out.flush()
                os.fsync(out.fileno())
            os.replace(temp, path)
        finally:
            temp.unlink(missing_ok=True)


class S3Target:
    """Objects under a bucket's prefix (module docstring)."""

    def __init__(self, bucket: str, prefix: str, client: Any = None):
        self.bucket, self.prefix = bucket, prefix.strip("/")
        self.where = f"s3://{bucket}/{self.prefix}"
        self._s3 = LazyS3Client(client, connect_timeout_s=10, read_timeout_s=30)

    @property
    def client(self) -> Any:
        return self._s3.get()

    def put(self, key: str, data: bytes) -> None:
        full = "/".join(p for p in (self.prefix, key) if p)
        self.client.put_object(Bucket=self.bucket, Key=full, Body=data,
                               ContentType="application/vnd.apache.parquet")


def open_export_target(uri: str) -> FolderTarget | S3Target:
    """The target `usage_export_uri` names; ConfigError for a URI that is neither a folder nor s3://."""
    if uri.startswith("s3://"):
        bucket, _, prefix = uri.removeprefix("s3://").partition("/")
        if not bucket:
            raise ConfigError(f"usage_export_uri {uri!r}: expected s3://bucket[/prefix]")
        return S3Target(bucket, prefix)
    if not uri or ("://" in uri and not uri.startswith("file://")):
        raise ConfigError(f"usage_export_uri {uri!r}: use a folder, file:// or s3://bucket[/prefix]")
    return FolderTarget(Path(uri.removeprefix("file://")).expanduser())


__all__ = ["FolderTarget", "S3Target", "open_export_target"]
