"""One ingress's parks to one controller shard, coalesced: at most one park call in flight, the parks
that arrive meanwhile sent together in the next call (pure; the caller sends).

Why: each call costs the controller's event loop far more than the controller's own work for a park
(docs/profile_controller.md: about 640 us against 7 us), so at 256 replicas, where every arrival
parks, one call per park is what one controller cannot keep up with (docs/scale.md, the controller
actor's loop). One call per batch costs one call's overhead for the whole batch.

Policy (`ParkBatcher`, one per ingress per shard):

* `add(key, park)`: the park waits here. With no call in flight it goes at once, alone (`add`
  returns it as the batch to send: no added latency when the ingress is idle); with one in flight it
  waits for that call's reply.
* `replied()`: the call in flight answered (or failed: the caller hands its parks their error). The
  parks that arrived meanwhile, oldest first and at most `max_batch` of them, are the next call
  (returned); none: no call is in flight. Under load a batch thus holds what arrived during one round
  trip of the previous one, so the calls per second stay near one per round trip, whatever the rate.
* `withdraw(key)`: the park's client went away, or its wait ran out, before its batch was sent: it
  leaves the batch and never reaches the controller (True). False: it was sent already (or is not
  known): the caller cancels it at the controller (`Controller.cancel`), as for a single park.

Invariants: at most one call in flight (`state` is `IN_FLIGHT` exactly while a batch taken by `add`
or `replied` has not been answered); a batch holds 1..`max_batch` parks; every park added is either
sent in exactly one batch or withdrawn, never both; the parks waiting are bounded by the ingress's
own requests in flight (each waits for its client), and the keys are the ingress's ticket ids.
"""

from __future__ import annotations

from enum import Enum
from itertools import islice
from typing import Any, Generic, TypeVar

P = TypeVar("P")


class CallState(Enum):
    IDLE = "idle"  # no park call in flight: the next park goes at once
    IN_FLIGHT = "in_flight"  # a batch awaits its reply: parks wait for it


class ParkBatcher(Generic[P]):
    """The coalesced parks of one ingress to one shard (see the module docstring)."""

    def __init__(self, max_batch: int):
        if max_batch < 1:
            raise ValueError(f"a park batch holds at least one park, got max_batch={max_batch}")
        self.max_batch = max_batch
        self.state = CallState.IDLE
        self._waiting: dict[str, P] = {}  # key -> park, in arrival order
        self.calls = 0  # batches sent
        self.sent = 0  # parks sent in them

    @property
    def waiting(self) -> int:
        """Parks waiting for the next call."""
        return len(self._waiting)

    def add(self, key: str, park: P) -> list[P]:
        """`park` (under the ingress's unique `key`) is to reach the controller: the batch to send now
        (it alone, when no call is in flight), else [] (it goes with the next call)."""
        if key in self._waiting:
            raise ValueError(f"park {key!r} is already waiting to be sent")
        self._waiting[key] = park
        return self._next() if self.state is CallState.IDLE else []

    def replied(self) -> list[P]:
        """The call in flight answered: the next batch to send now ([]: nothing waits, none in flight)."""
        if self.state is not CallState.IN_FLIGHT:
            raise RuntimeError("a park batch replied while no park call was in flight")
        self.state = CallState.IDLE
        return self._next()

    def withdraw(self, key: str) -> bool:
        """Take `key`'s park out before it is sent: True if it was waiting (the controller never sees
        it), False if it was sent already or is not known (the caller cancels it there)."""
        return self._waiting.pop(key, None) is not None

    def _next(self) -> list[P]:
        if not self._waiting:
            return []
        keys = list(islice(self._waiting, self.max_batch))
        batch = [self._waiting.pop(k) for k in keys]
        self.state = CallState.IN_FLIGHT
        self.calls += 1
        self.sent += len(batch)
        return batch


class ClaimHints:
    """What one ingress's claims (`ClusterView.claim`) changed since its previous park call to each shard,
    sent with them so that the shard touches those replicas only instead of comparing the two mappings
    (O(replicas) a park call, at every shard).

    `changed(replica_id)`: the ingress's count there changed (call it at every change). `stamp(shard,
    claims)`: the claims of the next park call to `shard` with `seq` (this call's number there), `base`
    (the previous call's) and `changed` (the replicas changed since that call's claims were taken,
    sorted). The shard uses `changed` only when the claims it holds from this ingress are those of call
    `base` (else, a call lost, a restarted shard or claims dropped there, it compares the mappings, as
    without the hint), so a lost call costs a comparison, never a replica left untouched. `changed` may
    hold a replica whose count went back to the value the shard holds: it is only looked at again.
    `ended` (replica -> granted requests that ended there since the previous call to `shard`): each
    call carries its own, so a lost call loses its ends: the view counts those seats busy until the
    replica's next report (a call that reached the shard counts them, even one whose tickets were all
    parked there already: `Controller.ended`)."""

    def __init__(self, shards: int) -> None:
        self.seqs = [0] * shards
        self._changed: list[set[str]] = [set() for _ in range(shards)]
        self._ended: list[dict[str, int]] = [{} for _ in range(shards)]

    def changed(self, replica_id: str, *, ended: bool = False) -> None:
        """The ingress's count at the replica changed; `ended`: a request the controller granted there
        ended (`ClusterView.ended`: its seat is free before the replica's next report says so)."""
        for ids in self._changed:
            ids.add(replica_id)
        if ended:
            for counts in self._ended:
                counts[replica_id] = counts.get(replica_id, 0) + 1

    def stamp(self, shard: int, claims: dict[str, Any]) -> dict[str, Any]:
        base = self.seqs[shard]
        self.seqs[shard] = base + 1
        changed = sorted(self._changed[shard])
        self._changed[shard] = set()
        ended, self._ended[shard] = self._ended[shard], {}
        return {**claims, "seq": base + 1, "base": base, "changed": changed, "ended": ended}
