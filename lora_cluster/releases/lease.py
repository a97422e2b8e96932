"""The lease of a release's eval gate: which ingress runs the gate of a release still `evaluating`,
and until when, kept in the shared release state so that no release is left evaluating for ever
when that ingress dies.

Policy (`ReleaseBook.hold`, every ingress's sync): the owner renews the lease of each gate it still
runs to `now + lease_s`; a lease past its expiry (its owner died, or could not write the state for
`lease_s`) is taken by the next ingress that syncs, which runs the gate again from the start (the
candidate's load if it is missing, then the evaluation set). A verdict is written only by the
lease's current owner (`ReleaseBook.settle_eval`): a former owner that comes back late drops its
own. Times are the injected wall clock's (the lease is read by other processes).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any


@dataclass(frozen=True)
class Lease:
    """Ingress `owner` runs the release's eval gate until `expires_at` (wall-clock seconds) unless
    it renews the lease first."""

    owner: str
    expires_at: float

    def expired(self, now: float) -> bool:
        return now >= self.expires_at

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any] | None) -> Lease | None:
        return None if d is None else cls(str(d["owner"]), float(d["expires_at"]))
