"""The cluster tier's policy: which adapters are published for every node, where their copies are, and
where a node should fetch a missing adapter from (pure: no Ray, no I/O, an injected clock).

The cluster tier sits between a node's host memory and the adapter's source (S3, the hub). An adapter
that one node fetched from its source is *published once* (in the tier's stored form: int8 or
encrypted as configured, with its checksum): later fetches on other nodes copy it node to node
instead of from the source. The live edge keeps the bytes in Ray's object store; the simulator keeps
only this index.

Invariants:

* an adapter is published at most once: `claim_publication` answers True to one caller until the
  adapter is unpublished again (eviction, every copy lost);
* `bytes <= budget`: publishing evicts the least recently used published adapters that are not being
  copied right now; an adapter larger than the budget, or one that cannot fit without evicting a copy
  in progress, is not published (its fetches keep going to the source);
* every copy of a published adapter is on a live node: `node_lost` forgets the node's copies, and an
  adapter left without copies is unpublished (the next fetch goes to the source: losing a node loses
  no adapter);
* entries are keyed by adapter id but bounded by the byte budget (published) and by
  `max_source_fetches` (fetches from the source in flight, each started by the system, not a client).

`choose` compares the ways to get an adapter by their estimated seconds: from a copy on another node
(`peer_s`, times one plus the transfers that node is already serving, so that a popular adapter's
copies share the load), by waiting for a fetch from the source already in flight elsewhere (its time
left, plus a copy from there), or from the source itself (`source_s`). It prefers a copy in host
memory to one on disk only through these costs.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field
from enum import Enum


class FetchFrom(Enum):
    """Where a fetch of a missing adapter starts."""

    PEER = "peer"  # a published copy on another node, node to node
    WAIT = "wait"  # a fetch from the source already in flight on another node, then a copy from there
    SOURCE = "source"  # the adapter's source (S3, the hub)


@dataclass(frozen=True)
class FetchChoice:
    """Where to fetch from, from which node (None for the source) and the estimated seconds."""

    kind: FetchFrom
    node_id: str | None
    seconds: float


@dataclass
class Published:
    """One published adapter: its size, checksum (of the stored form) and the nodes holding a copy."""

    nbytes: int
    sha256: str
    copies: set[str] = field(default_factory=set)
    transfers: int = 0  # copies in progress from this adapter's holders


class ClusterTier:
    """The index of the cluster tier (see the module docstring)."""

    def __init__(self, budget_bytes: int, *, clock: Callable[[], float], max_source_fetches: int = 4096):
        self.budget, self.bytes = budget_bytes, 0
        self._clock = clock
        self.max_source_fetches = max_source_fetches
        self.published: OrderedDict[str, Published] = OrderedDict()  # least recently used first
        self.serving: dict[str, int] = {}  # node -> transfers it serves now
        self.in_flight: dict[str, tuple[str, float]] = {}  # adapter -> (node, expected end) from the source
        self.evicted = self.lost = 0

    # ----- queries --------------------------------------------------------------------------

    def __contains__(self, adapter_id: object) -> bool:
        return adapter_id in self.published

    def holders(self, adapter_id: str) -> frozenset[str]:
        """The live nodes holding a published copy of `adapter_id` (empty: not published)."""
        entry = self.published.get(adapter_id)
        return frozenset(entry.copies) if entry is not None else frozenset()

    def choose(self, adapter_id: str, node_id: str, *, peer_s: float, source_s: float) -> FetchChoice:
        """Where `node_id` should fetch `adapter_id` from (see the module docstring): `peer_s` is one
        copy node to node, `source_s` one fetch from the source; the cheapest estimate wins, the
        source on a tie."""
        best = FetchChoice(FetchFrom.SOURCE, None, source_s)
        entry = self.published.get(adapter_id)
        if entry is not None:
            for holder in sorted(entry.copies - {node_id}):
                seconds = peer_s * (1 + self.serving.get(holder, 0))
                if seconds < best.seconds:
                    best = FetchChoice(FetchFrom.PEER, holder, seconds)
        flight = self.in_flight.get(adapter_id)
        if flight is not None and flight[0] != node_id:
            seconds = max(0.0, flight[1] - self._clock()) + peer_s
            if seconds < best.seconds:
                best = FetchChoice(FetchFrom.WAIT, flight[0], seconds)
        return best

    # ----- commands -------------------------------------------------------------------------

    def source_fetch_started(self, adapter_id: str, node_id: str, expected_s: float) -> bool:
        """A fetch of `adapter_id` from its source started on `node_id`; False (not recorded) when one
        is already in flight or the bound on recorded fetches is reached."""
        if adapter_id in self.in_flight or len(self.in_flight) >= self.max_source_fetches:
            return False
        self.in_flight[adapter_id] = (node_id, self._clock() + expected_s)
        return True

    def source_fetch_ended(self, adapter_id: str, node_id: str) -> None:
        """The fetch recorded for `node_id` ended (done, failed or cancelled)."""
        flight = self.in_flight.get(adapter_id)
        if flight is not None and flight[0] == node_id:
            del self.in_flight[adapter_id]

    def claim_publication(self, adapter_id: str, nbytes: int) -> bool:
        """Whether the caller, which holds `adapter_id` fetched from its source, should publish it:
        True once, when it is not published and fits the budget after evictions (which this call
        makes: `evicted` counts them)."""
        if adapter_id in self.published or nbytes > self.budget:
            return False
        victims: list[str] = []
        room = self.budget - self.bytes
        for victim, entry in self.published.items():
            if room >= nbytes:
                break
            if entry.transfers == 0:
                victims.append(victim)
                room += entry.nbytes
        if room < nbytes:
            return False
        for victim in victims:
            self._unpublish(victim)
            self.evicted += 1
        return True

    def published_by(self, adapter_id: str, node_id: str, nbytes: int, sha256: str) -> None:
        """`node_id` put `adapter_id` (its stored form, `sha256`) into the tier after a successful claim;
        a second publication (two claims raced) only adds a holder."""
        if adapter_id in self.published:
            self.published[adapter_id].copies.add(node_id)
            return
        self.published[adapter_id] = Published(nbytes, sha256, {node_id})
        self.bytes += nbytes

    def copy_started(self, adapter_id: str, holder: str) -> None:
        """A copy of `adapter_id` from `holder` started (it is not evicted until it ends)."""
        entry = self.published.get(adapter_id)
        if entry is not None:
            entry.transfers += 1
            self.published.move_to_end(adapter_id)
        self.serving[holder] = self.serving.get(holder, 0) + 1

    def copy_ended(self, adapter_id: str, holder: str, node_id: str, *, ok: bool) -> None:
        """The copy from `holder` to `node_id` ended; when `ok` (checksum verified) `node_id` holds a copy."""
        entry = self.published.get(adapter_id)
        if entry is not None:
            entry.transfers = max(0, entry.transfers - 1)
            if ok:
                entry.copies.add(node_id)
        left = self.serving.get(holder, 0) - 1
        if left > 0:
            self.serving[holder] = left
        else:
            self.serving.pop(holder, None)

    def withdraw(self, adapter_id: str) -> bool:
        """Unpublish `adapter_id` (its stored object is gone whatever the copies: e.g. the live edge's
        object died with its owner); returns whether it was published."""
        if adapter_id not in self.published:
            return False
        self._unpublish(adapter_id)
        self.lost += 1
        return True

    def node_lost(self, node_id: str) -> list[str]:
        """`node_id` is gone: forget its copies and its fetches in flight; returns the adapters that
        lost their last copy (unpublished: their next fetch goes to the source)."""
        self.serving.pop(node_id, None)
        for adapter_id in [a for a, (n, _) in self.in_flight.items() if n == node_id]:
            del self.in_flight[adapter_id]
        gone = []
        for adapter_id, entry in list(self.published.items()):
            entry.copies.discard(node_id)
            if not entry.copies:
                self._unpublish(adapter_id)
                gone.append(adapter_id)
        self.lost += len(gone)
        return gone

    def _unpublish(self, adapter_id: str) -> None:
        entry = self.published.pop(adapter_id)
        self.bytes -= entry.nbytes
