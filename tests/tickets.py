"""Cluster-queue tickets of the default SLA classes, as an ingress parks them, and replica reports."""

from __future__ import annotations

from lora_cluster.cluster.cluster_queue import Ticket
from lora_cluster.cluster.reports import ReplicaReport
from lora_cluster.cluster.sla import SlaClasses

CLASSES = SlaClasses()  # interactive 0 / 1 s, standard 1 / 5 s, batch 2 / none


def ticket(tid: str, cls: str, at: float, adapter: str | None = None) -> Ticket:
    """Ticket `tid` of class `cls` that arrived at `at` (its deadline: `at` + the class's TTFT target)."""
    sla = CLASSES.get(cls)
    return Ticket(tid, "ingress-1", sla.name, sla.priority, adapter, at,
                  None if sla.ttft_s is None else at + sla.ttft_s, sla.ttft_s)


def report(rid: str, *, capacity: int = 2, running: int = 0, waiting: int = 0, node: str = "n1",
           resident: tuple[str, ...] = (), by_priority: dict[int, int] | None = None,
           free_slots: int = 2, demand: dict[str, int] | None = None,
           arrived: tuple[str, ...] = ()) -> ReplicaReport:
    """Replica `rid`'s report: `capacity` batch slots, its running/waiting counts and resident adapters."""
    return ReplicaReport(rid, node, capacity=capacity, max_num_seqs=capacity, max_loras=4, running=running,
                         waiting=waiting, free_adapter_slots=free_slots, resident=resident,
                         running_by_priority=by_priority or {}, adapter_requests=demand or {},
                         arrived_tickets=arrived)
