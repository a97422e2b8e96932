"""The cluster simulator: it decides as the live router, admission and controller do (shared fixtures),
its replica model keeps the engine's timing and preemption rules, runs are deterministic, and its
command line prints exactly the documented JSON."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import gc
import io
import json
import random

import pytest
from sim_profiles import SYNTHETIC

from lora_cluster.cluster.controller import Controller
from lora_cluster.cluster.report_delta import parse_report
from lora_cluster.cluster.routing_score import rank_replicas
from lora_cluster.cluster.routing_stats import RoutingStats
from lora_cluster.cluster.sla import SlaClasses
from lora_cluster.errors import ClusterOverloadedError
from lora_cluster.serve.routing.admission import ClusterAdmission
from lora_cluster.sim import SimConfig, Simulation, run
from lora_cluster.sim.__main__ import main
from lora_cluster.sim.cluster_policy import LoraClusterPolicy
from lora_cluster.sim.context import ServeSections
from lora_cluster.sim.events import EventLoop
from lora_cluster.sim.metrics import MACHINE_KEYS
from lora_cluster.sim.replica import SimReplica
from lora_cluster.sim.workload import SimRequest

CLASSES = SlaClasses()
PROFILE = SYNTHETIC


# ----- shared fixtures: one cluster state, asked of the simulator and of the live code ------------

@pytest.fixture(scope="module")
def paused() -> Simulation:
    """A lora-cluster simulation overloaded (2.5x) and stopped mid-run: replicas full, tickets queued,
    adapters resident and loading, placements recorded."""
    sim = Simulation(SimConfig(nodes=6, adapters=40, zipf=1.0, load=2.5, duration=30, warmup=0, seed=3,
                               max_loras=4, policy="lora-cluster"), PROFILE)
    sim.advance(12.0)
    return sim


def live_views(policy: LoraClusterPolicy, adapter_id: str) -> list:
    """What `LoraAffinityRouter.choose_replicas` builds: every replica's view, the placed ones as held."""
    placed = set(policy.routing.placement.get(adapter_id, ()))
    return [policy.routing.view(rid, adapter_id if rid in placed else None)
            for rid in sorted(policy.replicas)]


def test_the_router_decision_is_the_live_rank_over_every_replica(paused: Simulation) -> None:
    policy = paused.policy
    assert isinstance(policy, LoraClusterPolicy)
    for rid in paused.replicas:
        policy.routing.refresh_stats(rid)
    for adapter_id in [f"a{k}" for k in range(40)]:
        live = rank_replicas(adapter_id, live_views(policy, adapter_id), policy.routing.miss_cost)[0]
        assert policy.routing.choose(adapter_id) == live, f"adapter {adapter_id}: another replica chosen"


def test_the_router_decision_matches_on_random_states() -> None:
    rng = random.Random(7)
    for trial in range(30):
        sim = Simulation(SimConfig(nodes=rng.randint(2, 9), adapters=30, zipf=rng.uniform(0.5, 1.5),
                                   load=rng.uniform(0.3, 2.5), duration=20, warmup=0, seed=trial,
                                   max_loras=rng.randint(1, 5)), PROFILE)
        sim.advance(rng.uniform(1.0, 15.0))
        policy = sim.policy
        assert isinstance(policy, LoraClusterPolicy)
        for adapter_id in [f"a{k}" for k in rng.sample(range(30), 10)]:
            live = rank_replicas(adapter_id, live_views(policy, adapter_id), policy.routing.miss_cost)[0]
            assert policy.routing.choose(adapter_id) == live, f"trial {trial}, adapter {adapter_id}"


def live_ingress(sim: Simulation) -> ClusterAdmission:
    """The live ingress's admission state for the same requests: fast-path requests on their way,
    requests running per replica (after their first item), the replicas' routing stats."""
    stats: dict[str, RoutingStats] = {}
    ingress = ClusterAdmission(object(), capacity=None, replica_stats=lambda: stats, timeout_s=60.0)
    for rid, replica in sorted(sim.replicas.items()):
        for req in [*replica.waiting, *replica.running.values()]:
            if req.ticket is None:
                asyncio.run(ingress.admit(sla_class=req.sla.name, adapter_id=req.adapter, arrived_at=0.0))
            if req.first_token_at is not None:
                ingress.started(rid, granted=req.ticket is not None)
    stats.update({rid: RoutingStats(num_running=len(r.running), num_waiting=len(r.waiting),
                                    max_num_seqs=r.max_num_seqs) for rid, r in sim.replicas.items()})
    return ingress


