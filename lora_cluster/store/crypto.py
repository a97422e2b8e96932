"""AES-256-GCM encryption of adapter weights at rest.

Format of an encrypted file `adapter_model.safetensors.enc`:

    b"LCAESGCM" (8 bytes) | version 0x01 (1 byte) | nonce (12 bytes) | ciphertext || GCM tag (16 bytes)

The associated data is `b"lora-cluster:" + <plaintext file name>`, so a file cannot be swapped for
another file of the adapter. `adapter_config.json` stays in clear text (listing reads rank and
target modules without the key); only the weights are encrypted. The bytes stay encrypted in the
source and in the disk cache and are decrypted in memory by the loader thread. A wrong key or any
flipped bit fails the GCM tag check: the adapter is refused with `AdapterIntegrityError`.

The key is 32 bytes, given as 64 hex digits, as base64, or as 32 raw bytes, from an environment
variable (default `LORA_CLUSTER_ADAPTER_KEY`) or a mounted secret file (`encryption_key_file`).
"""

from __future__ import annotations

import base64
import binascii
import os
import shutil
from pathlib import Path

from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives.ciphers.aead import AESGCM

from lora_cluster.adapter_format import CONFIG_FILE, WEIGHTS_FILE
from lora_cluster.errors import AdapterFormatError, AdapterIntegrityError, ConfigError
from lora_cluster.store.checksum import write_checksums

MAGIC, VERSION = b"LCAESGCM", 1
ENC_SUFFIX = ".enc"
ENC_WEIGHTS_FILE = WEIGHTS_FILE + ENC_SUFFIX
_HEADER = len(MAGIC) + 1
_NONCE = 12


def parse_key(raw: bytes | str, where: str) -> bytes:
    """A 32-byte key from hex, base64 or raw bytes; ConfigError naming `where` otherwise."""
    data = raw.encode() if isinstance(raw, str) else raw
    text = data.strip()
    decoders = (binascii.unhexlify, lambda t: base64.b64decode(t, validate=True), base64.urlsafe_b64decode)
    for decode in decoders:  # a 32-byte value never decodes to 32 bytes as hex or base64
        try:
            key = decode(text)
        except (binascii.Error, ValueError):
            continue
        if len(key) == 32:
            return key
    if len(data) == 32:
        return data
    raise ConfigError(f"encryption key from {where} is not 32 bytes (64 hex digits, base64 or raw)")


def load_key(env_name: str | None, key_file: str | None) -> bytes | None:
    """The configured key: the secret file wins over the environment variable; None if neither."""
    if key_file:
        path = Path(key_file).expanduser()
        try:
            return parse_key(path.read_bytes(), f"file {path}")
        except OSError as e:
            raise ConfigError(f"cannot read encryption key file {path}: {e}") from e
    if env_name and os.environ.get(env_name):
        return parse_key(os.environ[env_name], f"${env_name}")
    return None


def generate_key_file(path: Path) -> bytes:
    """Write a new random key (hex) to `path` with mode 0600; refuses to overwrite."""
    key = AESGCM.generate_key(bit_length=256)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(key.hex() + "\n")
    return key


def _aad(name: str) -> bytes:
    return b"lora-cluster:" + name.encode()


def encrypt_bytes(key: bytes, data: bytes, name: str) -> bytes:
    """Encrypt the content of the plaintext file `name`."""
    nonce = os.urandom(_NONCE)
    return MAGIC + bytes([VERSION]) + nonce + AESGCM(key).encrypt(nonce, data, _aad(name))


def is_encrypted(blob: bytes | memoryview) -> bool:
    return bytes(blob[: len(MAGIC)]) == MAGIC


def decrypt_bytes(adapter_id: str, key: bytes | None, blob: bytes, name: str) -> bytes:
    """Decrypt an `.enc` file's bytes back into the plaintext file `name`."""
    if key is None:
        raise AdapterIntegrityError(
            adapter_id, f"{name}{ENC_SUFFIX} is encrypted but no key is configured "
            "(set encryption_key_file or the variable named by encryption_key_env)")
    if not is_encrypted(blob) or len(blob) < _HEADER + _NONCE + 16:
        raise AdapterIntegrityError(adapter_id, f"{name}{ENC_SUFFIX} is not a lora-cluster encrypted file")
    if blob[len(MAGIC)] != VERSION:
        raise AdapterIntegrityError(adapter_id,
                                    f"{name}{ENC_SUFFIX} has unknown format version {blob[len(MAGIC)]}")
    nonce = blob[_HEADER : _HEADER + _NONCE]
    try:
        return AESGCM(key).decrypt(nonce, blob[_HEADER + _NONCE :], _aad(name))
    except InvalidTag as e:
        raise AdapterIntegrityError(
            adapter_id, f"{name}{ENC_SUFFIX} failed authentication: wrong key or tampered file") from e


def encrypt_adapter_folder(src: Path, dst: Path, key: bytes) -> list[str]:
    """Write an encrypted copy of the PEFT adapter in `src` to `dst` (which must not exist or be
    empty): config in clear, weights encrypted, and `checksums.sha256` over both. Returns the names
    of the files written."""
    src, dst = Path(src), Path(dst)
    adapter_id = src.name
    if not (src / CONFIG_FILE).is_file() or not (src / WEIGHTS_FILE).is_file():
        raise AdapterFormatError(adapter_id, f"{src} holds no {CONFIG_FILE} and {WEIGHTS_FILE}")
    if dst.exists() and any(dst.iterdir()):
        raise FileExistsError(f"{dst} is not empty; refusing to overwrite it")
    dst.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(src / CONFIG_FILE, dst / CONFIG_FILE)
    (dst / ENC_WEIGHTS_FILE).write_bytes(encrypt_bytes(key, (src / WEIGHTS_FILE).read_bytes(), WEIGHTS_FILE))
    names = [CONFIG_FILE, ENC_WEIGHTS_FILE]
    write_checksums(dst, names)
    return [*names, "checksums.sha256"]


def encrypt_tree(src: Path, dst: Path, key: bytes) -> list[Path]:
    """Encrypt one adapter folder, or every adapter folder below `src` (kept at the same relative
    path under `dst`). Returns the adapter folders written."""
    src, dst = Path(src), Path(dst)
    if (src / CONFIG_FILE).is_file():
        encrypt_adapter_folder(src, dst, key)
        return [dst]
    written = []
    for config in sorted(src.glob(f"**/{CONFIG_FILE}")):
        out = dst / config.parent.relative_to(src)
        encrypt_adapter_folder(config.parent, out, key)
        written.append(out)
    if not written:
        raise AdapterFormatError(src.name, f"no adapter ({CONFIG_FILE}) found under {src}")
    return written
