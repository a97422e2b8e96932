"""A discrete-event simulator of a lora-cluster deployment, driving the cluster's own policy code.

The routing, admission, cluster queue, preemption and placement decisions are made by the modules
the live system runs, imported unchanged: `cluster.controller.Controller` (with `cluster_queue`,
`scheduling.choose_replica` / `scheduling.holder_preemption_target`, `placement.PlacementPolicy` /
`DemandTracker`), `cluster.routing_score.rank_replicas` (through `PlacementTracker`) and
`cluster.report_rules.AdapterDemand`.
What is simulated is everything around them: time (`events`), the workload (`workload`, or
multi-turn chats: `chats`), the replicas' engines (`replica`, `adapters`, `store`, and the prefix
cache: `prefix_cache`), calibrated by a profile (`profile`), the wiring
of the live deployments (`cluster_policy`), the baselines (`baselines`), a yardstick with perfect
knowledge of popularity (`oracle`: not a shipped policy) and the measurements
(`metrics`, and `census` of the device slots). `simulation.run(SimConfig(...))` runs one;
`python -m lora_cluster.sim` is its command line, `python -m lora_cluster.sim.experiments`
writes docs/scale.md's figures.
"""

from lora_cluster.sim.metrics import SimResult
from lora_cluster.sim.simulation import POLICIES, SimConfig, Simulation, run

__all__ = ["POLICIES", "SimConfig", "SimResult", "Simulation", "run"]
