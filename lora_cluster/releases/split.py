"""Which version a request for a bare adapter name gets: the alias, resolved by the release policy.

`name@N` always answers with version N. The bare `name` is an alias (`releases.book` says what it
means outside a release); during a canary step it is the candidate for `percent`% of the traffic and
the stable version for the rest.

Sticky: the split is decided by a bucket in [0, 10000) hashed from the release's id and the end user
(the OpenAI `user` field), so one user sees one version for the whole release: a user in the
candidate's share at 5% stays in it at 25% (the shares only grow, and a bucket below 500 is below
2500). A request with no user is bucketed by a random key (no stickiness to keep). Hashing is
blake2b: stable across processes and ingress replicas.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

BUCKETS = 10_000
VERSION_HEADER = "x-lora-adapter-version"  # response: the version of the adapter that answered


def bucket(release_id: str, user: str) -> int:
    """The user's bucket in [0, BUCKETS) for one release (stable, independent across releases)."""
    digest = hashlib.blake2b(f"{release_id}\0{user}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big") % BUCKETS


def takes_candidate(percent: float, user_bucket: int) -> bool:
    """Whether a bucket is within the candidate's share of `percent`% (100: every bucket)."""
    return user_bucket < round(percent * BUCKETS / 100)


@dataclass(frozen=True)
class Alias:
    """What a bare name resolves to now: the stable version, and during a canary the candidate with
    its share (percent) under the release `release_id`."""

    stable: int
    candidate: int | None = None
    percent: float = 0.0
    release_id: str = ""

    def resolve(self, user: str) -> int:
        """The version number the bare name means for `user` (module docstring)."""
        if self.candidate is None or self.percent <= 0:
            return self.stable
        return self.candidate if takes_candidate(self.percent, bucket(self.release_id, user)) else self.stable