def test_the_admission_check_is_the_live_ingress_check(paused: Simulation) -> None:
    policy = paused.policy
    assert isinstance(policy, LoraClusterPolicy)
    for rid in paused.replicas:
        policy.refresh_stats(rid)
    ingress = live_ingress(paused)
    assert policy.has_room() == ingress.has_room(), "fast path or park: simulator and ingress disagree"
    assert not ingress.has_room(), "the fixture is meant to be overloaded"


@pytest.mark.parametrize("window_s", [0.0, 0.002])
def test_the_controller_decides_as_the_live_one_on_the_same_calls(window_s: float) -> None:
    """Replay every controller call of a run through a fresh Controller, reports (full or deltas)
    through the actor's dict path (`parse_report(report.to_dict())`): the same grants, replies and
    refusals; with the default batch window (each input its own batch) and a 2 ms one."""
    sim = Simulation(SimConfig(nodes=5, adapters=40, load=2.0, duration=15, warmup=0, seed=5, max_loras=4,
                               serve=ServeSections().with_fields(controller_batch_window_s=window_s)),
               PROFILE)
    policy = sim.policy
    assert isinstance(policy, LoraClusterPolicy)
    policy.trace = []
    sim.finish()
    now = [0.0]
    live = Controller(CLASSES, policy.controller.settings, clock=lambda: now[0])
    kinds = set()
    for when, name, args, answer in policy.trace:
        now[0] = when
        if name == "report":
            args = (parse_report(args[0].to_dict()), *args[1:])
        got = getattr(live, name)(*args)
        if name == "park_many":  # refusals are errors: compared by kind and text
            got, answer = ([(type(o), str(o)) if isinstance(o, ClusterOverloadedError) else o
                            for o in outcomes] for outcomes in (got, answer))
        assert got == answer, f"{name} at {when:.3f}: {got!r} != {answer!r}"
        kinds.add(name)
    inputs = {"report", "park_many", "tick", "take_grants"} | ({"dispatch"} if window_s else set())
    assert inputs <= kinds, "the run exercised every controller input"
    assert live.counts == policy.controller.counts, "the same counts of grants, preemptions and refusals"
    assert policy.controller.counts["preempting_grants"] > 0, "the run includes preempting grants"


# ----- the replica model ------------------------------------------------------------------------

def one_replica(max_num_seqs: int = 4) -> tuple[EventLoop, SimReplica, list[SimRequest]]:
    loop, done = EventLoop(), []
    profile = dataclasses.replace(PROFILE, max_num_seqs=max_num_seqs)
    replica = SimReplica("r0", profile=profile, max_num_seqs=max_num_seqs, max_loras=2, loop=loop,
                         sizes={"a0": 1 << 20, "a1": 1 << 20}, on_finish=lambda _, r: done.append(r),
                         on_load=lambda _: None)
    return loop, replica, done


def test_a_cold_request_pays_the_s3_fetch_the_copy_the_prefill_and_its_decodes() -> None:
    loop, replica, done = one_replica()
    req = SimRequest(0, "a0", CLASSES.get("standard"), prompt=100, output=5, arrival=0.0, measured=True)
    replica.add(req, 0.0)
    loop.run(until=100.0)
    fetch = PROFILE.fetch_s("s3", 1 << 20)
    prefill = PROFILE.step_s(100, 0, 1) + PROFILE.host_to_device.seconds(1 << 20)
    assert req.first_token_at == pytest.approx(fetch + prefill), "first token: fetch, copy, prefill step"
    decodes = 4 * PROFILE.step_s(0, 1, 1)
    assert req.finish_at == pytest.approx(fetch + prefill + decodes), "then 4 decode steps"
    assert req.hit is False, "the adapter was not on the device when the request arrived"
    assert done == [req], "the replica reported the request finished"


