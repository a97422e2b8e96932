"""The int8 stored form: an int8 host copy (`quant`) as files, for the cluster tier and the disk tier.

With `host_int8` a node keeps adapters in host memory as int8, so that is what it publishes to the
cluster tier (a quarter of the float bytes, counted against the tier's budget as such), and what a
receiving node keeps on disk and puts into its host tier as it is: never re-quantized from full
precision, which it never had. The form is two files:

* `adapter_config.json`, the source's bytes (the receiver runs the same config, base-model and rank
  checks on it as `admission.admit_folder`);
* `adapter_model.int8.safetensors`: per (layer, module) the int8 rows of A and B and their float32
  scales, DoRA magnitudes in float32, the per-module scaling in the metadata. It is encrypted
  (AES-256-GCM, `crypto`, as `adapter_model.int8.safetensors.enc`) when the adapter's weights were
  encrypted at rest or `require_encryption` is set: decrypted weights never leave a node in clear.

`encode` writes the form; `admit_int8_folder` validates a folder holding it (the disk cache's recorded
digests, decryption, then every tensor against the served model: the module and layer exist, the
shapes fit, rank <= `max_lora_rank`, int8 rows with one finite scale each, finite scaling) and
returns the `Int8LoraWeights`, or raises an `AdapterError` naming the adapter and the fault.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import torch
from safetensors.torch import save as save_safetensors

from lora_cluster.adapter_experts import expert_unit
from lora_cluster.adapter_format import (
    CONFIG_FILE,
    ModelShapes,
    check_rank,
    folder_files,
    parse_adapter_config,
    parse_safetensors_bytes,
)
from lora_cluster.errors import AdapterFormatError, AdapterIntegrityError, AdapterRankError, AdapterShapeError
from lora_cluster.store.admission import AdmissionPolicy, check_base_model, read_verified
from lora_cluster.store.crypto import ENC_SUFFIX, decrypt_bytes, encrypt_bytes
from lora_cluster.store.quant import Int8LoraWeights, QTensor

INT8_FILE = "adapter_model.int8.safetensors"
INT8_ENC_FILE = INT8_FILE + ENC_SUFFIX
FORMAT = "lora-cluster-int8/1"


def holds_int8_form(folder: Path) -> bool:
    """Whether `folder` holds the int8 form (its weights file) rather than the source's files."""
    return (folder / INT8_FILE).is_file() or (folder / INT8_ENC_FILE).is_file()


def encode(copy: Int8LoraWeights, config_bytes: bytes, key: bytes | None) -> dict[str, bytes]:
    """The form's files of `copy`: encrypted with `key` when one is given (see the module docstring)."""
    tensors: dict[str, torch.Tensor] = {}
    for side, table in (("a", copy.a), ("b", copy.b)):
        for (layer, module), qt in table.items():
            tensors[f"{side}|{layer}|{module}|q"] = qt.q.contiguous()
            tensors[f"{side}|{layer}|{module}|scale"] = qt.scale.contiguous()
    for (layer, module), t in copy.magnitude.items():
        tensors[f"m|{layer}|{module}"] = t.float().contiguous()
    data = save_safetensors(tensors, metadata={"format": FORMAT, "scaling": json.dumps(copy.scaling)})
    if key is None:
        return {CONFIG_FILE: config_bytes, INT8_FILE: data}
    return {CONFIG_FILE: config_bytes, INT8_ENC_FILE: encrypt_bytes(key, data, INT8_FILE)}


def admit_int8_folder(adapter_id: str, folder: Path, policy: AdmissionPolicy,
                      known_digests: dict[str, str]) -> Int8LoraWeights:
    """Validate the int8 form in `folder` (see the module docstring); `known_digests`: the disk cache's."""
    names = folder_files(adapter_id, folder)
    encrypted = INT8_ENC_FILE in names
    if policy.require_encryption and not encrypted:
        raise AdapterIntegrityError(adapter_id, f"require_encryption is set but there is no {INT8_ENC_FILE}")
    weights_file = INT8_ENC_FILE if encrypted else INT8_FILE
    config = parse_adapter_config(adapter_id, read_verified(adapter_id, folder, CONFIG_FILE,
                                                             known_digests.get(CONFIG_FILE)))
    check_base_model(adapter_id, config, policy)
    check_rank(adapter_id, config, policy.max_rank)
    data = read_verified(adapter_id, folder, weights_file, known_digests.get(weights_file))
    if encrypted:
        data = decrypt_bytes(adapter_id, policy.key, data, INT8_FILE)
    return _decode(adapter_id, data, policy.shapes, policy.max_rank)


