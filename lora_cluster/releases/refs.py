"""Version references: `name@N` addresses version N of an adapter name, the bare `name` its alias.

Numbers start at 1 and only grow per name (the loads give them, `serve.http.adapter_versions`); the
alias is resolved by the release policy (`releases.book`: with no release, the latest version).
"""

from __future__ import annotations

import re

VERSION_SEP = "@"
_REF = re.compile(r"^(?P<name>.+)@(?P<number>[1-9][0-9]{0,8})$")


def parse_ref(ref: str) -> tuple[str, int | None]:
    """`"fin@2"` -> `("fin", 2)`; a bare `"fin"` -> `("fin", None)` (the alias). A `@` not followed by
    a positive version number is left in the name (the adapter-id check refuses it later)."""
    match = _REF.fullmatch(ref)
    if match is None:
        return ref, None
    return match["name"], int(match["number"])


def version_ref(name: str, number: int) -> str:
    """The `name@N` that addresses one version."""
    return f"{name}{VERSION_SEP}{number}"
