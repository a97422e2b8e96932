"""`python -m lora_cluster.sim`: run one simulation and print its result.

    python -m lora_cluster.sim --nodes 32 --adapters 1000 --zipf 1.0 --load 2 \
        --duration 120 --seed 0 --max-loras 16 --policy lora-cluster [--profile gpu|cpu|PATH] [--preload N] \
        [--chats N --turns 8 --think 10 --system-tokens 1000 --prefix-routing on|off] \
        [--bases K | --base-nodes 20,12] [--edge-max-age 1.0] [--edge-replay 0,0.25,1,4] \
        [--control-cost measured|none|PATH] [--cluster-tier on|off] [--json]

The default profile is `gpu` (docs/profile_gpu_papers.json: the GPU nodes a cluster is planned for);
`cpu` (measured on this 2-core machine) must be asked for. `--json` prints one object: profile (the name
of the profile the run used), completed, rejected, hit_rate, adapter_loads (by tier), classes (per
class: ttft_p50_s, ttft_p99_s, slo_attainment, offered, completed, refused) and wall_s (adapter_loads:
host, disk, peer (another node's copy through the cluster tier) and s3); the hit rate
over offered requests and its bounds (hit_rate_offered, psb, static_ceiling, hit_rate_ceiling) with the
bound's inputs (slot_hold_s_mean, adapters_completed, slots_total, max_num_seqs, window_s;
`sim.metrics`), and with the lora-cluster policy control_plane (reports_per_s_per_replica,
controller_cpu_s_per_sim_s, at steady state; controller_loop_modelled, and with the actor's loop
modelled, `--control-cost`, controller_busy_share, inputs_per_turn and input_latency_s_mean), and
sim_cpu_s_per_request (the simulator's own speed: its CPU seconds per arrival). Without it, the same
figures and the run's details (rates, controller calls and CPU time, queue depth) as text.

`--policy oracle` runs a yardstick, not a shipped policy (`sim.oracle`: it knows the true popularity
and pins the most popular adapters at start); its `details` give `pinned_adapters`, `pinned_slots`,
`top_adapter_copies`, `tail_slots_expected` and `queue_max`.

`--bases K` (or `--base-nodes 20,12`) splits the nodes into K replica groups, one base model each
(`sim.bases`): adapter i is listed under base i % K, a request runs only on its adapter's base's
replicas, each group with its own controller, router and admission check. The JSON then has a
`bases` object: per base its `replicas`, `adapters`, `traffic_share`, `offered`, `completed`,
`rejected`, `unfinished`, `hit_rate`, `hit_rate_ceiling` and `slo_attainment` per class; the
details list `replica_bases` (replica id -> base) and each group's policy figures (`by_base`).

`--chats N` replaces the Poisson arrivals (`--load` then does not apply) by N users chatting at once
(`sim.chats`: multi-turn chats pinned to an adapter drawn Zipf, each turn's prompt the previous one,
its answer and a new message) on replicas with the engine's prefix cache (`sim.prefix_cache`);
`--prefix-routing off` ranks by adapter and load alone (`ServeConfig.prefix_aware_routing`). The
JSON then has a `chats` object: the chat settings, `prefix_aware_routing`, `prefix_routing_share`,
`cached_token_share` (prompt tokens found in the replica's prefix cache, of measured completed
requests), `prompt_tokens`, `cached_tokens`, `replica_load` (completed requests per replica: min,
mean, max, max_over_mean) and `ttft_p50_s` / `ttft_p99_s` over every class.
"""

from __future__ import annotations

import argparse
import json
import sys

from lora_cluster.sim.bases import node_shares
from lora_cluster.sim.chats import ChatSettings
from lora_cluster.sim.context import ServeSections
from lora_cluster.sim.edge_replay import replay_run
from lora_cluster.sim.simulation import POLICIES, SimConfig, run

HELP = argparse.ArgumentDefaultsHelpFormatter
_SERVE = ServeSections()


