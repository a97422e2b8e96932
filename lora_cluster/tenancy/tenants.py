"""The tenants file: who may call the API, with which adapters, at which SLA class and quota.

    admin_api_keys: ["sha256:<hex>"]      # may load/unload adapters and read /v1/cluster
    tenants:
      - name: finance
        api_keys: ["sha256:<hex of the key>"]   # keys are stored hashed, never in clear
        adapters: ["fin-*", "shared-*"]         # glob patterns of adapter ids this tenant may use
        base_model: true                         # may call the base model (default true)
        priority_class: interactive              # the tenant's SLA class (default: the server's)
        requests_per_minute: 600
        tokens_per_minute: 200000                # prompt + completion tokens
        max_concurrent: 32
        budget:                                  # optional, monthly (tenancy.budget)
          tokens_per_month: 50000000
          action: refuse                         # at 100%: refuse (429) or warn

Keys are stored as `sha256:<64 hex digits>` of the key's UTF-8 bytes (`hash_key`, or
`printf %s KEY | sha256sum`). A presented key is hashed and compared with every stored digest in
constant time (`hmac.compare_digest`, no early exit), so the time taken says nothing about which
digest came close. A key belongs to one tenant or to the admins, never both. Adapter patterns are
shell globs matched case-sensitively against the whole adapter id (`fnmatch.fnmatchcase`: `*`, `?`,
`[...]`; `*` also matches `/`). Errors name the field (`tenants[1].api_keys[0]: ...`) and never
echo a key. Pure: parsing takes text, nothing here reads the clock or the network.
"""

from __future__ import annotations

import fnmatch
import hashlib
import hmac
import re
from collections.abc import Collection
from dataclasses import dataclass
from typing import Annotated

import yaml
from pydantic import AfterValidator, BaseModel, ConfigDict, Field, ValidationError, field_validator

from lora_cluster.errors import ConfigError
from lora_cluster.tenancy.budget import BudgetSpec
from lora_cluster.tenancy.quota import QuotaLimits

KEY_PREFIX = "sha256:"
MAX_TENANTS = 10_000
MAX_KEYS = 4096  # every request compares its key with all of them
MAX_PATTERNS = 256


class TenantsFileError(ConfigError):
    """The tenants file cannot be used; the message names the field (never a key)."""


def hash_key(key: str) -> str:
    """The stored form of an API key: `sha256:<hex>` of its UTF-8 bytes."""
    return KEY_PREFIX + hashlib.sha256(key.encode("utf-8")).hexdigest()


_DIGEST = r"^sha256:[0-9a-fA-F]{64}$"


def _checked_digest(key: object) -> str:
    if not isinstance(key, str) or not re.fullmatch(_DIGEST, key):
        raise ValueError("must be 'sha256:' followed by the 64 hex digits of the key's sha256 (keys are "
                         "never stored in clear)")
    return key.lower()


KeyDigest = Annotated[str, AfterValidator(_checked_digest)]


class TenantSpec(BaseModel):
    """One tenant of the tenants file."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    name: str = Field(pattern=r"^[A-Za-z0-9_.-]{1,64}$")
    api_keys: list[KeyDigest] = Field(min_length=1)
    adapters: list[str] = Field(default_factory=list, max_length=MAX_PATTERNS)
    base_model: bool = True
    priority_class: str | None = None
    requests_per_minute: int | None = Field(None, ge=1)
    tokens_per_minute: int | None = Field(None, ge=1)
    max_concurrent: int | None = Field(None, ge=1)
    budget: BudgetSpec | None = None

    @field_validator("adapters")
    @classmethod
    def _patterns(cls, patterns: list[str]) -> list[str]:
        for p in patterns:
            if not p or len(p) > 256:
                raise ValueError("an adapter pattern must have 1 to 256 characters")
        return patterns


class TenantsSpec(BaseModel):
    """The whole tenants file."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    admin_api_keys: list[KeyDigest] = Field(default_factory=list)
    tenants: list[TenantSpec] = Field(default_factory=list, max_length=MAX_TENANTS)


