"""The cluster controller's knobs (`ControllerSettings`): one shard's view of the config's controller
section (`ControllerConfig`, with its defaults), and the controller's own constants; `from_config`
maps the section onto them, one of `controller_shards` shards holding its share of the queue. Pure."""

from __future__ import annotations

from dataclasses import dataclass

from mypy_extensions import mypyc_attr

from lora_cluster.cluster.cluster_queue import Ticket
from lora_cluster.cluster.report_rules import report_spacing_s
from lora_cluster.config import ControllerConfig

_DEFAULTS = ControllerConfig()
QUEUE_FLOOR = 4096  # the cluster queue's default bound (`cluster_queue_size` None) is at least this, ...
QUEUE_PER_REPLICA = 128  # ... and this per replica seen: about 11 s of a GPU replica's rated throughput
STALE_PERIODS = 4  # a replica is forgotten after this many of its report periods without one (2 s at least)


@mypyc_attr(native_class=False)  # compiled, still a Python class: frozen (lora_cluster.compiled)
@dataclass(frozen=True)
class ControllerSettings:
    """The controller's knobs. Those from `ControllerConfig` default to its defaults (read from the
    section, never copied); `from_config` maps a section onto them. The others are the controller's
    own constants."""

    queue_size: int | None = _DEFAULTS.cluster_queue_size  # the whole cluster's (None: `cluster_queue_bound`)
    queue_shards: int = 1  # this shard holds its share of it
    aging_s: float = _DEFAULTS.cluster_queue_aging_s
    preempt_after_fraction: float = _DEFAULTS.preempt_after_fraction
    top_class_preempt_after_fraction: float | None = None  # the most urgent class's (None: the above)
    stale_after_s: float = 5.0  # a replica silent this long is forgotten (longer where reports are paced:)
    # the replicas' reports a second to one controller (`report_rules.report_spacing_s`; 0: no budget):
    # each replica's period stretches to (replicas / budget), and so does the silence that forgets one
    report_budget_per_s: float = 0.0
    hot_share: float = _DEFAULTS.placement_hot_share
    demand_window_s: float = 30.0
    affinity_wait_fraction: float = 0.5  # hits arrived this share of its TTFT target later may pass a miss
    holder_wait_fraction: float = 0.8  # a due miss whose adapter a replica holds waits this share for it
    queue_timeout_s: float | None = None  # the ingresses' wait limit: longer predicted waits are refused
    # a class sheds cold misses this long after a deadline refusal (0: off)
    cold_shed_window_s: float = _DEFAULTS.cold_shed_window_s
    # a class whose next request would wait this share of its bound sheds cold misses too (0: off)
    cold_shed_pressure: float = _DEFAULTS.cold_shed_pressure
    # longest queue wait of a class without a TTFT target (None: unbounded)
    wait_bound_s: float | None = _DEFAULTS.cluster_queue_max_wait_s
    # the share of the replicas' completion rate this queue drains by, for its wait predictions:
    # 1/n for one of n controller shards (`sharding`: an adapter hash spreads demand evenly)
    rate_share: float = 1.0
    # refusals at the edge: a published state older than this refuses nothing (0: off; `cluster.edge`)
    edge_max_age_s: float = _DEFAULTS.edge_max_age_s
    # ... and held adapters older than this refuse nothing cold (they come with the placement fetch,
    # every `controller_report_period_s`: two of its periods)
    edge_held_max_age_s: float = 2 * _DEFAULTS.controller_report_period_s

    def silent_after_s(self, replicas: int) -> float:
        """How long a replica may go without a report before the controller forgets it, when it sees
        `replicas` replicas: `stale_after_s`, or `STALE_PERIODS` of the period the report budget paces
        each replica to where that is longer (`report_rules.report_spacing_s`: 1,024 replicas at 400
        reports a second report every 2.56 s, so a fixed 2 s forgot and re-added most of them, each time
        replanning placement and dropping its grants on their way)."""
        return max(self.stale_after_s, STALE_PERIODS * report_spacing_s(replicas, self.report_budget_per_s))

    def queue_bound(self, replicas: int) -> int:
        """This shard's queue bound when the controller sees `replicas` replicas: its share of
        `cluster_queue_bound`, at least 1."""
        return max(1, -(-cluster_queue_bound(self.queue_size, replicas) // self.queue_shards))

    def preempt_wait_s(self, ticket: Ticket, top_priority: int | None) -> float:
        """How long `ticket` (with a TTFT target) waits before it may preempt less urgent work."""
        top = self.top_class_preempt_after_fraction
        fraction = top if top is not None and ticket.priority == top_priority else self.preempt_after_fraction
        return fraction * (ticket.ttft_s or 0.0)

    def holder_wait(self, ticket: Ticket, top_priority: int | None) -> float:
        """The share of its TTFT target a due miss waits for a holder of its adapter
        (`scheduling.holder_wait_until`): none for the most urgent class, whose tickets go at once."""
        return 0.0 if ticket.priority == top_priority else self.holder_wait_fraction

    @classmethod
    def from_config(cls, config: ControllerConfig) -> ControllerSettings:
        """From the config's controller section (`ServeConfig.controller`, the simulator's too). One of
        `controller_shards` shards holds its share of the queue and drains by its share of the rate."""
        shards = config.controller_shards
        return cls(
            queue_size=config.cluster_queue_size, queue_shards=shards, rate_share=1.0 / shards,
            aging_s=config.cluster_queue_aging_s,
            preempt_after_fraction=config.preempt_after_fraction,
            top_class_preempt_after_fraction=config.top_class_preempt_after_fraction,
            stale_after_s=max(2.0, STALE_PERIODS * config.controller_report_period_s),
            report_budget_per_s=config.controller_report_budget_per_s,
            hot_share=config.placement_hot_share, queue_timeout_s=config.cluster_queue_timeout_s,
            cold_shed_window_s=config.cold_shed_window_s, cold_shed_pressure=config.cold_shed_pressure,
            wait_bound_s=config.cluster_queue_max_wait_s or None, edge_max_age_s=config.edge_max_age_s,
            edge_held_max_age_s=2 * config.controller_report_period_s,
        )


def cluster_queue_bound(size: int | None, replicas: int) -> int:
    """Requests the cluster queue holds (all shards together): `size` (`cluster_queue_size`) when set;
    else `QUEUE_PER_REPLICA` per replica, at least `QUEUE_FLOOR`. A fixed bound shrinks, in seconds of
    the cluster's work, as the cluster grows: 4096 tickets are 11 s of arrivals at 32 GPU replicas
    and a third of a second at 1,024, where a burst the replicas drain within a second was refused."""
    if size is not None:
        return size
    return max(QUEUE_FLOOR, QUEUE_PER_REPLICA * replicas)
