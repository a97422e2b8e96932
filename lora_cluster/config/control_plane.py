"""The control plane's config sections: the router (`router:`), admission (`admission:`) and the
cluster controller (`controller:`). Each owner takes its section whole; each field keeps its flat
`LORA_CLUSTER_<FIELD>` variable and flat serve_config.yaml key as aliases (config.flat_aliases)."""

from __future__ import annotations

from pydantic import BaseModel, Field

from lora_cluster.config.parsing import SECTION


class RouterConfig(BaseModel):
    """The router's section (`ServeConfig.router`, YAML `router:`): how the ingress's Ray Serve
    request router ranks replicas, and its routing-error breaker."""

    model_config = SECTION

    routing_stats_period_s: float = Field(
        1.0, gt=0, description="How often each replica reports its adapters and load to the router."
    )
    router_miss_cost: float = Field(
        4.0,
        ge=0,
        description="Routing: queued requests beyond free batch slots that a replica holding the "
        "adapter may have before a replica without it (which must load it) is preferred.",
    )
    router_placement_ttl_s: float = Field(
        5.0,
        gt=0,
        description="Routing: how long the router trusts its own recent placements before the "
        "replicas' reports confirm them.",
    )
    prefix_aware_routing: bool = Field(
        True,
        description="Routing: weigh the prompt prefixes each replica reports caching, so that a request "
        "goes where its prefix (a shared system prompt, a chat's earlier turns) is cached, unless that "
        "replica is loaded. Off: adapter-only routing (the router and the cluster queue's grants ignore "
        "the replicas' prefix summaries).",
    )
    prefix_routing_share: float = Field(
        0.5,
        ge=0,
        le=1,
        description="Routing: the most a cached prefix takes off a replica's cost, as a share of "
        "router_miss_cost (a fully cached prefix of 4,096 tokens; shorter ones less). A replica more "
        "loaded than another by more than this share of a miss cost loses the request, prefix or not.",
    )
    breaker_routing_warn: float = Field(
        0.01, gt=0, le=1, description="Share of routing errors (a replica died, was unreachable or "
        "ended a stream without output) among the last 100 requests at which the ingress warns."
    )
    breaker_routing_trip: float = Field(
        0.03, gt=0, le=1, description="Share at which the ingress's routing-error breaker opens: new "
        "requests are answered 503 with Retry-After (the cool-down left) instead of being sent."
    )
    breaker_routing_recover_requests: int = Field(
        100, ge=1, description="Probe requests in a row without a routing error that close it."
    )


class AdmissionConfig(BaseModel):
    """The admission section (`ServeConfig.admission`, YAML `admission:`): how many requests a replica
    and the router hold, and how many a replica is given before the cluster queue parks the rest."""

    model_config = SECTION

    max_ongoing_requests: int = Field(
        64,
        ge=1,
        description="Requests one replica accepts at once (running + waiting in its engine); more "
        "wait in the router. With the cluster controller on, Serve lets a replica take up to its "
        "max_num_seqs more: the urgent requests the controller sends over capacity to preempt less "
        "urgent work, which a full admission window would otherwise hold in the router behind it.",
    )
    max_queued_requests: int = Field(
        1024,
        ge=-1,
        description="Requests that may wait in the router for a replica; more are refused with "
        "429. -1 = no limit.",
    )
    admission_capacity: int | None = Field(
        None,
        ge=1,
        description="Requests one replica is given at once before the ingress parks further ones in "
        "the cluster queue (default: max_num_seqs, the replica's batch slots).",
    )
    admission_window_max: int | None = Field(
        None,
        ge=0,
        description="Most requests a replica is given beyond admission_capacity while the cluster "
        "queue holds tickets, so that a freed slot finds its next request already waiting instead of "
        "idling through the report -> grant -> send round trip; sized at run time by feedback (grows "
        "when a step runs with a free seat and nothing waiting, shrinks while requests wait). Default: "
        "max_ongoing_requests - admission_capacity. 0: no window.",
    )