@dataclass(frozen=True)
class Tenant:
    """A tenant as the server uses it."""

    name: str
    adapters: tuple[str, ...]
    base_model: bool
    priority_class: str | None
    limits: QuotaLimits
    budget: BudgetSpec | None = None  # its monthly budget (tenancy.budget), if any

    def may_use(self, adapter_id: str | None) -> bool:
        """Whether this tenant may call `adapter_id` (None: the base model)."""
        if adapter_id is None:
            return self.base_model
        return any(fnmatch.fnmatchcase(adapter_id, p) for p in self.adapters)


@dataclass(frozen=True)
class Principal:
    """Who sent a request: a tenant, an admin, or anyone (no tenants file: the server is open)."""

    tenant: Tenant | None
    admin: bool

    def may_use(self, adapter_id: str | None) -> bool:
        return self.tenant is None or self.tenant.may_use(adapter_id)

    @property
    def tenant_name(self) -> str | None:
        return None if self.tenant is None else self.tenant.name


OPEN = Principal(tenant=None, admin=True)
ADMIN = Principal(tenant=None, admin=True)


class Directory:
    """The parsed tenants file: API key lookup (constant time per stored key) and the tenants."""

    def __init__(self, spec: TenantsSpec):
        self.tenants = {t.name: Tenant(
            t.name, tuple(t.adapters), t.base_model, t.priority_class,
            QuotaLimits(t.requests_per_minute, t.tokens_per_minute, t.max_concurrent), t.budget)
            for t in spec.tenants}
        entries = [(k, ADMIN) for k in spec.admin_api_keys]
        for t in spec.tenants:
            entries += [(k, Principal(self.tenants[t.name], admin=False)) for k in t.api_keys]
        self._keys = [(bytes.fromhex(k.removeprefix(KEY_PREFIX)), p) for k, p in entries]

    def lookup(self, key: str) -> Principal | None:
        """The principal holding `key`, or None. Compares with every stored digest (no early exit)."""
        presented = hashlib.sha256(key.encode("utf-8", "surrogatepass")).digest()
        found = None
        for digest, principal in self._keys:
            if hmac.compare_digest(presented, digest):
                found = principal
        return found


def _where(loc: tuple) -> str:
    out = ""
    for part in loc:
        out += f"[{part}]" if isinstance(part, int) else (f".{part}" if out else str(part))
    return out or "file"


def parse_tenants(text: str, sla_classes: Collection[str] | None = None) -> Directory:
    """Parse and validate a tenants file's text; TenantsFileError naming the field otherwise.
    `sla_classes`, when given, are the class names a tenant's `priority_class` may name."""
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f" at line {mark.line + 1}" if mark is not None else ""
        raise TenantsFileError(f"tenants file: not valid YAML{where}") from None
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise TenantsFileError("tenants file: must be a mapping with admin_api_keys and tenants")
    try:
        spec = TenantsSpec.model_validate(data)
    except ValidationError as exc:  # its str() would echo the input (keys): name fields only
        parts = [f"{_where(err['loc'])}: {err['msg'].removeprefix('Value error, ')}"
                 for err in exc.errors()[:5]]
        raise TenantsFileError("tenants file: " + "; ".join(parts)) from None
    _check_unique(spec, sla_classes)
    return Directory(spec)


def _check_unique(spec: TenantsSpec, sla_classes: Collection[str] | None) -> None:
    names: set[str] = set()
    owner: dict[str, str] = {k: "admin_api_keys" for k in spec.admin_api_keys}
    if len(owner) != len(spec.admin_api_keys):
        raise TenantsFileError("tenants file: admin_api_keys lists a key twice")
    for i, t in enumerate(spec.tenants):
        if t.name in names:
            raise TenantsFileError(f"tenants file: tenants[{i}].name: {t.name!r} is used by another tenant")
        names.add(t.name)
        for j, k in enumerate(t.api_keys):
            if k in owner:
                raise TenantsFileError(f"tenants file: tenants[{i}].api_keys[{j}]: the same key is also "
                                       f"in {owner[k]} (a key belongs to one tenant or to the admins)")
            owner[k] = f"tenants[{i}].api_keys"
        if sla_classes is not None and t.priority_class is not None and t.priority_class not in sla_classes:
            raise TenantsFileError(f"tenants file: tenants[{i}].priority_class: {t.priority_class!r} is not "
                                   f"one of the SLA classes ({', '.join(sla_classes)})")
    if len(owner) > MAX_KEYS:
        raise TenantsFileError(f"tenants file: {len(owner)} keys; at most {MAX_KEYS} are allowed")
