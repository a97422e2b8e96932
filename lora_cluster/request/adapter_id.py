"""Adapter ids: the names a request may give an adapter, checked before anything looks one up.

An id names a sub-folder of a source or a key prefix in a bucket, so it is refused when it could
escape one: letters, digits and `._-` in `/`-separated segments, each starting with a letter or digit
(no `..` segment, no absolute path, no odd bytes), at most `MAX_ADAPTER_ID_LEN` characters, with an
optional version suffix `@N` (a positive number: `fin@2`, one version of `fin`, `releases.refs`). The HTTP
API's JSON Schema states the same pattern (`ADAPTER_ID_PATTERN`).
"""

from __future__ import annotations

import re

from lora_cluster.errors import AdapterIdError

# adapter ids, as the HTTP API's JSON Schema states them (anchored): no segment can be `..`
# an adapter's name (what a load registers: no version), and an id (a name, or one version `name@N`)
ADAPTER_NAME_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9._\-]*(/[A-Za-z0-9][A-Za-z0-9._\-]*)*$"
ADAPTER_ID_PATTERN = ADAPTER_NAME_PATTERN.removesuffix("$") + r"(@[1-9][0-9]{0,8})?$"
_ADAPTER_ID = re.compile(ADAPTER_ID_PATTERN.strip("^$"))
MAX_ADAPTER_ID_LEN = 256


def check_adapter_id(adapter_id: str) -> str:
    """Adapter ids name sub-folders or key prefixes: no traversal, no absolute paths, no odd bytes,
    at most `MAX_ADAPTER_ID_LEN` characters. Raises AdapterNotFoundError (the id cannot exist)."""
    if (
        not isinstance(adapter_id, str)
        or len(adapter_id) > MAX_ADAPTER_ID_LEN
        or not _ADAPTER_ID.fullmatch(adapter_id)
        or (".." in adapter_id.split("/"))
    ):
        raise AdapterIdError(
            str(adapter_id)[:MAX_ADAPTER_ID_LEN],
            "invalid adapter id (letters, digits, '._-/' only, and an optional @N version)",
        )
    return adapter_id