def test_an_urgent_request_preempts_the_least_urgent_one_once_its_patience_ends() -> None:
    loop, replica, done = one_replica(max_num_seqs=1)
    batch = SimRequest(0, "a0", CLASSES.get("batch"), prompt=10, output=5000, arrival=0.0, measured=True)
    urgent = SimRequest(1, "a0", CLASSES.get("interactive"), prompt=10, output=2, arrival=0.0, measured=True)
    replica.add(batch, 0.0)
    loop.run(until=0.5)
    replica.add(urgent, 0.5)
    patience = CLASSES.get("interactive").preempt_after_s(replica.preempt_patience)
    loop.run(until=0.5 + patience - 1e-6)
    assert batch.preemptions == 0, "within the urgent request's patience nobody is preempted"
    loop.run(until=1000.0)
    assert batch.preemptions == 1, "then the batch request is preempted once"
    assert urgent.admitted_at == pytest.approx(0.5 + patience, abs=0.01), (
        "the urgent request runs at the first step boundary after its patience ends")
    assert done[0] is urgent, "the urgent request finished first"
    assert batch.finish_at is not None and batch.first_token_at < urgent.first_token_at, \
        "the batch request kept its first token time and finished after recomputing"


def test_an_urgent_request_takes_a_slot_that_frees_within_its_patience_without_preempting() -> None:
    loop, replica, _ = one_replica(max_num_seqs=1)
    batch = SimRequest(0, "a0", CLASSES.get("batch"), prompt=10, output=20, arrival=0.0, measured=True)
    urgent = SimRequest(1, "a0", CLASSES.get("interactive"), prompt=10, output=2, arrival=0.0, measured=True)
    replica.add(batch, 0.0)
    loop.run(until=100.0, stop=lambda: batch.first_token_at is not None)
    replica.add(urgent, loop.now)
    loop.run(until=100.0)
    assert batch.preemptions == 0, "the batch request ended within the urgent one's patience: no preemption"
    assert urgent.admitted_at == pytest.approx(batch.finish_at), "the urgent request took the freed slot"


def test_an_urgent_prompt_gets_a_step_of_its_own_while_a_long_prompt_waits_a_step() -> None:
    loop, replica, _ = one_replica()
    long = SimRequest(0, "a0", CLASSES.get("standard"), prompt=600, output=2, arrival=0.0, measured=True)
    replica.add(long, 0.0)
    fetched = PROFILE.fetch_s("s3", 1 << 20)
    first_step_end = fetched + PROFILE.step_s(256, 0, 1) + PROFILE.host_to_device.seconds(1 << 20)
    loop.run(until=fetched + 0.01)  # during the long prompt's first 256-token chunk
    urgent = SimRequest(1, "a0", CLASSES.get("interactive"), prompt=10, output=2, arrival=loop.now,
                        measured=True)
    replica.add(urgent, loop.now)
    loop.run(until=100.0)
    assert urgent.first_token_at == pytest.approx(first_step_end + PROFILE.step_s(10, 0, 1)), (
        "the next step computes the interactive prompt alone (replica_policy.prefill_plan), not 246 more "
        "tokens of the long prompt with it")
    assert long.first_token_at > urgent.first_token_at, "the long prompt resumes after it"


def test_a_busy_slot_is_never_evicted() -> None:
    loop, replica, _ = one_replica()
    replica.adapters.max_loras = 1
    first = SimRequest(0, "a0", CLASSES.get("standard"), prompt=10, output=100, arrival=0.0, measured=True)
    other = SimRequest(1, "a1", CLASSES.get("standard"), prompt=10, output=2, arrival=0.0, measured=True)
    replica.add(first, 0.0)
    replica.add(other, 0.0)
    loop.run(until=1.0)
    assert "a0" in replica.adapters.refs and "a1" not in replica.adapters.refs, "a0 stays while it runs"
    loop.run(until=100.0)
    assert other.first_token_at > first.finish_at, "a1 got the slot once a0's request ended"


