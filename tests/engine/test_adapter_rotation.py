"""Adapter rotation: the pure policy (injected clock) and the engine under it (no starvation, no thrash,
device copies off the step thread)."""

from __future__ import annotations

from collections import defaultdict

import pytest
from helpers import FakeClock, greedy

from lora_cluster.engine import Engine, SamplingParams
from lora_cluster.engine.adapters.rotation import AdapterRotation, Resident, RotationSlotPolicy, Waiting
from lora_cluster.store.folder_loader import FolderAdapterLoader


def _rotation(clock: FakeClock, min_steps: int = 2, **kw: object) -> AdapterRotation:
    return AdapterRotation(min_steps=min_steps, wait_bounds_s={0: 1.0, 1: 5.0}, default_wait_s=30.0,
                           clock=clock, **kw)


def _run(rot: AdapterRotation, adapters: list[str], steps: int) -> None:
    for _ in range(steps):
        rot.ran(adapters)


def test_no_drain_before_the_fairness_bound():
    clock = FakeClock(100.0)
    rot = _rotation(clock)
    for a in ("r1", "r2"):
        rot.placed(a)
    _run(rot, ["r1", "r2"], 5)
    queue = [Waiting("r1", 0, 100.0), Waiting("w", 0, 100.0)]
    resident = {"r1": Resident(busy=True), "r2": Resident(busy=True)}
    clock.now = 100.9
    assert rot.plan(queue, resident, 0).draining == frozenset(), "w has not waited past its 1 s bound yet"
    clock.now = 101.0
    plan = rot.plan([*queue, Waiting("r2", 0, 100.5)], resident, 0)
    assert plan.overdue == ("w",), "w is overdue once its oldest request waited its class's bound"
    assert len(plan.draining) == 1, "exactly one resident adapter is drained for one overdue adapter"


def test_a_free_slot_means_no_drain():
    clock = FakeClock(100.0)
    rot = _rotation(clock)
    rot.placed("r1")
    _run(rot, ["r1"], 5)
    clock.now = 200.0
    plan = rot.plan([Waiting("r1", 0, 150.0), Waiting("w", 0, 150.0)], {"r1": Resident(busy=True)}, 1)
    assert plan.draining == frozenset(), "an available slot takes the overdue adapter without draining anyone"


def test_busy_adapters_nobody_waits_for_count_as_freeing_up():
    clock = FakeClock(100.0)
    rot = _rotation(clock)
    rot.placed("r1")
    _run(rot, ["r1"], 5)
    clock.now = 200.0
    plan = rot.plan([Waiting("w", 0, 150.0)], {"r1": Resident(busy=True)}, 0)
    assert plan.draining == frozenset(), "r1 has no waiting request: its slot frees up when it finishes"


def test_drains_the_adapter_placed_earliest_round_robin():
    clock = FakeClock(100.0)
    rot = _rotation(clock)
    rot.placed("old")
    clock.now = 101.0
    rot.placed("new")
    _run(rot, ["old", "new"], 3)
    clock.now = 200.0
    queue = [Waiting("old", 0, 190.0), Waiting("new", 0, 190.0), Waiting("w", 0, 150.0)]
    resident = {"old": Resident(busy=True), "new": Resident(busy=True)}
    assert rot.plan(queue, resident, 0).draining == frozenset({"old"}), "the longest-resident adapter yields"


def test_never_thrash_an_adapter_before_its_minimum_steps():
    clock = FakeClock(100.0)
    rot = _rotation(clock, min_steps=4)
    rot.placed("r1")
    _run(rot, ["r1"], 3)
    clock.now = 200.0
    queue = [Waiting("r1", 0, 199.0), Waiting("w", 0, 150.0)]
    resident = {"r1": Resident(busy=True)}
    assert rot.plan(queue, resident, 0).draining == frozenset(), (
        "an adapter that ran 3 of its minimum 4 steps keeps its slot even for an overdue adapter"
    )
    rot.ran(["r1"])
    assert rot.plan(queue, resident, 0).draining == frozenset({"r1"}), "after 4 steps it may be drained"
    rot.removed("r1")
    rot.placed("r1")
    assert rot.steps_run("r1") == 0, "a new placement starts a new minimum run"


