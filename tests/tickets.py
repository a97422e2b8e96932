"""Cluster-queue tickets of the default SLA classes, as an ingress parks them."""

from __future__ import annotations

from lora_cluster.cluster.cluster_queue import Ticket
from lora_cluster.cluster.sla import SlaClasses

CLASSES = SlaClasses()  # interactive 0 / 1 s, standard 1 / 5 s, batch 2 / none


def ticket(tid: str, cls: str, at: float, adapter: str | None = None) -> Ticket:
    """Ticket `tid` of class `cls` that arrived at `at` (its deadline: `at` + the class's TTFT target)."""
    sla = CLASSES.get(cls)
    return Ticket(tid, "ingress-1", sla.name, sla.priority, adapter, at,
                  None if sla.ttft_s is None else at + sla.ttft_s, sla.ttft_s)
