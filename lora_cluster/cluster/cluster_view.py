"""The controller's view of the cluster: the latest report of every live replica, and the grants on their way
to each.

`ClusterView` keeps the latest report of each replica and forgets a replica that has not reported for
`stale_after_s` (it died or was scaled down). Room on a replica is its capacity minus its requests in flight
(`active`, counted by the replica itself) minus the grants sent its way that have not arrived yet: each grant
is a ticket id, and each report lists the ticket ids that arrived since the previous one, so no grant is
counted twice or lost between two reports (a grant that never arrives, its request gone, is dropped when its
ingress says so, `release`, or after `grant_ttl_s`). Requests an ingress sent the direct way (its fast path)
reach a replica before the replica reports them; each ingress therefore states, with every ticket it parks,
its requests in flight per replica and those on their way to a replica not known yet (`claim`). A claim
counts for `claim_ttl_s`, after which the replicas' reports, which include those requests, are the truth
again; for one replica, a claim is superseded sooner by that replica's first report received
`claim_superseded_after_s` after it (a report built after the claim shows the claimed requests that still
run, and not those that ended: a stale claim would hide a slot freed since, and keep a parked ticket waiting
for its TTL). An ingress also states, with its park calls, the requests the controller granted that
ended since its previous call, per replica (`ended`): each frees a seat before the replica's next report
says so, which in a large cluster (reports paced to the budget, seconds apart) would free a busy replica's
seats in one lump and leave its adapter's tickets to copy it elsewhere meanwhile. An end that reaches the
view after the report built after it frees a seat that report freed already, until the next report (at
most the ends of one call's way, and never more seats than the report's requests and the grants since).
With the controller in shards, a report's `room` caps the room one shard sees there, less its
own grants not arrived yet (`sharding`; the ends told do not raise that cap). A restarted controller
starts empty and is whole again once every replica has reported, within one report period. Pure:
injected clock, no Ray.

The view learns from its own grants (`held`): a grant of adapter A to a replica whose report lacks A
makes it a holder of A and takes one of its free adapter slots until a report lists the ticket as
arrived (that report shows A itself) or the grant is dropped: between paced reports (seconds, in a
large cluster) A's next tickets hit there instead of loading A elsewhere again.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field

from lora_cluster.cluster.homes import HomeRanks
from lora_cluster.cluster.reports import ReplicaReport
from lora_cluster.cluster.tier_index import TierIndex, reindex


@dataclass
class _Seen:
    report: ReplicaReport
    at: float  # controller clock
    outstanding: dict[str, float] = field(default_factory=dict)  # granted ticket -> when, not arrived yet
    preempting: set[str] = field(default_factory=set)  # those of them that preempt
    # those of them whose adapter the report does not hold: granted ticket -> its adapter
    pending: dict[str, str] = field(default_factory=dict)
    held: frozenset[str] = frozenset()  # the report's `held` and the adapters of `pending`
    # the report's fields that its room is counted from (`ClusterView._free`), read once per report
    capacity: int = 0
    ongoing: int = 0
    room: int | None = None
    ended: int = 0  # granted requests an ingress saw end there since the report (`ClusterView.ended`)

    def took(self, report: ReplicaReport, at: float) -> None:
        """The replica's latest report, taken at `at`."""
        self.report, self.at = report, at
        self.capacity, self.ongoing, self.room = report.capacity, report.ongoing, report.room
        self.ended = 0


