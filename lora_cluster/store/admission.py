"""Admission: turn an adapter folder on local disk into validated host weights, or refuse it.

The checks are `adapter_format`'s validation steps — the same ones, in the same order, that
`adapter_format.load_peft_adapter` composes for a plain folder — with the store's policy steps
(marked +) in between. Each refusal is an `AdapterError` naming the adapter and the reason (never
a path of the server's file system):
1. the folder exists (`folder_files`);
2. the weights are safetensors, never pickle (`weights_file_or_refuse`); + with `require_encryption`
   they must be the encrypted `adapter_model.safetensors.enc`, otherwise the plaintext file is
   preferred when both exist;
3. + the declared sha256 digests (`checksum` conventions in the folder, and digests the source
   vouches for, e.g. hub LFS blob names) agree with each other; with `require_checksum` the
   weights must be covered by one;
4. `adapter_config.json` is plain LoRA (`read_adapter_file` + `parse_adapter_config`); + its bytes
   match their declared digest and the digest the disk cache recorded at download before they are
   parsed;
5. + its `base_model_name_or_path` names the served model (`base_model_check`: "warn" logs a
   mismatch, "strict" refuses it, "off" skips it; names are compared by their last path component,
   case-insensitively, so a hub id and a local copy of it match);
6. rank <= `max_lora_rank` (`check_rank`);
7. + the weights' bytes match their declared and recorded digests (tampering, or bit rot in the
   disk cache); encrypted weights decrypt and authenticate (`crypto`);
8. the bytes parse (`parse_safetensors_bytes`) and the tensor names, shapes, ranks and values fit
   the model (`parse_lora_tensors`).
A plaintext adapter without digests therefore gets exactly the plain folder loader's checks (plus
the base model check), and the same error for the same fault.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from lora_cluster.adapter_format import (
    CONFIG_FILE,
    WEIGHTS_FILE,
    LoraWeights,
    ModelShapes,
    check_rank,
    folder_files,
    parse_adapter_config,
    parse_lora_tensors,
    parse_safetensors_bytes,
    read_adapter_file,
    weights_file_or_refuse,
)
from lora_cluster.errors import AdapterBaseModelError, AdapterIntegrityError
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
    """Step 5: compare the config's `base_model_name_or_path` with the served model."""
    wanted = config.get("base_model_name_or_path")
    if policy.base_model_check == "off" or not wanted or not policy.base_model:
        return
    if _model_name(wanted) != _model_name(policy.base_model):
        served = Path(str(policy.base_model).rstrip("/")).name  # a folder's name, never the server's path
        message = f"was trained for base model {wanted!r}, this engine serves {served!r}"
        if policy.base_model_check == "strict":
            raise AdapterBaseModelError(adapter_id, message)
        log.warning("adapter %r %s (shapes are checked; set base_model_check=strict to refuse)",
                    adapter_id, message)


def _weights_file(adapter_id: str, names: frozenset[str], policy: AdmissionPolicy) -> str:
    """Step 2: the weights file to read."""
    if policy.require_encryption and ENC_WEIGHTS_FILE not in names:
        raise AdapterIntegrityError(adapter_id, f"require_encryption is set but there is no "
                                    f"{ENC_WEIGHTS_FILE}")
    accepted = (ENC_WEIGHTS_FILE,) if policy.require_encryption else (WEIGHTS_FILE, ENC_WEIGHTS_FILE)
    return weights_file_or_refuse(adapter_id, names, accepted)


def _declared(adapter_id: str, folder: Path, weights: str, policy: AdmissionPolicy,
              source_digests: dict[str, str]) -> dict[str, str]:
    """Step 3: the digests declared for the config and the weights, by the folder and the source."""
    declared = declared_digests(adapter_id, folder, [CONFIG_FILE, weights])
    for file, digest in source_digests.items():
        if declared.setdefault(file, digest) != digest:
            raise AdapterIntegrityError(adapter_id, f"the source and the folder declare different sha256 "
                                        f"for {file}")
    if policy.require_checksum and weights not in declared:
        raise AdapterIntegrityError(adapter_id, f"require_checksum is set but no sha256 is declared for "
                                    f"{weights}")
    return declared


def read_verified(adapter_id: str, folder: Path, name: str, *expected: str | None) -> bytes:
    """The bytes of `name`, checked against every expected digest (hashed only when one exists)."""
    data = read_adapter_file(adapter_id, folder, name)
    if any(expected):
        verify(adapter_id, name, sha256_bytes(data), *expected)
    return data


def admit_folder(adapter_id: str, folder: Path, policy: AdmissionPolicy,
                 known_digests: dict[str, str] | None = None,
                 source_digests: dict[str, str] | None = None) -> LoraWeights:
    """Validate and load the adapter in `folder` (see the module docstring for the checks).

    `known_digests` are checked only (recorded by the disk cache); `source_digests` are declared by
    the source and also satisfy `require_checksum`."""
    folder, known = Path(folder), known_digests or {}
    weights = _weights_file(adapter_id, folder_files(adapter_id, folder), policy)
    declared = _declared(adapter_id, folder, weights, policy, source_digests or {})
    config_bytes = read_verified(adapter_id, folder, CONFIG_FILE, declared.get(CONFIG_FILE),
                                  known.get(CONFIG_FILE))
    config = parse_adapter_config(adapter_id, config_bytes)
    check_base_model(adapter_id, config, policy)
    check_rank(adapter_id, config, policy.max_rank)
    data = read_verified(adapter_id, folder, weights, declared.get(weights), known.get(weights))
    if weights == ENC_WEIGHTS_FILE:
        data = decrypt_bytes(adapter_id, policy.key, data, WEIGHTS_FILE)
    tensors = parse_safetensors_bytes(adapter_id, data)
    return parse_lora_tensors(adapter_id, config, tensors, policy.shapes, policy.max_rank)
