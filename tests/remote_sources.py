"""Remote adapter sources for the tests: a TCP proxy that injects network failures, a bucket on the
moto S3 server, a hand-written Hugging Face hub cache, and a local folder posing as a remote source."""

from __future__ import annotations

import contextlib
import hashlib
import os
import socket
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest


class TcpProxy:
    """A TCP proxy in front of a server that injects network failures (and, with `rate_bytes_per_s`,
    caps each response's bandwidth, a slow link): the next `cuts` connections whose
    response passes `cut_after` bytes are closed there, or, past `die_after` bytes of a response, the
    whole proxy goes away (listener closed: later connections are refused)."""

    def __init__(self, target: tuple[str, int], rate_bytes_per_s: float | None = None):
        self.target, self.cut_after, self.cuts, self.die_after = target, 64 << 10, 0, None
        self.rate_bytes_per_s = rate_bytes_per_s  # a cap on each response's bandwidth (None: none)
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port = self.listener.getsockname()[1]
        self._sockets: list[socket.socket] = []
        self.dead = False
        self.connections = 0  # connections accepted, over restarts
        threading.Thread(target=self._accept, daemon=True).start()

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def _accept(self) -> None:
        while not self.dead:
            try:
                client, _ = self.listener.accept()
            except OSError:
                return
            self.connections += 1
            upstream = socket.create_connection(self.target)
            self._sockets += [client, upstream]
            threading.Thread(target=self._pump, args=(client, upstream, False), daemon=True).start()
            threading.Thread(target=self._pump, args=(upstream, client, True), daemon=True).start()

    def _pump(self, src: socket.socket, dst: socket.socket, response: bool) -> None:
        sent, start = 0, time.monotonic()
        try:
            while data := src.recv(16 << 10):
                dst.sendall(data)
                sent += len(data)
                if response and self.rate_bytes_per_s:  # a slow link: never ahead of the cap
                    time.sleep(max(0.0, start + sent / self.rate_bytes_per_s - time.monotonic()))
                if response and self.die_after is not None and sent >= self.die_after:
                    return self.kill()
                if response and sent >= self.cut_after and self.cuts > 0:
                    self.cuts -= 1
                    break
        except OSError:
            pass
        self._close(src, dst)

    @staticmethod
    def _close(*sockets: socket.socket) -> None:
        for s in sockets:  # shutdown first: it wakes a thread blocked in recv and sends FIN at once
            with contextlib.suppress(OSError):
                s.shutdown(socket.SHUT_RDWR)
            s.close()

    def kill(self) -> None:
        """The server goes away: every connection is reset and new ones are refused."""
        self.dead = True
        self._close(self.listener, *self._sockets)

    def restart(self) -> None:
        """The server comes back on the same port (after `kill`), with no failure armed."""
        self.die_after, self.cuts = None, 0
        self._sockets = []
        self.listener = socket.create_server(("127.0.0.1", self.port))
        self.dead = False
        threading.Thread(target=self._accept, daemon=True).start()


@dataclass
class S3:
    """A fresh bucket on the moto server; the test environment points boto3 at `endpoint`."""

    endpoint: str
    bucket: str
    client: Any
    monkeypatch: pytest.MonkeyPatch

    def upload(self, folder: Path, prefix: str, metadata: dict[str, dict[str, str]] | None = None) -> None:
        """Upload every file of `folder` under `prefix/` (per-file user metadata optional)."""
        for path in sorted(p for p in folder.rglob("*") if p.is_file()):
            name = path.relative_to(folder).as_posix()
            self.client.put_object(Bucket=self.bucket, Key=f"{prefix}/{name}", Body=path.read_bytes(),
                                   Metadata=(metadata or {}).get(name, {}))

    def put(self, key: str, body: bytes, **metadata: str) -> None:
        self.client.put_object(Bucket=self.bucket, Key=key, Body=body, Metadata=metadata)

    def get(self, key: str) -> bytes:
        return self.client.get_object(Bucket=self.bucket, Key=key)["Body"].read()

    def point_at(self, endpoint: str) -> None:
        """Send boto3 clients created from now on to `endpoint` (e.g. a `TcpProxy`)."""
        self.monkeypatch.setenv("AWS_ENDPOINT_URL", endpoint)


def populate_hf_cache(cache_dir: Path, repo_id: str, files: dict[str, bytes], revision: str = "main") -> Path:
    """Write a Hugging Face hub cache entry by hand (the hub is unreachable here), laid out as
    huggingface_hub writes it: blobs named by sha256, snapshot symlinks, refs/<revision>. Returns the
    snapshot folder."""
    repo = cache_dir / f"models--{repo_id.replace('/', '--')}"
    commit = hashlib.sha1(repr(sorted(files)).encode() + revision.encode()).hexdigest()
    (repo / "refs").mkdir(parents=True, exist_ok=True)
    (repo / "refs" / revision).write_text(commit)
    snapshot = repo / "snapshots" / commit
    for name, data in files.items():
        blob = repo / "blobs" / hashlib.sha256(data).hexdigest()
        blob.parent.mkdir(parents=True, exist_ok=True)
        blob.write_bytes(data)
        link = snapshot / name
        link.parent.mkdir(parents=True, exist_ok=True)
        link.symlink_to(os.path.relpath(blob, link.parent))
    return snapshot


class FolderAsRemote:
    """A fake remote adapter source backed by a local folder (counts fetches): exercises the disk
    tier like S3 does, without a server."""

    remote = True

    def __init__(self, folder: Path, uri: str = "fake://zoo"):
        self.folder, self.uri, self.fetches = folder, uri, 0

    def locate(self, adapter_id: str, subpath: str) -> Any:
        from lora_cluster.store.sources.base import FileInfo, Located

        folder = self.folder / subpath
        if not folder.is_dir():
            return None
        return Located(subpath, {p.name: FileInfo(p.stat().st_size) for p in folder.iterdir()})

    def fetch(self, adapter_id: str, located: Any, dest: Path) -> dict[str, str]:
        from lora_cluster.store.checksum import sha256_file

        self.fetches += 1
        for name in located.files:
            (dest / name).write_bytes((self.folder / located.subpath / name).read_bytes())
        return {name: sha256_file(dest / name) for name in located.files}

    def adapters(self) -> list:
        return []

    def adapter_ids(self) -> list:
        return []
