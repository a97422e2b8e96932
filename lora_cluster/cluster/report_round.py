"""One replica's rounds of reports to the controller's shards: what each shard is sent, and the replies
taken back as one (pure, no I/O: the caller sends).

The live replica (`serve.replica.reporter.ControllerReporter`, over Ray handles) and the simulator
(`sim.sharded_controller`, by direct calls) both run a round through this one object, so the
simulator checks the composition the server runs:

1. `messages(report)`: the report each shard gets, in shard order: that shard's adapters only
   (`sharding.shard_report`), the share of the replica's free room it may grant (`split_room`, from
   the queue depths of the shards' last replies; the round number rotates who gets a remainder
   slot), encoded by that shard's own `ReportEncoder` (a delta against what that shard acknowledged,
   or a full report). With one shard the report goes as built, without a room.
2. `replied(replies)`: each shard's reply, or None for a shard that could not be reached (it counts
   as queueing nothing, so no room is held back for it; its successor starts empty). Each reply
   acknowledges its encoder's report and sets that shard's queue depth; the answered replies merge
   into one (`merge_replies`: queue depths summed, prefetch lists united, each shard's list cut to
   the adapters it owns). Returns that reply (None when no shard answered) and whether any shard
   asked for a full report (`resync`: the caller reports again soon).

Invariant: `queued` holds one depth per shard, each the latest reply's (0 for a silent shard), and
`queue_depth` is their sum: what the replica acts on (`report_rules.report_on_finish`).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

from lora_cluster.cluster.report_delta import ReportDelta, ReportEncoder
from lora_cluster.cluster.reports import ReplicaReport
from lora_cluster.cluster.sharding import merge_replies, owns, shard_report, split_room


class ReportRounds:
    """The report rounds of one replica to `shards` controller shards (see the module docstring)."""

    def __init__(self, shards: int, clock: Callable[[], float]):
        if shards < 1:
            raise ValueError(f"a controller has at least one shard, got {shards}")
        self.encoders = [ReportEncoder(clock=clock) for _ in range(shards)]
        self.queued = [0] * shards  # each shard's queue depth, from its last reply
        self.rounds = 0

    @property
    def queue_depth(self) -> int:
        return sum(self.queued)

    def messages(self, report: ReplicaReport) -> list[ReplicaReport | ReportDelta]:
        """What each shard is sent for `report`, in shard order (step 1)."""
        self.rounds += 1
        n = len(self.encoders)
        rooms: list[int | None] = [None]
        if n > 1:
            rooms = list(split_room(report.capacity - report.ongoing, self.queued, turn=self.rounds))
        return [encoder.encode(shard_report(report, k, n, rooms[k]))
                for k, encoder in enumerate(self.encoders)]

    def replied(self, replies: Sequence[Mapping[str, Any] | None]) -> tuple[dict[str, Any] | None, bool]:
        """The round's replies taken back (step 2): (the merged reply or None, resync asked)."""
        n = len(self.encoders)
        answered: list[dict[str, Any]] = []
        resync = False
        for k, reply in enumerate(replies):
            if reply is None:
                self.queued[k] = 0
                continue
            self.encoders[k].replied(reply)
            resync = resync or bool(reply.get("resync"))
            self.queued[k] = int(reply.get("queue_depth", 0))
            answered.append(dict(reply) if n == 1 else
                            {**reply, "prefetch": [a for a in reply.get("prefetch", ()) if owns(a, k, n)]})
        if not answered:
            return None, resync
        return (answered[0] if n == 1 else merge_replies(answered)), resync