def test_an_idle_slot_goes_by_load_priority_not_by_recency() -> None:
    loop, done = EventLoop(), []
    sizes = {a: 1 << 20 for a in ("a0", "a1", "a2")}
    replica = SimReplica("r0", profile=PROFILE, max_num_seqs=4, max_loras=2, loop=loop, sizes=sizes,
                         on_finish=lambda _, r: done.append(r), on_load=lambda _: None)
    std = CLASSES.get("standard")
    for i in range(3):
        replica.add(SimRequest(i, "a0", std, prompt=10, output=2, arrival=0.0, measured=True), 0.0)
    loop.run(until=5.0)
    replica.add(SimRequest(3, "a1", std, prompt=10, output=2, arrival=5.0, measured=True), 5.0)
    loop.run(until=10.0)
    assert set(replica.adapters.refs) == {"a0", "a1"}, "both idle in their slots, a0 released first"
    replica.add(SimRequest(4, "a2", std, prompt=10, output=2, arrival=10.0, measured=True), 10.0)
    loop.run(until=20.0)
    assert set(replica.adapters.refs) == {"a0", "a2"}, (
        "a1 (1 request) gave its slot, not a0 (3 requests), though a0 was released longer ago")


def test_preloaded_adapters_are_never_fetched_from_s3() -> None:
    cold = run(SimConfig(**SMALL, load=0.6), PROFILE)
    warm = run(SimConfig(**SMALL, load=0.6, preload=60), PROFILE)
    assert cold.adapter_loads["s3"] > 0, "without preload, first uses come from S3"
    assert warm.adapter_loads["s3"] == 0, "with every adapter preloaded, none comes from S3"
    assert warm.adapter_loads["host"] > 0, "they are copied from host memory"


# ----- whole runs -------------------------------------------------------------------------------

SMALL = dict(nodes=4, adapters=60, duration=20, warmup=5, max_loras=4)


@pytest.mark.parametrize("policy", ["lora-cluster", "round-robin", "serve-multiplex"])
def test_a_small_run_completes_with_sane_numbers(policy: str) -> None:
    result = run(SimConfig(**SMALL, load=0.6, policy=policy), PROFILE)
    offered = sum(c["offered"] for c in result.details["by_class"].values())
    assert result.completed > 30, "requests completed"
    assert result.completed + result.rejected == offered, "every measured request completed or was rejected"
    assert 0.0 <= result.hit_rate <= 1.0, "hit rate is a share"
    assert result.details["unfinished"] == 0, "the drain finished every request"
    for name, c in result.classes.items():
        assert 0.0 <= c["slo_attainment"] <= 1.0, f"{name}: attainment is a share"
        assert 0.0 < c["ttft_p50_s"] <= c["ttft_p99_s"], f"{name}: p50 <= p99"


def test_the_slot_census_accounts_for_every_slot_by_rank_and_state() -> None:
    result = run(SimConfig(**SMALL, load=1.5), PROFILE)
    census = result.details["slot_census"]
    assert census["slots"] == SMALL["nodes"] * SMALL["max_loras"], "every replica's slots are counted"
    assert census["samples"] >= SMALL["duration"] - 1, "one sample per second of the measured period"
    assert list(census["by_rank"]) == ["1-1", "2-4", "5-16", "17+"], (
        "rank buckets end at 1/32, 1/4 and all of the 16 slots, hottest first")
    used = sum(c["running"] + c["cached"] for c in census["by_rank"].values())
    assert 0 < used <= census["slots"], "slots in use, never more than there are"
    assert census["by_rank"]["1-1"]["running"] + census["by_rank"]["1-1"]["cached"] <= SMALL["nodes"], (
        "one adapter holds at most one slot per replica")
    assert census["by_rank"]["17+"]["running"] > 0, "adapters beyond the slots' count still run, in slots"
    joined = result.details["joined_load_rate"]
    assert 0.0 <= joined <= 1.0 - result.hit_rate, "a request that joined a fetch under way is no hit"


def test_completions_by_rank_account_for_every_measured_request_of_each_class() -> None:
    result = run(SimConfig(**SMALL, load=2.0, profile="gpu"), PROFILE)
    by_rank = result.details["completed_by_rank"]
    for name, tally in result.details["by_class"].items():
        cells = by_rank[name]
        assert list(cells) == ["1-1", "2-4", "5-16", "17+"], f"{name}: the census's buckets"
        assert sum(c["offered"] for c in cells.values()) == tally["offered"], f"{name}: every request offered"
        assert sum(c["completed"] for c in cells.values()) == tally["completed"], f"{name}: every completion"
        assert all(c["completed"] <= c["offered"] for c in cells.values()), f"{name}: completed <= offered"
    assert result.rejected > 0, "at twice the rated load some requests are refused"