class ClusterView:
    """The latest report of every live replica, plus grants on their way to each."""

    def __init__(self, *, stale_after_s: float, clock: Callable[[], float], grant_ttl_s: float = 10.0,
                 claim_ttl_s: float = 1.0, claim_superseded_after_s: float = 0.1, max_ingresses: int = 1024):
        self.stale_after_s, self.grant_ttl_s, self._clock = stale_after_s, grant_ttl_s, clock
        self.claim_ttl_s, self.max_ingresses = claim_ttl_s, max_ingresses
        self.claim_superseded_after_s = claim_superseded_after_s
        self._seen: dict[str, _Seen] = {}
        # ingress -> (when, its requests in flight per replica, its requests on their way)
        self._claims: dict[str, tuple[float, Mapping[str, int], int]] = {}
        self._claim_seqs: dict[str, int] = {}  # ingress -> the `seq` of its claims held (`claim`'s hint)
        # each replica's room (max(0, free)) and its sum, kept incrementally (`_touch`: it may have changed)
        self._room: dict[str, int] = {}
        self._room_sum = 0
        self._dirty: set[str] = set()
        self._roomy: set[str] = set()  # the replicas whose kept room is > 0 (`free_ids`)
        self._reported_at: dict[str, float] = {}  # replica -> when its latest report came, oldest first
        self._holders: dict[str, set[str]] = {}  # adapter -> replicas that hold it (`held`)
        self.tiers = TierIndex()  # where the reports place adapters in host and cluster tiers
        self._slots: set[str] = set()  # the replicas with a free adapter slot (`slot_ids`)
        self._preemptible: dict[int, set[str]] = {}  # priority asked -> replicas where `preemptible` > 0
        self._preempting_at: set[str] = set()  # the replicas with a preempting grant on its way
        # priority -> replicas whose less urgent work grants claimed whole (`claimed_less_urgent_ids`)
        self._claimed: dict[int, set[str]] = {}
        # each adapter's replicas by rendezvous score (`homes.HomeRanks`), rebuilt when one joins or goes
        self.homes = HomeRanks(self.ids)

    def claim(self, ingress_id: str, inflight: Mapping[str, int], unassigned: int,
              hint: tuple[int, int, Iterable[str]] | None = None) -> None:
        """An ingress's requests in flight per replica, and those on their way to an unknown one.
        `inflight` is kept as given (the caller does not change it afterwards): a caller that sends
        the same mapping again while its counts are unchanged spares the comparison. `hint`: (`seq`,
        `base`, `changed`) from the ingress (`park_batch.ClaimHint`): when the claims held from it are
        those of its call `base`, the replicas in `changed` are the only ones whose counts may differ,
        and the two mappings are not compared (O(changed), not O(replicas))."""
        old = self._claims.pop(ingress_id, None)
        held_seq = self._claim_seqs.pop(ingress_id, None)
        new = inflight
        now = self._clock()
        if old is not None:
            # mostly equal: an ingress parks more often than its counts change
            if old[1] is not new:
                if hint is not None and held_seq is not None and hint[1] == held_seq:
                    self._touch(hint[2])  # what changed since the claims held, as the ingress tells
                elif old[1] != new:
                    self._touch({rid for rid, _ in old[1].items() ^ new.items()})  # the counts that changed
            self._touch(self._recounted(old[0], now, new))
        else:
            self._touch(new)
        self._claims[ingress_id] = (now, new, max(0, int(unassigned)))
        if hint is not None:
            self._claim_seqs[ingress_id] = hint[0]
        while len(self._claims) > self.max_ingresses:
            gone = next(iter(self._claims))
            self._claim_seqs.pop(gone, None)
            self._touch(self._claims.pop(gone)[1])

    def _recounted(self, old_at: float, now: float, inflight: Mapping[str, int]) -> list[str]:
        """The replicas of `inflight` where a claim made at `old_at` no longer counted (superseded by
        a later report) and the same claim renewed at `now` counts: those that reported since
        `old_at` + `claim_superseded_after_s`, newest report first, so O(those replicas)."""
        out = []
        for rid in reversed(self._reported_at):
            since = self._reported_at[rid] - self.claim_superseded_after_s
            if old_at > since:
                break  # the old claim counted here, and at every replica that reported earlier
            if now > since and inflight.get(rid, 0):
                out.append(rid)
        return out

    def _touch(self, replica_ids: Iterable[str]) -> None:
        """The room of these replicas may have changed."""
        self._dirty.update(replica_ids)

    def _fresh_claims(self) -> list[tuple[float, Mapping[str, int], int]]:
        """The claims that still count, oldest first; the expired ones dropped. `_claims` is in its
        claims' time order (`claim` puts a renewed one last): the expired are its head, O(expired + fresh)."""
        now, ttl, claims = self._clock(), self.claim_ttl_s, self._claims
        expired = []
        for ingress, (at, _, _) in claims.items():
            if now - at <= ttl:
                break
            expired.append(ingress)
        for ingress in expired:
            self._claim_seqs.pop(ingress, None)
            self._touch(claims.pop(ingress)[1])
        return list(claims.values())

    def unassigned(self) -> int:
        """Requests the ingresses sent the direct way that no replica has answered yet."""
        return sum(n for _, _, n in self._fresh_claims())

    def update(self, report: ReplicaReport) -> None:
        now = self._clock()
        rid = report.replica_id
        seen = self._seen.get(rid)
        if seen is None:
            self.tiers.follow(rid, None, report)
            self._seen[rid] = seen = _Seen(report, now)
            seen.took(report, now)
            self._reheld(rid, seen)
            self.homes.reset()
            changed = True
        else:  # in place: the grants that arrived, or outlived `grant_ttl_s`, leave `outstanding`
            old = seen.report
            self.tiers.follow(rid, old, report)
            outstanding, preempting = seen.outstanding, seen.preempting
            for ticket_id in report.arrived_tickets:
                outstanding.pop(ticket_id, None)
            for ticket_id in [t for t, at in outstanding.items() if now - at >= self.grant_ttl_s]:
                del outstanding[ticket_id]
            preempting_before = len(preempting)
            if preempting:
                preempting.intersection_update(outstanding)
            seen.took(report, now)
            if seen.pending:
                held = report.held
                seen.pending = {t: a for t, a in seen.pending.items() if t in outstanding and a not in held}
            self._reheld(rid, seen)
            # else `preemptible` is as it was
            changed = old.running_by_priority is not report.running_by_priority or (
                len(preempting) != preempting_before)
        self._reported_at.pop(rid, None)
        self._reported_at[rid] = now
        self._touch((rid,))
        if changed:
            self._repreempt(rid)

    def _reheld(self, replica_id: str, seen: _Seen) -> None:
        """`held` (the report's and the pending grants' adapters), the holders index and the free
        adapter slots (each pending adapter takes one) follow the replica's report and grants."""
        report, pending = seen.report, frozenset(seen.pending.values())
        before = seen.held
        seen.held = report.held | pending if pending else report.held
        reindex(self._holders, replica_id, before, seen.held)
        if report.free_adapter_slots - len(pending) > 0:
            self._slots.add(replica_id)
        else:
            self._slots.discard(replica_id)

    def arrived(self, replica_id: str, tickets: Iterable[str]) -> None:
        """Granted tickets that reached the replica, told by a report the view could not use (a
        delta whose base it lacks): they no longer count against its room."""
        seen = self._seen.get(replica_id)
        if seen is not None:
            self._drop_grants(replica_id, seen, tickets)

    def _drop_grants(self, replica_id: str, seen: _Seen, tickets: Iterable[str]) -> None:
        """These grants count against the replica's room no longer."""
        pending = len(seen.pending)
        for ticket_id in tickets:
            seen.outstanding.pop(ticket_id, None)
            seen.preempting.discard(ticket_id)
            seen.pending.pop(ticket_id, None)
        if len(seen.pending) != pending:
            self._reheld(replica_id, seen)
        self._touch((replica_id,))
        self._repreempt(replica_id)

    def forget(self, replica_id: str) -> None:
        seen = self._seen.pop(replica_id, None)
        if seen is not None:
            self.tiers.follow(replica_id, seen.report, None)
            reindex(self._holders, replica_id, seen.held, frozenset())
            self._slots.discard(replica_id)
            self._repreempt(replica_id)
            self.homes.reset()
        self._room_sum -= self._room.pop(replica_id, 0)
        self._dirty.discard(replica_id)
        self._roomy.discard(replica_id)
        self._reported_at.pop(replica_id, None)

    def prune(self) -> list[str]:
        """Forget replicas silent for `stale_after_s`; returns their ids, oldest report first.
        O(replicas forgotten + 1): `_reported_at` holds every replica by its latest report's time
        (its `at`), oldest first, so the silent ones are its head."""
        now = self._clock()
        gone = []
        for rid, at in self._reported_at.items():
            if now - at <= self.stale_after_s:
                break
            gone.append(rid)
        for rid in gone:
            self.forget(rid)
        return gone

    def replicas(self) -> list[ReplicaReport]:
        return [s.report for s in self._seen.values()]

    def get(self, replica_id: str) -> ReplicaReport | None:
        seen = self._seen.get(replica_id)
        return None if seen is None else seen.report

    def free(self, replica_id: str) -> int:
        """Requests the replica can still be given: capacity - in flight - grants on their way (in
        flight: the larger of its report and what the ingresses claim there)."""
        return self._free(replica_id, self._seen[replica_id], self._fresh_claims())

    def free_ids(self) -> set[str]:
        """The replicas with `free` > 0 (read-only, in no order): O(replicas whose `free` may have
        changed since the last look), refreshed with `total_free`'s sum (one `_free` serves both)."""
        self.total_free()
        return self._roomy

    def total_free(self) -> int:
        """The sum of `free` over the replicas with room: O(replicas changed since the last call)."""
        claims = self._fresh_claims()
        for rid in self._dirty:
            seen = self._seen.get(rid)
            if seen is not None:
                room = max(0, self._free(rid, seen, claims))
                self._room_sum += room - self._room.get(rid, 0)
                self._room[rid] = room
                if room > 0:
                    self._roomy.add(rid)
                else:
                    self._roomy.discard(rid)
        self._dirty.clear()
        return self._room_sum

    def with_room(self) -> list[str]:
        """The replicas with room (`free` > 0), in id order."""
        return sorted(self.free_ids())

    def _free(self, replica_id: str, s: _Seen, claims: list[tuple[float, Mapping[str, int], int]]) -> int:
        since = s.at - self.claim_superseded_after_s  # claims made before: superseded by the report
        claimed = 0
        for at, inflight, _ in claims:  # a loop, not a generator: read for every replica whose room changed
            if at > since:
                claimed += inflight.get(replica_id, 0)
        free = s.capacity - max(s.ongoing + len(s.outstanding) - s.ended, claimed)
        room = s.room
        return free if room is None else min(free, room - len(s.outstanding))

    def ended(self, counts: Mapping[str, int]) -> bool:
        """Granted requests an ingress saw end, per replica, since its previous park call (module
        docstring): each frees a seat there until the replica's next report, at most the report's
        requests in flight and the grants sent since. O(len(counts)). Whether any counted."""
        counted = False
        for rid, n in counts.items():
            s = self._seen.get(rid)
            if s is not None and n > 0:
                s.ended = min(s.ended + int(n), s.ongoing + len(s.outstanding))
                self._touch((rid,))
                counted = True
        return counted

    def ends(self, replica_id: str) -> int:
        """The seats `ended` counts free at the replica since its report (0: not known)."""
        seen = self._seen.get(replica_id)
        return 0 if seen is None else seen.ended

    def preemptible(self, replica_id: str, priority: int) -> int:
        """Less urgent running requests a grant over capacity could still preempt there."""
        s = self._seen[replica_id]
        return s.report.less_urgent_running(priority) - len(s.preempting)

    def preempting(self, replica_id: str) -> int:
        """Preempting grants on their way to the replica (sent since its latest report); 0 if not known."""
        seen = self._seen.get(replica_id)
        return 0 if seen is None else len(seen.preempting)

    def preemptible_ids(self, priority: int) -> set[str]:
        """The replicas where `preemptible(rid, priority)` > 0 (read-only): built at the first ask
        for `priority`, then kept up to date with every report, arrival, preempting grant and
        forgotten replica, so that "where could a ticket of this priority preempt?" costs O(answer)."""
        ids = self._preemptible.get(priority)
        if ids is None:
            ids = {rid for rid in self._seen if self.preemptible(rid, priority) > 0}
            self._preemptible[priority] = ids
        return ids

    def claimed_less_urgent_ids(self, priority: int) -> set[str]:
        """The replicas that run work strictly less urgent than `priority` that preempting grants on
        their way there have claimed whole (so `preemptible` is 0 there); read-only. Built at the
        first ask for `priority` (O(replicas with a preempting grant)), then kept by `_repreempt`, so
        that a park's "could it count on preemption?" costs O(1) amortized, not a walk of the replicas."""
        ids = self._claimed.get(priority)
        if ids is None:
            ids = {rid for rid in self._preempting_at
                   if rid in self._seen and self._claims_whole(rid, priority)}
            self._claimed[priority] = ids
        return ids

    def _claims_whole(self, replica_id: str, priority: int) -> bool:
        """Less urgent work runs at the replica and its preempting grants on their way claim it all."""
        s = self._seen[replica_id]
        less = s.report.less_urgent_running(priority)
        return less > 0 and less - len(s.preempting) <= 0

    def _repreempt(self, replica_id: str) -> None:
        """`preemptible_ids` and `claimed_less_urgent_ids` follow a change of the replica's report or of
        its preempting grants."""
        seen = self._seen.get(replica_id)
        if seen is not None and seen.preempting:
            self._preempting_at.add(replica_id)
        else:
            self._preempting_at.discard(replica_id)
        for priority, ids in self._preemptible.items():
            if seen is not None and seen.report.less_urgent_running(priority) - len(seen.preempting) > 0:
                ids.add(replica_id)
            else:
                ids.discard(replica_id)
        for priority, ids in self._claimed.items():
            if seen is not None and self._claims_whole(replica_id, priority):
                ids.add(replica_id)
            else:
                ids.discard(replica_id)

    def granted(self, replica_id: str, ticket_id: str, *, preempting: bool = False,
                adapter_id: str | None = None) -> None:
        """A ticket (of `adapter_id`) is sent to the replica: it counts against its room, and its
        adapter is `held` there, until a report lists it as arrived."""
        s = self._seen.get(replica_id)
        if s is not None:
            self._touch((replica_id,))
            s.outstanding[ticket_id] = self._clock()
            if adapter_id is not None and adapter_id not in s.report.held:
                s.pending[ticket_id] = adapter_id
                if adapter_id not in s.held:
                    self._reheld(replica_id, s)
            if preempting:
                s.preempting.add(ticket_id)
                self._repreempt(replica_id)

    def release(self, ticket_id: str, replica_id: str | None = None) -> bool:
        """A grant whose request will not reach its replica (its caller went away, or sending it
        failed) counts against that replica's room no longer, rather than until `grant_ttl_s`; without
        `replica_id`, every replica's grants are looked at (O(replicas)). Whether one was counted."""
        for rid in (replica_id,) if replica_id is not None else list(self._seen):
            seen = self._seen.get(rid)
            if seen is not None and ticket_id in seen.outstanding:
                self._drop_grants(rid, seen, (ticket_id,))
                return True
        return False

    def ids(self) -> Iterable[str]:
        return self._seen.keys()

    def held(self, replica_id: str) -> frozenset[str]:
        """The adapters the replica holds (resident or loading) by its report, and those granted there
        since (module docstring); empty for a replica not known. The same object while unchanged."""
        seen = self._seen.get(replica_id)
        return frozenset() if seen is None else seen.held

    def holders(self, adapter_id: str) -> frozenset[str] | set[str]:
        """The replicas that hold `adapter_id` (`held`: by their report or a grant since); read-only."""
        return self._holders.get(adapter_id, frozenset())

    def slot_ids(self) -> set[str]:
        """The replicas with a free adapter slot (empty, or holding an idle adapter: a new adapter can
        go there) by their report, less one per adapter granted there since (`held`); read-only."""
        return self._slots

    def held_adapters(self) -> frozenset[str]:
        """Every adapter some replica holds (`held`), resident or loading: O(those adapters)."""
        return frozenset(self._holders)

    def __len__(self) -> int:
        return len(self._seen)

    def age_s(self, replica_id: str) -> float:
        return self._clock() - self._seen[replica_id].at

