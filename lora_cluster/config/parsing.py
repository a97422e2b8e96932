"""How configuration values are read: environment overrides, list and byte-size strings, and errors.

Every field of a config is overridable by the environment variable `LORA_CLUSTER_<FIELD>` (upper
case). Explicit arguments (Python keyword arguments, serve_config.yaml application args) win over
the environment, which wins over the defaults. List fields take a comma-separated string there;
dict and list-of-object fields take JSON.

Byte sizes accept an integer or a number with a unit: SI units are powers of 1000 (`k`/`kB`, `M`/`MB`,
`G`/`GB`, `T`/`TB`), IEC units powers of 1024 (`KiB`, `MiB`, `GiB`, `TiB`, or Kubernetes' `Ki`,
`Mi`, `Gi`, `Ti`); case, spaces and `_` are ignored. So `4GiB` is 4 x 2**30 bytes and `4G` is
4 x 10**9 bytes.
"""

from __future__ import annotations

from typing import Annotated, TypeVar

from pydantic import BeforeValidator, ConfigDict, ValidationError
from pydantic_settings import BaseSettings, NoDecode, SettingsConfigDict

from lora_cluster.errors import ConfigError

ENV_PREFIX = "LORA_CLUSTER_"
SETTINGS = SettingsConfigDict(env_prefix=ENV_PREFIX, extra="forbid", validate_default=True)
SECTION = ConfigDict(extra="forbid", frozen=True, validate_default=True)
"""A section of `ServeConfig` (config.flat_aliases reads its fields' variables)."""

SI_UNITS = {"k": 1000, "m": 1000**2, "g": 1000**3, "t": 1000**4}
IEC_UNITS = {"ki": 1 << 10, "mi": 1 << 20, "gi": 1 << 30, "ti": 1 << 40}
_BYTE_UNITS = {"": 1, "b": 1, **SI_UNITS, **{u + "b": n for u, n in SI_UNITS.items()},
               **IEC_UNITS, **{u + "b": n for u, n in IEC_UNITS.items()}}
_IEC_NAMES = (("TiB", 1 << 40), ("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10))
_SI_NAMES = (("TB", 1000**4), ("GB", 1000**3), ("MB", 1000**2), ("kB", 1000))


def env_var(field: str) -> str:
    """The environment variable that overrides `field`."""
    return f"{ENV_PREFIX}{field.upper()}"


def split_list(value: object) -> object:
    """Accept `"a,b"` as well as `["a", "b"]` for list fields; None is the empty list."""
    if value is None:
        return []
    if isinstance(value, str):
        return [part.strip() for part in value.split(",") if part.strip()]
    return value


def parse_bytes(value: object) -> object:
    """`"4GiB"`, `"500MB"`, `"1024"` as bytes (units: see the module docstring); integers unchanged.
    Anything else is returned as it is, for pydantic to report against the field."""
    if not isinstance(value, str):
        return value
    text = value.strip().lower().replace("_", "").replace(" ", "")
    number = text.rstrip("kmgtib")
    unit = text[len(number) :]
    try:
        return int(float(number) * _BYTE_UNITS[unit])
    except (ValueError, KeyError):
        return value


def format_bytes(size: int) -> str:
    """`size` in the largest unit that divides it exactly, IEC first (`4GiB`, `500MB`, `1000`)."""
    for name, unit in (*_IEC_NAMES, *_SI_NAMES):
        if size and size % unit == 0:
            return f"{size // unit}{name}"
    return str(size)


StrList = Annotated[list[str], NoDecode, BeforeValidator(split_list)]
"""A list of strings; a comma-separated string in the environment."""

ByteSize = Annotated[int, BeforeValidator(parse_bytes)]
"""A number of bytes; accepts the units of the module docstring."""


def is_byte_size(metadata: list[object]) -> bool:
    """Whether a field with this pydantic metadata is a `ByteSize`."""
    return any(isinstance(m, BeforeValidator) and m.func is parse_bytes for m in metadata)


Config = TypeVar("Config", bound=BaseSettings)


def build_config(cls: type[Config], **kwargs: object) -> Config:
    """Build a config, turning pydantic's validation error into a `ConfigError` naming the fields."""
    try:
        return cls(**kwargs)
    except (ValidationError, ValueError) as e:
        raise ConfigError(f"invalid {cls.__name__}: {e}") from e