def test_more_urgent_and_pinned_adapters_are_not_drained():
    clock = FakeClock(100.0)
    rot = _rotation(clock)
    for a in ("urgent", "pinned"):
        rot.placed(a)
    _run(rot, ["urgent", "pinned"], 5)
    clock.now = 200.0
    queue = [Waiting("urgent", 0, 199.0), Waiting("pinned", 1, 199.0), Waiting("w", 1, 150.0)]
    resident = {"urgent": Resident(busy=True), "pinned": Resident(busy=True, pinned=True)}
    assert rot.plan(queue, resident, 0).draining == frozenset(), (
        "a priority-1 adapter drains neither an adapter with a priority-0 request nor a pinned one"
    )


def test_fairness_bound_follows_the_class():
    clock = FakeClock(100.0)
    rot = _rotation(clock)
    clock.now = 102.0
    queue = [Waiting("i", 0, 100.0), Waiting("s", 1, 100.0), Waiting("b", 7, 100.0)]
    assert rot.plan(queue, {}, 0).overdue == ("i",), "2 s is past the 1 s bound of priority 0 only"
    clock.now = 131.0
    assert rot.plan(queue, {}, 0).overdue == ("i", "s", "b"), "priorities without a bound use the default"


def test_prefetch_lists_the_next_absent_adapters_in_queue_order():
    clock = FakeClock(100.0)
    rot = _rotation(clock, prefetch_depth=2)
    queue = [Waiting("r", 0, 100.0), Waiting("x", 0, 100.0), Waiting("x", 0, 100.0), Waiting("y", 1, 100.0),
             Waiting("z", 1, 100.0)]
    plan = rot.plan(queue, {"r": Resident(busy=False)}, 0)
    assert plan.prefetch == ("x", "y"), "the first two distinct adapters not on the device, in urgency order"


def test_slot_policy_protects_wanted_adapters_unless_draining():
    clock = FakeClock(100.0)
    rot = _rotation(clock)
    wanted, draining = {"a", "b"}, {"b"}
    policy = RotationSlotPolicy(None, rot, wanted.__contains__, draining.__contains__)
    assert policy.protected("a"), "an adapter with an unfinished request is not a victim"
    assert not policy.protected("b"), "a draining adapter is a victim once idle"
    assert not policy.protected("c"), "an adapter nobody waits for is a victim"
    policy.on_device("a", True)
    rot.ran(["a"])
    assert rot.steps_run("a") == 1, "placements reach the rotation through the slot policy"
    policy.on_device("a", False)
    assert len(rot) == 0, "removals too: rotation keeps state for resident adapters only"


# ----- the engine under rotation ------------------------------------------------------------------


class RecordingLoader(FolderAdapterLoader):
    """The folder loader, with a slot policy that records device placements and removals by step."""

    def __init__(self, *args: object) -> None:
        super().__init__(*args)
        self.step = 0
        self.events: list[tuple[int, str, bool]] = []

    def slot_policy(self) -> RecordingLoader:
        return self

    def protected(self, adapter_id: str) -> bool:
        return False

    def priority(self, adapter_id: str) -> float:
        return 0.0

    def on_device(self, adapter_id: str, resident: bool) -> None:
        self.events.append((self.step, adapter_id, resident))


def _engine(make_engine, adapters_dir, **overrides: object) -> tuple[Engine, RecordingLoader]:
    holder: dict[str, RecordingLoader] = {}

    def factory(config, shapes, device):
        holder["loader"] = RecordingLoader([str(adapters_dir)], shapes, config.max_lora_rank)
        return holder["loader"]

    engine = make_engine(adapter_source=str(adapters_dir), adapter_loader=factory, breakers=False,
                         **overrides)  # the switch-rate breaker is tested on its own
    return engine, holder["loader"]


