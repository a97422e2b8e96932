"""The S3 client of every S3 path of the package (adapter sources, release state, usage export).

Each owner holds one `LazyS3Client`: the boto3 client is built on the first `get`, from boto3's
standard configuration (the credential chain, the region, `AWS_ENDPOINT_URL` for an S3-compatible
server), in its own session (boto3 clients are thread-safe, sessions are not), with the owner's
connect and read timeouts and the `lora-cluster` user agent. boto3 is imported only then, so the
pure layers load without it. A client given at construction (tests, a caller's own) is used as is.
"""

from __future__ import annotations

import threading
from typing import Any


class LazyS3Client:
    """One boto3 S3 client, built once on first use (see the module docstring); thread-safe."""

    def __init__(self, client: Any = None, *, connect_timeout_s: float = 10.0, read_timeout_s: float = 10.0):
        self._client = client
        self._timeouts = (connect_timeout_s, read_timeout_s)
        self._lock = threading.Lock()

    def get(self) -> Any:
        """The client (built now if it was not yet)."""
        with self._lock:
            if self._client is None:
                import boto3
                from botocore.config import Config

                connect, read = self._timeouts
                config = Config(connect_timeout=connect, read_timeout=read, user_agent_extra="lora-cluster")
                self._client = boto3.session.Session().client("s3", config=config)
            return self._client


__all__ = ["LazyS3Client"]