def _decode(adapter_id: str, data: bytes, shapes: ModelShapes, max_rank: int) -> Int8LoraWeights:
    try:
        metadata = json.loads(_metadata(data).get("scaling", "null"))
    except ValueError as e:
        raise AdapterFormatError(adapter_id, f"{INT8_FILE} has unreadable metadata") from e
    tensors = parse_safetensors_bytes(adapter_id, data)
    a: dict[tuple[int, str], QTensor] = {}
    b: dict[tuple[int, str], QTensor] = {}
    magnitude: dict[tuple[int, str], torch.Tensor] = {}
    for name, tensor in tensors.items():
        parts = name.split("|")
        if parts[0] == "m" and len(parts) == 3 and parts[1].isdigit():
            magnitude[(int(parts[1]), parts[2])] = tensor
        elif parts[0] in ("a", "b") and len(parts) == 4 and parts[1].isdigit() and parts[3] in ("q", "scale"):
            table = a if parts[0] == "a" else b
            scale = tensors.get(f"{parts[0]}|{parts[1]}|{parts[2]}|scale")
            if scale is None or f"{parts[0]}|{parts[1]}|{parts[2]}|q" not in tensors:
                raise AdapterFormatError(adapter_id, f"{INT8_FILE}: {name!r} lacks its int8 rows or scales")
            if parts[3] == "q":
                table[(int(parts[1]), parts[2])] = QTensor(tensor, scale)
        else:
            raise AdapterFormatError(adapter_id, f"{INT8_FILE} holds an unknown tensor {name!r}")
    if not isinstance(metadata, dict) or not a or a.keys() != b.keys():
        raise AdapterFormatError(adapter_id, f"{INT8_FILE} holds no complete LoRA pairs and their scaling")
    for key in a:
        _check_pair(adapter_id, key, a[key], b[key], magnitude.get(key), shapes, max_rank)
    scaling = {m: metadata.get(m) for _, m in a}
    if not all(isinstance(s, int | float) and math.isfinite(s) for s in scaling.values()):
        raise AdapterFormatError(adapter_id, f"{INT8_FILE} lacks a finite scaling for a module")
    if magnitude and magnitude.keys() != a.keys():
        raise AdapterFormatError(adapter_id, f"{INT8_FILE}: DoRA magnitudes do not pair up with A and B")
    return Int8LoraWeights(adapter_id=adapter_id, rank=max(qt.q.shape[0] for qt in a.values()),
                           target_modules=frozenset(m for _, m in a), scaling=scaling, a=a, b=b,
                           magnitude=magnitude)


def _metadata(data: bytes) -> dict[str, str]:
    """The safetensors header's `__metadata__` (the header is an 8-byte length, then JSON)."""
    try:
        size = int.from_bytes(data[:8], "little")
        header = json.loads(data[8:8 + size])
    except ValueError:
        return {}
    found = header.get("__metadata__") if isinstance(header, dict) else None
    return found if isinstance(found, dict) else {}


def _check_pair(adapter_id: str, key: tuple[int, str], qa: QTensor, qb: QTensor, mag: torch.Tensor | None,
                shapes: ModelShapes, max_rank: int) -> None:
    """One (layer, module)'s int8 A and B fit the served model (see the module docstring)."""
    layer, module = key
    unit = expert_unit(module)
    dims = shapes.expert_modules.get(unit[8:]) if unit else shapes.modules.get(module)
    if dims is None:
        raise AdapterFormatError(adapter_id, f"{INT8_FILE}: target module {module!r} is not supported")
    if layer >= shapes.num_layers:
        raise AdapterShapeError(adapter_id, f"layer {layer} >= the model's {shapes.num_layers} layers")
    in_f, out_f = dims
    for qt in (qa, qb):
        if (qt.q.dtype != torch.int8 or qt.q.dim() != 2 or qt.scale.dtype != torch.float32
                or tuple(qt.scale.shape) != (qt.q.shape[0],) or not torch.isfinite(qt.scale).all()):
            raise AdapterFormatError(adapter_id, f"layer {layer} {module}: not int8 rows with one finite "
                                     "float32 scale each")
    if qa.q.shape[1] != in_f or qb.q.shape[0] != out_f or qb.q.shape[1] != qa.q.shape[0]:
        raise AdapterShapeError(adapter_id, f"layer {layer} {module}: lora_A {tuple(qa.q.shape)} / lora_B "
                                f"{tuple(qb.q.shape)} do not fit the model's {module} (in_features={in_f}, "
                                f"out_features={out_f})")
    if qa.q.shape[0] > max_rank:
        raise AdapterRankError(adapter_id, qa.q.shape[0], max_rank)
    if mag is not None and (tuple(mag.shape) != (out_f,) or not torch.isfinite(mag).all()):
        raise AdapterFormatError(adapter_id, f"layer {layer} {module}: DoRA magnitude does not fit")
