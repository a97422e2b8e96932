"""A cluster controller in shards: which shard owns a request, how the replicas' room is split between
the shards, and the shards' answers merged into one (pure: no Ray, no clock).

With `controller_shards` = n > 1, a replica group's cluster queue and granting run in n controller
actors instead of one, so that no single actor serialises every park, report and grant of the cluster.

Ownership. Shard `shard_of(adapter_id, n)` owns a request: its ticket parks there, and that shard alone
places (and has prefetched) its adapter. The hash is a stable digest of the id (blake2b, the same in
every process and every run, unlike Python's salted `hash`), so every ingress parks an adapter's
requests at the same shard and a restarted shard owns what its predecessor owned. Requests for the
base model (adapter None) belong to shard 0. Every shard sees every replica, with one report encoder
per shard (its deltas and resyncs are that shard's alone) and one pacer (a replica sends one round of
reports per period or coalesced finish, so its report *rounds* per second do not grow with n). A
round goes only to the shards it concerns (`report_round.ReportRounds`): those whose room share, own
adapters or arrived tickets changed, that are owed a full report, and every shard at least every
`controller_shard_heartbeat_s` (so each still learns the replica lives, and its load). A shard's
report (`shard_report`) lists only that shard's adapters among the resident, loading, requested and
host- or cluster-tier-held ones, and only the tickets it granted among the arrived ones: every
decision of a shard reads residency and demand of its own adapters only (holders, hits, placement,
cold shedding), so it loses nothing, and the adapter lists a shard keeps up to date shrink n times.
What the shards place together differs from one controller's plan in one way: each counts a
replica's free adapter slots for its own new holders, so n shards may plan up to n new adapters into
the same free slot in one round (the replica's own eviction policy then decides).

Room. Two shards could grant the same free slot. Each report therefore tells its shard how much of
the replica's free room (capacity - requests in its hands) that shard may grant (`ReplicaReport.room`;
the view grants at most that, less its own grants not yet arrived), split by `split_room` from the
queued counts each shard's last reply gave (its queue depth):

* demand above the room (the shards' queued tickets add up to more than the free slots): the room
  is split in proportion to each shard's queued tickets (largest remainders, ties in turn), so the
  shares add up to the room exactly: no slot is granted twice, and every slot goes to a shard with
  tickets waiting;
* room above the demand: each shard gets its queued tickets plus the whole surplus, so a ticket that
  parks at any shard before the next report is granted at once (work-conserving: no slot idles while
  a ticket waits for the next report). Two shards granting surplus at once overcommit the replica by
  at most (n - 1) x surplus per report round, which its own queue (admission window, engine queue)
  absorbs, and which the next report (at once after a finish while tickets wait) corrects.

So protection never leaves capacity idle while requests wait: a shard with tickets always has room
offered where room exists, and the bounded overcommit is the price of that. With one shard nothing
is split: `room` stays None and the controller behaves exactly as before.

Held shares: a shard's grants need no other shard's reports. Each shard grants from the share it was
last sent, less its own grants on their way; a grant of its own that arrives takes its slot out of
its own share (the replica knows which shard granted an arrived ticket from the ticket's adapter),
and when demand exceeds the room `split_room` moves as few slots as it can between the shares it
holds (`held`), so a freed slot changes one shard's share and only that shard is sent the round.
A shard's view of the replica's shared fields (running, waiting, per-class stats) is then at most one
heartbeat old; its room share, its adapters and its tickets are always as fresh as the replica's
last round.

Preemption across shards. A preempting grant needs no room share: a shard preempts less urgent work
on any replica, whichever shard's requests those are, from the running-by-priority counts that
replica last told it (at most one heartbeat old, fresh after every round that concerns it). The
replica's engine picks the victims (its least urgent sequences), so two shards that preempt on one
replica at once take its least urgent work in turn, and a grant beyond it waits in the replica's
queue. The victim's own shard is not asked (the victim stays the replica's, paused there, not
parked again) and sees the replica's counts change with the next round sent to it, at most one
heartbeat later.

Merging. `merge_replies` (the replica's view of its n replies: queued counts summed, prefetch lists
united), `merge_placement` (each shard's table holds only its own adapters: their union),
`merge_snapshots` (`GET /v1/cluster`: one view, queue depths summed, each replica's adapters the
union of what the shards were told, every shard listed under "controller").
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from lora_cluster.cluster.reports import ReplicaReport

BASE_MODEL_SHARD = 0  # requests without an adapter belong to this shard
SHARD_SUFFIX = "-shard"  # deployment name of shard k > 0: "<controller deployment>-shard<k>"


def shard_of(adapter_id: str | None, shards: int) -> int:
    """The shard (0 .. shards - 1) that owns `adapter_id`'s requests and placement (see the module
    docstring): a stable hash of the id; the base model (None) belongs to `BASE_MODEL_SHARD`."""
    if shards <= 1 or adapter_id is None:
        return BASE_MODEL_SHARD
    return _hashed_shard(adapter_id, shards)


@functools.lru_cache(maxsize=1 << 16)  # bounded: the busiest adapters' shards, hashed once
def _hashed_shard(adapter_id: str, shards: int) -> int:
    digest = hashlib.blake2b(adapter_id.encode("utf-8"), digest_size=8).digest()
    return int.from_bytes(digest, "big") % shards


def owns(adapter_id: str | None, shard: int, shards: int) -> bool:
    return shard_of(adapter_id, shards) == shard


def shard_deployment(controller: str, shard: int) -> str:
    """The deployment name of `shard` of the controller deployed as `controller`: shard 0 keeps the
    name of the unsharded controller (dashboards and tools that look it up keep working)."""
    return controller if shard == 0 else f"{controller}{SHARD_SUFFIX}{shard}"


def shard_report(report: ReplicaReport, shard: int, shards: int, room: int | None,
                 arrived: tuple[str, ...] | None = None) -> ReplicaReport:
    """What a replica tells `shard`: `report` with the adapters it lists (resident, loading,
    requested, held in its host tier or on its node's cluster tier) cut to those the shard owns,
    `room`, the share of its free room the shard may grant (see the module docstring), and, when
    `arrived` is given, those of its arrived tickets (the ones this shard granted, and any whose
    shard the replica does not know). One shard: `report` itself, with `room`."""
    if shards <= 1:
        return report if room is None else dataclasses.replace(report, room=room)

    def own(ids: Iterable[str]) -> tuple[str, ...]:
        return tuple(a for a in ids if shard_of(a, shards) == shard)
    return dataclasses.replace(
        report, room=room, resident=own(report.resident), loading=own(report.loading),
        host_held=own(report.host_held), cluster_held=own(report.cluster_held),
        arrived_tickets=report.arrived_tickets if arrived is None else arrived,
        adapter_requests={a: n for a, n in report.adapter_requests.items() if shard_of(a, shards) == shard})


def split_room(free: int, queued: Sequence[int], turn: int = 0,
               held: Sequence[int] | None = None) -> list[int]:
    """How much of a replica's `free` slots each shard may grant, given each shard's `queued`
    tickets (see the module docstring); `turn` rotates who gets a remainder slot first.

    `held`: the shares the shards hold now (what each was last sent, less its grants that arrived
    since). When the queued tickets exceed the room, the split then moves as few slots as it can:
    each shard keeps its share, cut to its queued tickets; while the shares exceed the room, a slot
    is taken from the shard furthest above its proportional share; while they fall short, one goes
    to the shard furthest below it. So a freed slot changes one shard's share, and only that shard
    needs the replica's next report (`report_round`). The shares still add up to the room exactly
    and never exceed a shard's queued tickets."""
    n = len(queued)
    free = max(0, free)
    if n <= 1:
        return [free] * n
    demand = [max(0, q) for q in queued]
    total = sum(demand)
    if total <= free:  # room for every queued ticket: each shard also gets the whole surplus
        surplus = free - total
        return [q + surplus for q in demand]
    shares = [free * q // total for q in demand]
    left = free - sum(shares)
    order = sorted(range(n), key=lambda k: (-(free * demand[k] % total), (k - turn) % n))
    for k in order[:left]:
        shares[k] += 1
    if held is None or len(held) != n:
        return shares
    return _sticky(shares, [min(max(0, h), q) for h, q in zip(held, demand, strict=True)], free, turn)


def _sticky(target: list[int], kept: list[int], free: int, turn: int) -> list[int]:
    """`kept` moved towards `target` one slot at a time until it adds up to `free` (`split_room`);
    ties go to the shard first from `turn`."""
    n = len(target)
    order = sorted(range(n), key=lambda k: (k - turn) % n)
    total = sum(kept)
    while total > free:
        k = max(order, key=lambda j: kept[j] - target[j])
        kept[k] -= 1
        total -= 1
    while total < free:
        k = max(order, key=lambda j: target[j] - kept[j])
        kept[k] += 1
        total += 1
    return kept


def merge_replies(replies: Iterable[Mapping[str, Any]]) -> dict[str, Any]:
    """The shards' replies to one round of reports as one: queued tickets summed, prefetch united,
    the replicas seen the most any shard sees (each takes every round)."""
    depth, seen, prefetch = 0, 0, set[str]()
    for reply in replies:
        depth += int(reply.get("queue_depth", 0))
        seen = max(seen, int(reply.get("replicas", 0)))
        prefetch.update(str(a) for a in reply.get("prefetch", ()))
    return {"queue_depth": depth, "prefetch": sorted(prefetch), "replicas": seen}


def merge_placement(tables: Iterable[Mapping[str, Sequence[str]]]) -> dict[str, list[str]]:
    """The shards' placement tables as one (each holds its own adapters only; a later table's entry
    for the same adapter, which no shard should send, wins)."""
    merged: dict[str, list[str]] = {}
    for table in tables:
        merged.update({a: list(r) for a, r in table.items()})
    return merged


def merge_snapshots(views: Sequence[Mapping[str, Any] | BaseException]) -> dict[str, Any]:
    """The shards' `snapshot()`s (index = shard; an exception: that shard did not answer) as one
    cluster view: shard 0's nodes (every shard sees every replica), queue depths and counts summed,
    placement united, and `controller.shards` listing each shard (its actor, node, queue depth, or
    its error). Raises the first error when no shard answered."""
    live = [(k, v) for k, v in enumerate(views) if not isinstance(v, BaseException)]
    if not live:
        first = next(v for v in views if isinstance(v, BaseException))
        raise first
    _, head = live[0]
    merged = {**head, "controller": dict(head["controller"]), "queue": dict(head["queue"]),
              "nodes": _united_nodes([v for _, v in live])}
    counts: dict[str, int] = {}
    by_class: dict[str, int] = {}
    shards: list[dict[str, Any]] = []
    for k, view in enumerate(views):
        if isinstance(view, BaseException):
            shards.append({"shard": k, "error": str(view) or type(view).__name__})
            continue
        for name, n in view["controller"].get("counts", {}).items():
            counts[name] = counts.get(name, 0) + int(n)
        for name, n in view["queue"].get("by_class", {}).items():
            by_class[name] = by_class.get(name, 0) + int(n)
        shards.append({"shard": k, **view["controller"], "queue_depth": view["queue"]["depth"]})
    queues = [v["queue"] for _, v in live]
    merged["queue"].update(depth=sum(q["depth"] for q in queues), size=sum(q["size"] for q in queues),
                           by_class=by_class, oldest_wait_s=max(q["oldest_wait_s"] for q in queues))
    merged["controller"].update(counts=counts, shards=shards)
    merged["controller"].pop("shard", None)
    merged["placement"] = dict(sorted(merge_placement(v.get("placement", {}) for _, v in live).items()))
    return merged


def _united_nodes(views: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """The first view's nodes, each replica's resident and loading adapters united over `views`
    (each shard is told of its own adapters only)."""
    held: dict[str, dict[str, set[str]]] = {}  # replica -> kind -> adapters
    for view in views:
        for node in view["nodes"].values():
            for rid, r in node["replicas"].items():
                for kind, ids in (r.get("adapters") or {}).items():
                    held.setdefault(rid, {}).setdefault(kind, set()).update(ids)
    nodes: dict[str, Any] = {}
    for nid, node in views[0]["nodes"].items():
        replicas = {rid: {**r, "adapters": {k: sorted(v) for k, v in held[rid].items()}} if rid in held else r
                    for rid, r in node["replicas"].items()}
        nodes[nid] = {**node, "replicas": replicas}
    return nodes