class ControllerConfig(BaseModel):
    """The cluster controller's section (`ServeConfig.controller`, YAML `controller:`): the cluster
    queue, preemption, placement and the replicas' reports."""

    model_config = SECTION

    enabled: bool = Field(
        True,
        description="Run the cluster controller: the cluster-wide priority queue, cross-replica "
        "preemption and adapter placement. Off: requests wait in Ray Serve's own queue (FIFO).",
    )
    controller_shards: int = Field(
        1,
        ge=1,
        le=64,
        description="Cluster controller actors per replica group: each owns the cluster queue, grants and "
        "placement of the adapters a stable hash of the adapter id gives it (base-model requests: shard 0), "
        "over every replica (each replica's report round goes to the shards it concerns, each with its "
        "share of the replica's free room, and to every shard each controller_shard_heartbeat_s). Shard 0 "
        "keeps the deployment name `ClusterController[-<group>]`, shard k > 0 adds `-shard<k>` "
        "(docs/scale.md).",
    )
    controller_gc_threshold: int = Field(
        50_000,
        ge=700,
        le=10_000_000,
        description="The young-generation threshold of each cluster controller's process (the first "
        "value of Python's gc.set_threshold; CPython's default is 700; the older generations keep "
        "theirs). Its parks and reports allocate containers that live until the next one, so at 700 a "
        "young collection ran every few calls and promoted them to be walked again; at 50,000 most die "
        "first: at 256 x 10,000 and 2x load a young collection runs every few seconds, taking about "
        "20 ms, and the collector's share of the controller's CPU halves (docs/scale.md#the-controllers-"
        "garbage-collector). The simulator runs with it too, since it times the controller in its own "
        "process.",
    )
    controller_shard_heartbeat_s: float = Field(
        1.0,
        gt=0,
        le=60,
        description="With controller_shards > 1, a replica's report round goes only to the shards it "
        "concerns (the room a shard may grant there or its adapters there changed, or it is owed a full "
        "report), and to every other shard at least this often, so each still learns that the replica "
        "lives, its load, and its grants that arrived. Keep it "
        "well under the controller's forgetting of a silent replica (max(2 s, 4 report periods, each "
        "paced by controller_report_budget_per_s)) "
        "(docs/scale.md#report-rounds-to-the-shards-concerned).",
    )
    cluster_queue_size: int | None = Field(
        None, ge=1, description="Requests the cluster queue holds; more are refused with 429 and Retry-After "
        "(a more urgent request bumps the least urgent queued one instead). None (the default): 128 per "
        "replica the controller sees, at least 4096, so that the queue holds about as many seconds of "
        "the cluster's work on 1,024 replicas as on 32 (a fixed 4096 is a third of a second of arrivals "
        "at 1,024 GPU replicas) (docs/scale.md#a-preempted-requests-own-blocks-and-a-cluster-queue-"
        "that-grows-with-the-cluster-issue-44-2026-12-06)."
    )
    cluster_queue_aging_s: float = Field(
        10.0,
        gt=0,
        description="Aging of the cluster queue: a waiting request gains one priority level per "
        "this many seconds (never above the most urgent class), so no class starves.",
    )
    cluster_queue_timeout_s: float = Field(
        300.0, gt=0, description="Longest wait in the cluster queue before a request is refused (503); a "
        "request whose predicted wait is longer is refused at once (429)."
    )
    cluster_queue_max_wait_s: float = Field(
        60.0,
        ge=0,
        description="Bound on the cluster-queue wait of a class without a TTFT target (batch): a queued "
        "request that waited three quarters of it gets the next free slot before any other (the last "
        "quarter is the wait for a slot to free); while the class's queued requests already wait half of it "
        "(its oldest, or its backlog at its recent grant rate), new ones are refused at once (429 with "
        "Retry-After) instead of queueing for minutes. 0 turns the bound off (aging alone).",
    )
    cold_shed_window_s: float = Field(
        1.0,
        ge=0,
        description="While a class sheds load (one of its requests was refused for its TTFT target, or for "
        "cluster_queue_max_wait_s, within this many seconds), its requests whose adapter no replica holds "
        "are refused first (429): they "
        "would cost a load and an adapter slot. Not the most urgent class. 0 turns this trigger off "
        "(cold_shed_pressure is the other one).",
    )
    cold_shed_pressure: float = Field(
        0.75,
        ge=0,
        le=1,
        description="A class also sheds load (its requests whose adapter no replica holds are refused first, "
        "429) while a request of it parked now would wait more than this share of its TTFT target (a class "
        "without one: of half of cluster_queue_max_wait_s), by the cluster queue's prediction: the queue "
        "stands near the target between refusals too. Not the most urgent class. 0 turns it off.",
    )
    edge_max_age_s: float = Field(
        0.1,
        ge=0,
        le=10,
        description="Refusals at the edge: an ingress refuses, before parking it, a request that the cluster "
        "queue would refuse (queue full for its class, cold shedding, deadline out of reach), with the same "
        "429 body and Retry-After, from the admission state the controller sends with its replies; a state "
        "older than this many seconds refuses nothing (the adapters the replicas hold, sent every "
        "controller_report_period_s, refuse nothing after two of its periods), so no request is refused on a "
        "view older than that (docs/scale.md#refusals-at-the-edge). 0 turns the edge off (every such request "
        "parks).",
    )
    preempt_after_fraction: float = Field(
        0.5,
        ge=0,
        le=1,
        description="An urgent queued request that has waited this fraction of its class's TTFT "
        "target is sent to the replica with the most less-urgent work, which preempts some of it.",
    )
    top_class_preempt_after_fraction: float | None = Field(
        0.0, ge=0, le=1, description="preempt_after_fraction of the most urgent SLA class (null: "
        "preempt_after_fraction): by default its queued requests preempt less urgent work as soon as no "
        "replica has room, since the engine's own prefill under load takes much of a 1 s TTFT target."
    )
    controller_report_period_s: float = Field(
        0.5, gt=0, description="How often each replica reports its memory, adapters and queues."
    )
    controller_report_coalesce_s: float = Field(
        0.2,
        ge=0,
        le=10,
        description="A replica whose request ends while requests wait in the cluster queue reports at "
        "once, unless it reported less than this many seconds ago: then at the end of that window, one "
        "report for every request that ended within it: a busy replica reports at most once per window "
        "(5 times a second at 0.2). Shorter frees slots to the queue sooner, for more reports (docs/scale.md"
        "#reports-that-scale: 0.02 completed 3-4% more requests at 2x load in the simulator, at 8 reports "
        "a second per replica).",
    )
    controller_report_budget_per_s: float = Field(
        400.0,
        ge=0,
        description="Replica reports a second that one controller (each shard: as if it took every round) "
        "is sent at most: each replica's coalescing window and report period are at least (replicas the "
        "controller sees) / this, so that the reports stay within its event loop's reach as the cluster "
        "grows (each costs a Serve call, about 0.6 ms of its CPU). Below budget x "
        "controller_report_coalesce_s replicas (80 at the defaults) nothing changes; 256 replicas report "
        "at most every 0.64 s (docs/scale.md#the-controller-actors-loop-what-a-call-costs-live). 0: no "
        "budget.",
    )
    controller_park_batch_max: int = Field(
        256,
        ge=1,
        le=4096,
        description="Parked requests one ingress sends a controller shard in one call: each ingress "
        "keeps at most one park call in flight per shard, and the requests that park meanwhile go "
        "together in its next call, at most this many (no wait is added: a request that parks while "
        "no call is in flight goes at once).",
    )
    controller_batch_window_s: float = Field(
        0.0,
        ge=0,
        le=0.1,
        description="The cluster controller takes its parked requests and replica reports in batches: one "
        "dispatch of its queue and one update of each ingress's claims per batch, not per call. 0: a "
        "batch is what reached it within one turn of its event loop (while it was busy), with no added "
        "wait. A positive window also holds them this many seconds (a parked request, or a slot a report "
        "frees, waits that much longer for its grant): in the simulator, 0.002 cut the controller's CPU "
        "by a fifth to a third at 256 replicas and 2x load, but cost 1-2 points of hit rate at 32 replicas "
        "(docs/scale.md#batch-windows).",
    )
    placement_hot_share: float = Field(
        0.5,
        gt=0,
        le=1,
        description="Placement: an adapter is spread over one more replica each time its load "
        "(request rate x service time) exceeds this share of one replica's batch slots.",
    )