def test_a_seed_gives_the_same_run() -> None:
    a = run(SimConfig(**SMALL, load=1.5, seed=11), PROFILE)
    b = run(SimConfig(**SMALL, load=1.5, seed=11), PROFILE)
    c = run(SimConfig(**SMALL, load=1.5, seed=12), PROFILE)
    timed = MACHINE_KEYS  # times measured on this machine (CPU seconds in the controller, wall time)
    same = {k: v for k, v in a.to_json().items() if k not in timed}
    assert same == {k: v for k, v in b.to_json().items() if k not in timed}, "same seed, same result"
    assert same != {k: v for k, v in c.to_json().items() if k not in timed}, "another seed, another run"
    reports = a.to_json()["control_plane"]["reports_per_s_per_replica"]
    assert reports == b.to_json()["control_plane"]["reports_per_s_per_replica"], "same seed, same reports"
    assert a.details["controller_counts"] == b.details["controller_counts"], "same controller decisions"


def test_the_command_line_prints_exactly_the_documented_json() -> None:
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        main(["--nodes", "3", "--adapters", "30", "--zipf", "1.1", "--load", "0.8", "--duration", "10",
              "--warmup", "2", "--seed", "1", "--max-loras", "4", "--policy", "serve-multiplex",
              "--profile", "gpu", "--json"])
    result = json.loads(out.getvalue())
    assert set(result) == {"profile", "completed", "rejected", "hit_rate", "adapter_loads", "classes",
                           "wall_s", "sim_cpu_s_per_request", "hit_rate_offered", "psb", "slot_hold_s_mean",
                           "adapters_completed",
                           "slots_total", "max_num_seqs", "window_s", "static_ceiling", "hit_rate_ceiling"}, (
        "top-level keys")
    assert set(result["adapter_loads"]) == {"host", "disk", "peer", "s3"}, "loads by tier"
    assert set(result["classes"]) == {"interactive", "standard", "batch"}, "one entry per class"
    for name, c in result["classes"].items():
        assert set(c) == {"ttft_p50_s", "ttft_p99_s", "slo_attainment", "offered", "completed", "refused"}, (
            f"{name}: class keys")
        assert c["offered"] >= c["completed"] + c["refused"], f"{name}: offered counts every measured request"
    assert result["slots_total"] == 3 * 4, "the cluster's adapter slots: nodes x max_loras"
    assert result["window_s"] == 10, "the measured window is the run's duration after the warm-up"
    assert sum(result["adapters_completed"].values()) == result["completed"], "completed requests by adapter"
    assert result["hit_rate_offered"] <= result["hit_rate"], "a refused request is no hit"
    assert 0.0 < result["psb"] <= 1.0, "the pinned-slot bound is a share"
    assert 0.0 < result["static_ceiling"] <= 1.0, "the static ceiling is a share"


def test_without_a_profile_flag_the_command_line_simulates_gpu_nodes_and_says_so() -> None:
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        main(["--nodes", "2", "--adapters", "10", "--load", "0.5", "--duration", "3", "--warmup", "1",
              "--max-loras", "4", "--json"])
    result = json.loads(out.getvalue())
    assert result["profile"] == "gpu-papers", "the default profile is the GPU one, named in the JSON"
    assert SimConfig().profile == "gpu", "a SimConfig without a profile plans GPU nodes too"


def test_an_explicit_cpu_profile_is_run_and_reported() -> None:
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        main(["--nodes", "2", "--adapters", "10", "--load", "0.5", "--duration", "3", "--warmup", "1",
              "--max-loras", "4", "--profile", "cpu", "--json"])
    assert json.loads(out.getvalue())["profile"] == "cpu-measured", "--profile cpu runs the measured profile"