def _drive(engine: Engine, loader: RecordingLoader, arrivals: dict[int, list[tuple[str, str]]],
           max_steps: int, until: str | None = None) -> tuple[dict[str, int], dict[int, set[str]]]:
    """Step the engine, adding `arrivals[step]` (request id, adapter) before each step, until every
    request (or request `until`) finished; returns the step at which each request finished and the
    adapters that produced tokens at each step."""
    params = greedy(6)
    adapter_of: dict[str, str] = {}
    finished: dict[str, int] = {}
    ran: dict[int, set[str]] = defaultdict(set)
    for step in range(max_steps):
        loader.step = step
        for rid, adapter in arrivals.get(step, []):
            engine.add_request(rid, "the river runs", adapter, params)
            adapter_of[rid] = adapter
        for out in engine.step():
            ran[step].add(adapter_of[out.request_id])
            if out.finished:
                finished[out.request_id] = step
        if until in finished or (not engine.has_unfinished() and step > max(arrivals)):
            break
    return finished, ran


def test_a_cold_adapter_is_not_starved_by_hot_ones(make_engine, demo_adapters_dir):
    engine, loader = _engine(make_engine, demo_adapters_dir, max_loras=2, max_num_seqs=4,
                             adapter_min_steps=2, adapter_max_wait_s=0.05)
    try:
        hot = {s: [(f"h{s}-{i}", f"a{i}") for i in (1, 2)] for s in range(0, 80, 2)}  # always queued
        hot[1] = [("cold", "a3")]
        finished, _ = _drive(engine, loader, hot, max_steps=400, until="cold")
    finally:
        engine.close()
    last_hot_arrival = max(s for s, reqs in hot.items() if reqs[0][0] != "cold")
    assert "cold" in finished, "the cold adapter's request completes"
    assert finished["cold"] < last_hot_arrival, (
        "it completes while the hot adapters still receive requests: rotation hands it a slot"
    )


def test_no_thrash_each_placement_runs_its_minimum_steps(make_engine, demo_adapters_dir):
    min_steps = 3
    engine, loader = _engine(make_engine, demo_adapters_dir, max_loras=2, max_num_seqs=4,
                             adapter_min_steps=min_steps, adapter_max_wait_s=0.01)
    try:
        arrivals = {s: [(f"r{s}-{k}", f"a{(s + k) % 6}") for k in range(2)] for s in range(0, 24, 2)}
        finished, ran = _drive(engine, loader, arrivals, max_steps=600)
    finally:
        engine.close()
    assert len(finished) == sum(len(v) for v in arrivals.values()), "every request completes"
    placed_at: dict[str, int] = {}
    for step, adapter, resident in loader.events:
        if resident:
            placed_at[adapter] = step
            continue
        start = placed_at.pop(adapter)
        steps_run = sum(1 for s in range(start, step + 1) if adapter in ran[s])
        left = [r for r, a in ((r, a) for v in arrivals.values() for r, a in v)
                if a == adapter and finished.get(r, 10**9) > step]
        assert steps_run >= min_steps or not left, (
            f"{adapter} placed at step {start} ran {steps_run} steps before losing its slot at step {step} "
            f"while {len(left)} of its requests were unfinished (minimum {min_steps})"
        )
    placements = sum(1 for _, _, resident in loader.events if resident)
    assert placements < len(finished), "requests of an adapter share its placements (grouping)"


def test_async_device_copies_give_the_same_tokens(make_engine):
    prompts, adapters = ["the cat sat"] * 6, [f"a{i}" for i in range(5)] + [None]
    greedy = SamplingParams(max_new_tokens=8, temperature=0.0, ignore_eos=True)
    results = {}
    for copy_bytes in (0, 1 << 40):  # every copy off the step thread / every copy inline
        engine = make_engine(max_loras=2, max_num_seqs=3, adapter_async_copy_bytes=copy_bytes, breakers=False)
        try:
            results[copy_bytes] = [o.token_ids for o in engine.generate(prompts, adapter_ids=adapters,
                                                                         sampling=greedy)]
        finally:
            engine.close()
    assert results[0] == results[1 << 40], "copying adapters on the copy thread changes no token"


@pytest.fixture(autouse=True)
def _no_env_overrides(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("LORA_CLUSTER_ADAPTER_MIN_STEPS", "LORA_CLUSTER_ADAPTER_MAX_WAIT_S"):
        monkeypatch.delenv(name, raising=False)
