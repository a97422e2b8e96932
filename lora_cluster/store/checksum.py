"""The sha256 convention for adapter files, and the helpers that read, write and check it.

An adapter may declare the sha256 of its files in any of these ways; every declared digest must
match the bytes, or the adapter is refused with `AdapterIntegrityError`:

1. `checksums.sha256` in the adapter folder (or S3 prefix), in `sha256sum` format, one line per
   file: `<64 hex digits>  <file name>` (written by `lora-cluster encrypt`, or by
   `sha256sum adapter_config.json adapter_model.safetensors > checksums.sha256`).
2. A sidecar `<file>.sha256` next to a file, whose first word is the hex digest.
3. S3 user metadata `sha256` on the object (`x-amz-meta-sha256`, e.g. `aws s3 cp --metadata sha256=...`).
4. Hugging Face hub: LFS files are stored in the hub cache under their sha256 (`blobs/<sha256>`).

Digests cover the stored bytes (for an encrypted adapter: the `.enc` file). Files nobody declares a
digest for are not checked, unless `require_checksum` asks that the weights file be covered.
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Iterable
from pathlib import Path

from lora_cluster.adapter_format import read_adapter_file
from lora_cluster.errors import AdapterIntegrityError

CHECKSUMS_FILE = "checksums.sha256"
SIDECAR_SUFFIX = ".sha256"
S3_METADATA_KEY = "sha256"
_HEX64 = re.compile(r"[0-9a-f]{64}")
_LINE = re.compile(r"([0-9a-fA-F]{64})\s+\*?(\S.*)")


def sha256_bytes(data: bytes | memoryview) -> str:
    return hashlib.sha256(data).hexdigest()


def sha256_file(path: Path, chunk: int = 1 << 20) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()


def is_sha256(value: str | None) -> bool:
    return value is not None and _HEX64.fullmatch(value.lower()) is not None


def parse_checksums(adapter_id: str, text: str) -> dict[str, str]:
    """Parse `checksums.sha256` text into {file name: hex digest}."""
    digests: dict[str, str] = {}
    for number, line in enumerate(text.splitlines(), 1):
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        match = _LINE.fullmatch(line)
        if match is None:
            raise AdapterIntegrityError(adapter_id,
                                        f"{CHECKSUMS_FILE} line {number} is not '<sha256>  <file>'")
        digests[match[2].strip()] = match[1].lower()
    return digests


def parse_sidecar(adapter_id: str, name: str, text: str) -> str:
    word = (text.split() or [""])[0].lower()
    if not is_sha256(word):
        raise AdapterIntegrityError(adapter_id, f"{name}{SIDECAR_SUFFIX} does not hold a sha256 hex digest")
    return word


def format_checksums(digests: dict[str, str]) -> str:
    return "".join(f"{digests[name]}  {name}\n" for name in sorted(digests))


def declared_digests(adapter_id: str, folder: Path, names: Iterable[str]) -> dict[str, str]:
    """Digests declared inside `folder` (checksums file and sidecars) for the given file names. An
    unreadable declaration is AdapterLoadError (`adapter_format.read_adapter_file`), never ignored."""
    declared: dict[str, str] = {}
    if (folder / CHECKSUMS_FILE).is_file():
        text = read_adapter_file(adapter_id, folder, CHECKSUMS_FILE).decode(errors="replace")
        declared.update(parse_checksums(adapter_id, text))
    for name in names:
        sidecar = name + SIDECAR_SUFFIX
        if (folder / sidecar).is_file():
            text = read_adapter_file(adapter_id, folder, sidecar).decode(errors="replace")
            digest = parse_sidecar(adapter_id, name, text)
            if declared.setdefault(name, digest) != digest:
                raise AdapterIntegrityError(
                    adapter_id, f"{CHECKSUMS_FILE} and {name}{SIDECAR_SUFFIX} declare different sha256")
    return declared


def verify(adapter_id: str, name: str, actual: str, *expected: str | None) -> None:
    """Raise AdapterIntegrityError unless every declared digest of `name` equals `actual`."""
    for digest in expected:
        if digest is not None and digest.lower() != actual:
            raise AdapterIntegrityError(
                adapter_id, f"sha256 mismatch for {name}: expected {digest.lower()[:16]}…, got {actual[:16]}…"
                " (corrupt or tampered file)")


def write_checksums(folder: Path, names: Iterable[str]) -> dict[str, str]:
    """Write `checksums.sha256` covering `names` in `folder`; returns the digests."""
    digests = {name: sha256_file(folder / name) for name in names}
    (folder / CHECKSUMS_FILE).write_text(format_checksums(digests))
    return digests
