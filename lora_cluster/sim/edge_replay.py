"""A simulator run whose ingress edge decides without refusing, each decision judged by the controller's.

`python -m lora_cluster.sim [options] --edge-replay 0,0.25,1,4` prints, for each age d, how the edge's
decisions from a state at least d seconds old compare with the controller's own on the same parks
(`sim.edge.OUTCOMES`, the edge's wrong refusals also by their error class);
docs/scale.md#refusals-at-the-edge has the figures.
"""

from __future__ import annotations

from typing import Any

from lora_cluster.sim.edge import OUTCOMES
from lora_cluster.sim.simulation import SimConfig, Simulation


def replay_run(config: SimConfig, ages: tuple[float, ...]) -> dict[str, Any]:
    """A run of `config` whose edge decides without refusing, each park judged at each age in `ages`."""
    sim = Simulation(config)
    edge = getattr(sim.policy, "edge", None)
    if edge is None:
        raise ValueError("the edge replay needs the lora-cluster policy, one base, one controller shard "
                         "and edge_max_age_s > 0")
    edge.start_replay(ages)
    result = sim.finish()
    return {"completed": result.completed, "rejected": result.rejected,
            "parks_judged": sum(edge.replay[ages[0]][o] for o in OUTCOMES) if ages else 0,
            "by_age_s": {str(d): {o: n for o, n in sorted(edge.replay[d].items())} for d in ages}}