def _grid_run(policy: str, *, load: float, hit: float, interactive: float, batch_p99: float | None) -> dict:
    return {"cell": {"nodes": 2, "adapters": 10, "zipf": 1.0, "load": load, "seed": 0}, "policy": policy,
            "result": {"hit_rate": hit, "classes": {"interactive": {"slo_attainment": interactive},
                                                    "standard": {"slo_attainment": 1.0},
                                                    "batch": {"ttft_p99_s": batch_p99}}},
            "details": {"hit_rate_ceiling": 0.9, "profile": "gpu-papers",
                        "by_class": {"batch": {"offered": 10, "completed": 10}}}}


def test_a_grid_cell_passes_only_when_every_target_is_met() -> None:
    from lora_cluster.sim.grid import verdict

    base = [_grid_run("serve-multiplex", load=1.0, hit=0.3, interactive=0.5, batch_p99=10.0),
            _grid_run("round-robin", load=1.0, hit=0.25, interactive=0.4, batch_p99=10.0)]
    good = verdict([_grid_run("lora-cluster", load=1.0, hit=0.88, interactive=0.995, batch_p99=30.0), *base])
    assert good["passed"], f"every target met: {good['checks']}"
    low_hits = verdict([_grid_run("lora-cluster", load=1.0, hit=0.85, interactive=1.0, batch_p99=30.0),
                        *base])
    assert not low_hits["checks"]["hit_rate"], "85% hits is under 97% of a 90% ceiling"
    late = verdict([_grid_run("lora-cluster", load=1.0, hit=0.88, interactive=1.0, batch_p99=61.0), *base])
    assert not late["checks"]["batch_wait"], "a batch p99 wait over 60 s at 1x fails"
    over = verdict([_grid_run("lora-cluster", load=2.0, hit=0.88, interactive=1.0, batch_p99=61.0),
                    _grid_run("serve-multiplex", load=2.0, hit=0.3, interactive=0.5, batch_p99=1.0)])
    assert over["checks"]["batch_wait"], "the batch wait target holds up to the rated load only"
    behind = verdict([_grid_run("lora-cluster", load=1.0, hit=0.88, interactive=0.99, batch_p99=1.0),
                      _grid_run("serve-multiplex", load=1.0, hit=0.3, interactive=1.0, batch_p99=1.0)])
    assert not behind["checks"]["baselines"], "a baseline with more interactive attainment is ahead"


def test_the_grid_command_runs_every_policy_per_cell_on_the_gpu_profile_and_judges_it(tmp_path) -> None:
    from lora_cluster.sim.experiments import main as experiments

    out, save = io.StringIO(), tmp_path / "grid.json"
    with contextlib.redirect_stdout(out):
        code = experiments(["grid", "--sizes", "2x10", "--zipfs", "1", "--loads", "0.5,1", "--seeds", "0",
                            "--duration", "3", "--warmup", "1", "--max-loras", "4", "--workers", "1",
                            "--save", str(save)])
    text = out.getvalue()
    assert text.startswith("profile gpu-papers (--profile gpu)"), "the table says which profile it ran"
    rows = [line for line in text.splitlines() if line.startswith("| 2 x 10 |")]
    assert len(rows) == 2, "one row per cell (two loads)"
    verdicts = [row.rstrip(" |").rsplit("| ", 1)[1] for row in rows]
    assert all(v == "pass" or v.startswith("FAIL: ") for v in verdicts), f"each row's verdict: {verdicts}"
    runs = json.loads(save.read_text())
    policies = sorted(["lora-cluster", "serve-multiplex", "round-robin"] * 2)
    assert sorted(r["policy"] for r in runs) == policies, "every cell runs lora-cluster and both baselines"
    assert code == (0 if verdicts == ["pass", "pass"] else 1), "exit status 1 exactly when a cell fails"


def test_the_simulation_runs_under_the_controllers_collector_threshold_and_restores_the_processs():
    before = gc.get_threshold()
    serve = ServeSections().with_fields(controller_gc_threshold=23456)
    sim = Simulation(SimConfig(nodes=2, adapters=5, load=0.5, duration=2, warmup=0, seed=1, serve=serve),
                     PROFILE)
    seen: list[int] = []
    sim.loop.at(1.0, lambda: seen.append(gc.get_threshold()[0]))
    sim.advance(1.5)
    assert seen == [23456], "the controller's calls run under its process's young threshold"
    assert gc.get_threshold() == before, "the process's thresholds are restored after the run"