def parse(argv: list[str] | None = None) -> tuple[SimConfig, bool]:
    ap = argparse.ArgumentParser(prog="python -m lora_cluster.sim", formatter_class=HELP,
                                 description="Simulate a lora-cluster deployment with its own policy code.")
    ap.add_argument("--nodes", type=int, default=32, help="nodes, one replica each")
    ap.add_argument("--adapters", type=int, default=1000, help="distinct adapters")
    ap.add_argument("--zipf", type=float, default=1.0, help="Zipf exponent of adapter popularity")
    ap.add_argument("--load", type=float, default=1.0, help="offered load, times the rated capacity")
    ap.add_argument("--duration", type=float, default=120.0, help="measured simulated seconds")
    ap.add_argument("--warmup", type=float, default=30.0, help="unmeasured simulated seconds first")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--max-loras", type=int, default=16, help="adapter slots per replica")
    ap.add_argument("--policy", choices=sorted(POLICIES), default="lora-cluster",
                    help="routing policy (oracle: a yardstick that knows the true popularity; oracle-pinned: "
                    "lora-cluster with the oracle's placement pinned; neither is shipped)")
    ap.add_argument("--profile", default="gpu",
                    help="replica profile: gpu (from papers), cpu (measured on this 2-core machine) "
                    "or a JSON path")
    ap.add_argument("--preload", type=int, default=0,
                    help="the N most popular adapters are in every node's store at start, as after the "
                    "engine's `preload` listed them (0: every adapter only in S3)")
    ap.add_argument("--chats", type=int, default=0,
                    help="users chatting at once (multi-turn chats with a prefix cache; 0: Poisson arrivals)")
    ap.add_argument("--turns", type=int, default=8, help="chats: turns per chat at most")
    ap.add_argument("--think", type=float, default=10.0,
                    help="chats: mean seconds between an answer and the next turn")
    ap.add_argument("--system-tokens", type=int, default=1000,
                    help="chats: tokens of each adapter's system prompt")
    ap.add_argument("--prefix-routing", choices=("on", "off"),
                    default="on" if _SERVE.router.prefix_aware_routing else "off",
                    help="chats: rank replicas by prompt prefix too (off: adapter-only routing)")
    ap.add_argument("--bases", type=int, default=1,
                    help="base models: the nodes split into this many replica groups, one base each, "
                    "adapter i under base i %% K (sim.bases)")
    ap.add_argument("--base-nodes", default="",
                    help="each base's nodes, comma-separated, adding up to --nodes (default: equal shares)")
    ap.add_argument("--controller-shards", type=int, default=_SERVE.controller.controller_shards,
                    help="cluster controller shards (controller_shards: the queue and grants split by "
                    "a hash of the adapter; control_plane gives the busiest shard's CPU)")
    ap.add_argument("--control-cost", default="measured",
                    help="the controller actor's loop (sim.control_loop): measured "
                    "(docs/profile_controller.json), none (every input answered at the instant it "
                    "arrives) or a JSON path")
    ap.add_argument("--report-budget", type=float, default=_SERVE.controller.controller_report_budget_per_s,
                    help="reports a second one controller takes at most (controller_report_budget_per_s; 0: "
                         "no budget): the replicas' report window and period stretch to it")
    ap.add_argument("--edge-max-age", type=float, default=_SERVE.controller.edge_max_age_s,
                    help="edge_max_age_s: refusals at the edge from a state at most this old (0: off)")
    ap.add_argument("--edge-replay", default="", metavar="AGES",
                    help="seconds, comma-separated: the edge decides without refusing, and each park's "
                         "decision from a state that old is set against the controller's (sim.edge_replay)")
    ap.add_argument("--cluster-tier", choices=("on", "off"), default="on",
                    help="lora-cluster's cluster tier and prefetch (sim.cluster_store; the profile's "
                    "tiers.peer cost); off: every node loads from S3 itself")
    ap.add_argument("--json", action="store_true", help="print the result as one JSON object")
    a = ap.parse_args(argv)
    if (a.nodes < 1 or a.adapters < 1 or a.load <= 0 or a.duration <= 0 or a.warmup < 0 or a.max_loras < 1
            or a.preload < 0 or a.controller_shards < 1 or a.report_budget < 0):
        ap.error("--nodes, --adapters, --max-loras, --controller-shards must be >= 1; --load and "
                 "--duration > 0; --warmup, --preload and --report-budget >= 0")
    try:
        base_nodes = tuple(int(n) for n in a.base_nodes.split(",")) if a.base_nodes else ()
        bases = len(base_nodes) or a.bases
        if base_nodes and a.bases not in (1, bases):
            raise ValueError(f"--bases {a.bases} but {bases} counts")
        node_shares(a.nodes, bases, base_nodes)
        if bases > a.adapters:
            raise ValueError(f"{bases} bases need at least {bases} adapters")
    except ValueError as e:
        ap.error(f"--bases, --base-nodes: {e}")
    chats = None
    if a.chats:
        try:
            chats = ChatSettings(sessions=a.chats, turns=a.turns, think_s=a.think,
                                 system_tokens=a.system_tokens)
        except ValueError as e:
            ap.error(f"--chats, --turns, --think, --system-tokens: {e}")
    config = SimConfig(nodes=a.nodes, adapters=a.adapters, zipf=a.zipf, load=a.load, duration=a.duration,
                       warmup=a.warmup, seed=a.seed, max_loras=a.max_loras, policy=a.policy,
                       profile=a.profile, preload=a.preload, chats=chats, bases=bases, base_nodes=base_nodes,
                       control_cost=a.control_cost, cluster_tier=a.cluster_tier == "on",
                       serve=ServeSections().with_fields(prefix_aware_routing=a.prefix_routing == "on",
                                                         controller_shards=a.controller_shards,
                                                         edge_max_age_s=a.edge_max_age,
                                                         controller_report_budget_per_s=a.report_budget))
    return config, a.json


def main(argv: list[str] | None = None) -> int:
    config, as_json = parse(argv)
    replay = argparse.ArgumentParser(add_help=False)
    replay.add_argument("--edge-replay", default="")
    ages = replay.parse_known_args(argv)[0].edge_replay
    if ages:
        print(json.dumps(replay_run(config, tuple(float(d) for d in ages.split(","))), indent=1))
        return 0
    result = run(config)
    if as_json:
        print(json.dumps(result.to_json()))
        return 0
    print(json.dumps({**result.to_json(), "details": result.details}, indent=2, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
