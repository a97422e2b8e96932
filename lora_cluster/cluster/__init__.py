"""The cluster layer: SLA classes, the cluster-wide priority queue, placement and preemption policies
(pure Python with injected clocks, imported unchanged by the simulator) and the controller actor."""
