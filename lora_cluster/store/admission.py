"""Admission: turn an adapter folder on local disk into validated host weights, or refuse it.

Checks, in order, each refusal an `AdapterError` naming the adapter and the reason:
1. `adapter_config.json` is plain LoRA (`adapter_format.read_adapter_config`);
2. its `base_model_name_or_path` names the served model (`base_model_check`: "warn" logs a mismatch,
   "strict" refuses it, "off" skips it; the names are compared by their last path component,
   case-insensitively, so a hub id and a local copy of it match);
3. rank <= `max_lora_rank`; weights are safetensors (never pickle);
4. every declared sha256 matches (`checksum` conventions and digests the source vouches for, e.g.
   hub LFS blob names), and so do the digests the disk cache recorded at download (tampering or bit
   rot in the cache); with `require_checksum` the weights must be covered by a declared one;
5. encrypted weights (`*.enc`) decrypt and authenticate (`crypto`); with `require_encryption`
   plaintext weights are refused;
6. tensor names, shapes, rank and finiteness fit the model (`adapter_format.parse_lora_tensors`).
A plaintext adapter with no digests takes the exact path of the plain folder loader.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from safetensors import SafetensorError
from safetensors.torch import load as load_safetensors

from lora_cluster.adapter_format import (
    CONFIG_FILE,
    PICKLE_FILES,
    WEIGHTS_FILE,
    LoraWeights,
    ModelShapes,
    load_peft_adapter,
    parse_lora_tensors,
    read_adapter_config,
)
from lora_cluster.errors import (
    AdapterBaseModelError,
    AdapterFormatError,
    AdapterIntegrityError,
    AdapterNotFoundError,
    AdapterRankError,
)
from lora_cluster.store.checksum import declared_digests, sha256_bytes, verify
from lora_cluster.store.crypto import ENC_WEIGHTS_FILE, decrypt_bytes

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class AdmissionPolicy:
    """What an adapter must satisfy to be served by this engine."""

    shapes: ModelShapes
    max_rank: int
    base_model: str | None = None
    base_model_check: Literal["off", "warn", "strict"] = "warn"
    key: bytes | None = None
    require_encryption: bool = False
    require_checksum: bool = False


def _model_name(name: str) -> str:
    return Path(str(name).rstrip("/")).name.lower()


def check_base_model(adapter_id: str, config: dict, policy: AdmissionPolicy) -> None:
    wanted = config.get("base_model_name_or_path")
    if policy.base_model_check == "off" or not wanted or not policy.base_model:
        return
    if _model_name(wanted) != _model_name(policy.base_model):
        message = f"was trained for base model {wanted!r}, this engine serves {policy.base_model!r}"
        if policy.base_model_check == "strict":
            raise AdapterBaseModelError(adapter_id, message)
        log.warning("adapter %r %s (shapes are checked; set base_model_check=strict to refuse)",
                    adapter_id, message)


def admit_folder(adapter_id: str, folder: Path, policy: AdmissionPolicy,
                 known_digests: dict[str, str] | None = None,
                 source_digests: dict[str, str] | None = None) -> LoraWeights:
    """Validate and load the adapter in `folder` (see the module docstring for the checks).

    `known_digests` are checked only (recorded by the disk cache); `source_digests` are declared by
    the source and also satisfy `require_checksum`."""
    folder = Path(folder)
    if not folder.is_dir():
        raise AdapterNotFoundError(adapter_id, f"no adapter folder at {folder}")
    config = read_adapter_config(adapter_id, folder)
    check_base_model(adapter_id, config, policy)
    plain, enc = (folder / WEIGHTS_FILE).is_file(), (folder / ENC_WEIGHTS_FILE).is_file()
    if policy.require_encryption and not enc:
        raise AdapterIntegrityError(adapter_id, f"require_encryption is set but there is no "
                                    f"{ENC_WEIGHTS_FILE}")
    name = ENC_WEIGHTS_FILE if enc and (policy.require_encryption or not plain) else WEIGHTS_FILE
    known = known_digests or {}
    declared = declared_digests(adapter_id, folder, [CONFIG_FILE, name])
    for file, digest in (source_digests or {}).items():
        if declared.setdefault(file, digest) != digest:
            raise AdapterIntegrityError(adapter_id, f"the source and the folder declare different sha256 "
                                        f"for {file}")
    if name == WEIGHTS_FILE and not declared and not known and not policy.require_checksum:
        return load_peft_adapter(adapter_id, folder, policy.shapes, policy.max_rank)
    if not (plain or enc):
        pickled = [p for p in PICKLE_FILES if (folder / p).exists()]
        if pickled:
            raise AdapterFormatError(
                adapter_id, f"{pickled[0]} is pickle; only {WEIGHTS_FILE} is accepted (no pickle loading)")
        raise AdapterFormatError(adapter_id, f"no {WEIGHTS_FILE} in {folder}")
    if config["r"] > policy.max_rank:
        raise AdapterRankError(adapter_id, config["r"], policy.max_rank)
    if policy.require_checksum and name not in declared:
        raise AdapterIntegrityError(adapter_id, f"require_checksum is set but no sha256 is declared for "
                                    f"{name}")
    if CONFIG_FILE in declared or CONFIG_FILE in known:
        digest = sha256_bytes((folder / CONFIG_FILE).read_bytes())
        verify(adapter_id, CONFIG_FILE, digest, declared.get(CONFIG_FILE), known.get(CONFIG_FILE))
    data = (folder / name).read_bytes()
    verify(adapter_id, name, sha256_bytes(data), declared.get(name), known.get(name))
    if name == ENC_WEIGHTS_FILE:
        data = decrypt_bytes(adapter_id, policy.key, data, WEIGHTS_FILE)
    try:
        tensors = load_safetensors(data)
    except (SafetensorError, OSError, ValueError, RuntimeError) as e:
        raise AdapterFormatError(adapter_id, f"{WEIGHTS_FILE} is corrupt: {e}") from e
    return parse_lora_tensors(adapter_id, config, tensors, policy.shapes, policy.max_rank)
