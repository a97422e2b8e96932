"""The flat names of a config in sections: every field of a section (`engine`, `router`, `admission`,
`controller`, `api`, `tenancy`, `metrics`) keeps the flat name it had before the config came in
sections, as a keyword argument or serve_config.yaml key and as the variable `LORA_CLUSTER_<FIELD>`.

Policy: `nest` moves a flat key into its section before validation; a flat key wins over the same
field given inside its section (both explicit: the flat one is the later, more specific spelling).
`FlatEnvSource` reads every top-level field and every section field from its flat variable and
returns them nested, so that explicit arguments (nested or flat) win over the environment, which
wins over the defaults. A variable of a list, dict or object field is JSON, except a `StrList`
(comma-separated). Invariant: flat names are unique across the sections (checked when built).
"""

from __future__ import annotations

import json
import os
import types
from collections.abc import Mapping
from typing import Any, Union, get_args, get_origin

from pydantic import BaseModel
from pydantic.fields import FieldInfo
from pydantic_settings import BaseSettings, NoDecode, PydanticBaseSettingsSource

from lora_cluster.config.parsing import env_var

RENAMED = {"controller": "enabled"}  # flat name -> its field in the section, where they differ


class FlatNames:
    """Which section holds each flat name: `{flat name: (section, field)}`, from the sections'
    fields (`RENAMED` for the few whose field is named otherwise in the section)."""

    def __init__(self, sections: Mapping[str, type[BaseModel]], excluded: frozenset[str] = frozenset()):
        self.sections = dict(sections)
        self.where: dict[str, tuple[str, str]] = {}
        for section, model in self.sections.items():
            renamed = {field: flat for flat, field in RENAMED.items()}
            for field in model.model_fields:
                flat = renamed.get(field, field)
                if flat in excluded:
                    continue
                if flat in self.where:
                    raise TypeError(f"config field {flat!r} is in sections {self.where[flat][0]!r} and "
                                    f"{section!r}: flat names must be unique")
                self.where[flat] = (section, field)

    def field(self, flat: str) -> FieldInfo:
        """The section field a flat name stands for (KeyError: not a section field's flat name)."""
        section, field = self.where[flat]
        return self.sections[section].model_fields[field]

    def nest(self, data: Mapping[str, Any]) -> dict[str, Any]:
        """`data` with each flat key moved into its section (a flat key wins over the section's)."""
        out: dict[str, Any] = {}
        moved: dict[str, dict[str, Any]] = {}
        for key, value in data.items():
            if key in self.where and not (key in self.sections and isinstance(value, Mapping)):
                section, field = self.where[key]
                moved.setdefault(section, {})[field] = value
            else:
                out[key] = value
        for section, fields in moved.items():
            given = out.get(section)
            base = dict(given) if isinstance(given, Mapping) else {}
            out[section] = {**base, **fields}
        return out


def _is_complex(info: FieldInfo) -> bool:
    """Whether a variable of this field is JSON (a list, dict or object, not a `StrList`)."""
    if NoDecode in info.metadata:
        return False
    annotation = info.annotation
    union = get_origin(annotation) in (Union, types.UnionType)
    for arg in get_args(annotation) if union else (annotation,):
        if get_origin(arg) in (list, dict, tuple, set) or arg in (list, dict, tuple, set):
            return True
        if isinstance(arg, type) and issubclass(arg, BaseModel):
            return True
    return False


def _read(name: str, info: FieldInfo) -> Any:
    """The value of `name`'s variable, decoded as its field takes it; raises naming the variable."""
    raw = os.environ[env_var(name)]
    if not _is_complex(info):
        return raw
    try:
        return json.loads(raw)
    except json.JSONDecodeError as e:
        raise ValueError(f"{env_var(name)} is not JSON ({e.msg}); the field {name!r} takes a JSON "
                         "value") from e


class FlatEnvSource(PydanticBaseSettingsSource):
    """`LORA_CLUSTER_<FIELD>` for every top-level field (not the sections themselves) and every
    section field of `names`, returned nested by section."""

    def __init__(self, settings_cls: type[BaseSettings], names: FlatNames):
        super().__init__(settings_cls)
        self.names = names

    def get_field_value(self, field: FieldInfo, field_name: str) -> tuple[Any, str, bool]:
        present = env_var(field_name) in os.environ
        return (_read(field_name, field) if present else None), field_name, False

    def __call__(self) -> dict[str, Any]:
        environ = os.environ
        out: dict[str, Any] = {}
        for name, info in self.settings_cls.model_fields.items():
            if name not in self.names.sections and env_var(name) in environ:
                out[name] = _read(name, info)
        for flat, (section, field) in self.names.where.items():
            if env_var(flat) in environ:
                out.setdefault(section, {})[field] = _read(flat, self.names.field(flat))
        return out
