"""Work-conserving adapter protection: the real scheduler, slot pool and residency under random
arrivals on a fake clock; protection chooses (victims, cold-load order, short holds) and never idles."""

from __future__ import annotations

import random
import threading
from concurrent.futures import ALL_COMPLETED, wait
from typing import Any

import torch
from helpers import FakeClock, FakeLoader
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from lora_cluster.adapter_format import LoraWeights, ModelShapes
from lora_cluster.config import EngineConfig
from lora_cluster.engine.adapters.demand import DemandTracker
from lora_cluster.engine.adapters.fetch_queue import PREFETCH, FetchQueue
from lora_cluster.engine.adapters.guard import AdapterGuard
from lora_cluster.engine.adapters.pool import AdapterPool
from lora_cluster.engine.adapters.residency import AdapterResidency
from lora_cluster.engine.adapters.rotation import AdapterRotation
from lora_cluster.engine.sample.detokenizer import IncrementalDetokenizer
from lora_cluster.engine.schedule.scheduler import Scheduler
from lora_cluster.engine.schedule.sequence import Sequence
from lora_cluster.request.sampling_params import SamplingParams

SHAPES = ModelShapes(1, {"q_proj": (4, 6)})
STEP_S = 0.05  # fake seconds per engine step
WAIT_BOUNDS = {0: 1.0, 1: 4.0}  # adapter wait bound per priority (the SLA classes' share)


class MemoryLoader(FakeLoader):
    """An `EnginePort` whose adapters are tiny tensors made on request (every id exists), each
    load taking `delay_s` (the replica measures its load time from it)."""

    def __init__(self, delay_s: float = 0.0):
        self.delay_s = delay_s

    def load(self, adapter_id: str) -> LoraWeights:
        if self.delay_s:
            threading.Event().wait(self.delay_s)
        return LoraWeights(adapter_id, 2, frozenset({"q_proj"}), {"q_proj": 1.0},
                           {(0, "q_proj"): torch.ones(2, 4)}, {(0, "q_proj"): torch.ones(6, 2)})


class Replica:
    """The engine's step loop without a model: each scheduled token is computed at once."""

    def __init__(self, clock: FakeClock, slots: int, protect: bool = True, load_s: float = 0.0):
        self.clock = clock
        self.pool = AdapterPool(SHAPES, num_slots=slots, max_rank=4, dtype=torch.float32,
                                device=torch.device("cpu"), clock=clock)
        guard = AdapterGuard(EngineConfig(model="unused", breakers=protect), clock)
        rotation = AdapterRotation(min_steps=2, wait_bounds_s=WAIT_BOUNDS, clock=clock)
        loader = MemoryLoader(load_s)
        self.adapters = AdapterResidency(loader, loader, self.pool, 2, guard, rotation=rotation, clock=clock)
        self.scheduler = Scheduler(max_num_seqs=256, max_num_batched_tokens=4096, max_waiting=4096,
                                   acquire=self.adapters.acquire, release=self.adapters.release,
                                   slot_to_preempt=self.adapters.slot_to_preempt)
        self.finished: set[str] = set()
        self.max_tokens: dict[str, int] = {}

    def add(self, rid: str, adapter_id: str, priority: int, prompt: int, tokens: int) -> None:
        seq = Sequence(rid, adapter_id, list(range(1, prompt + 1)), SamplingParams(),
                       IncrementalDetokenizer(None), None, priority=priority, arrival=self.clock())
        self.scheduler.add(seq)
        self.adapters.request_started(adapter_id, priority)
        self.max_tokens[rid] = tokens

    def step(self) -> Any:
        wait(self.adapters.pending(), timeout=10, return_when=ALL_COMPLETED)  # fetches are instant here
        out = self.scheduler.schedule()
        violation = self.violation(out)
        self.adapters.end_step(self.scheduler.waiting)
        for seq in out.decodes:
            seq.num_computed += 1
        for seq, n in out.prefills:
            seq.num_computed += n
        for seq in [*out.decodes, *(s for s, n in out.prefills if not s.in_prefill)]:
            seq.output_ids.append(1)
            if len(seq.output_ids) >= self.max_tokens[seq.request_id]:
                self.scheduler.finish(seq)
                self.adapters.request_finished(seq.adapter_id, seq.priority)
                self.finished.add(seq.request_id)
        self.clock.now += STEP_S
        return violation

    def violation(self, out: Any) -> str | None:
        """What idles capacity after this step's admission, if anything (None: nothing)."""
        waiting = [s for s in self.scheduler.waiting if self.pool.slot_of(s.adapter_id) is None]
        if not waiting:
            return None
        resident = self.pool.resident()
        if len(resident) < self.pool.num_slots:
            return f"an empty slot while {waiting[0].request_id} waits for {waiting[0].adapter_id}"
        demand: DemandTracker = self.adapters.demand
        idle_unwanted = [a for a in resident
                         if self.pool.refs(a) == 0 and self.adapters.most_urgent(a) >= PREFETCH]
        if any(not demand.repeated(a) for a in idle_unwanted):
            return f"an idle one-off's slot while {waiting[0].request_id} waits"
        if idle_unwanted:  # held: only one-offs, within their bound, while the batch runs
            for s in waiting:
                if demand.repeated(s.adapter_id):
                    return f"{s.request_id} of repeated adapter {s.adapter_id} waits by an idle unwanted slot"
                if self.clock() - s.arrival > self.adapters.hold_bound(s.priority) + STEP_S:
                    return f"{s.request_id} held past its bound"
            if out.empty:
                return "a hold while the batch is empty"
        return None


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(seed=st.integers(0, 2**32 - 1), slots=st.integers(2, 6), adapters=st.integers(4, 60),
       rate=st.floats(0.5, 4.0), one_offs=st.floats(0.0, 0.6))
def test_no_step_idles_a_slot_while_a_request_waits_and_every_request_completes(
        seed: int, slots: int, adapters: int, rate: float, one_offs: float) -> None:
    rng = random.Random(seed)
    clock = FakeClock()
    replica = Replica(clock, slots)
    weights = [1.0 / (i + 1) for i in range(adapters)]  # Zipf 1.0
    n, cold = 0, 0
    for step in range(400):
        arrivals = sum(1 for _ in range(8) if rng.random() < rate / 8)
        for _ in range(arrivals):
            if rng.random() < one_offs:
                adapter, cold = f"cold-{cold}", cold + 1
            else:
                adapter = f"a{rng.choices(range(adapters), weights)[0]}"
            replica.add(f"r{n}", adapter, rng.choice((0, 0, 1)), rng.randint(1, 12), rng.randint(1, 8))
            n += 1
        violation = replica.step()
        assert violation is None, f"step {step}: {violation}"
    for step in range(4000):
        if len(replica.finished) == n:
            break
        violation = replica.step()
        assert violation is None, f"drain step {step}: {violation}"
    assert len(replica.finished) == n, f"{n - len(replica.finished)} of {n} requests never completed"
    replica.adapters.close()


def test_a_one_off_takes_an_idle_one_offs_slot_before_a_repeated_adapters() -> None:
    clock = FakeClock()
    replica = Replica(clock, slots=2)
    for i in range(2):
        replica.add(f"hot{i}", "hot", 0, 1, 1)
        replica.step()
    replica.add("once", "once", 0, 1, 1)
    replica.step()
    assert set(replica.pool.resident()) == {"hot", "once"}, "both ran and stay resident while idle"
    replica.add("new", "new", 0, 1, 1)
    replica.step()
    assert set(replica.pool.resident()) == {"hot", "new"}, "the one-off's slot went first"
    replica.adapters.close()


def test_a_one_off_is_held_while_a_one_offs_slot_frees_anyway_then_placed_within_its_bound() -> None:
    clock = FakeClock()
    replica = Replica(clock, slots=2, load_s=0.05)  # holds last at most 2 loads: about 2 steps
    for i in range(2):
        replica.add(f"hot{i}", "hot", 0, 1, 1)
        replica.step()
    replica.add("long", "long", 0, 1, 40)  # a one-off that keeps its slot busy
    replica.step()
    replica.add("new", "new", 0, 1, 1)
    replica.step()
    assert replica.pool.slot_of("new") is None, "held: the repeated adapter's idle slot is spared"
    assert replica.pool.slot_of("hot") is not None, "the repeated adapter is still resident"
    steps = 0
    while replica.pool.slot_of("new") is None and "new" not in replica.finished:
        replica.step()
        steps += 1
    bound_steps = round(replica.adapters.hold_bound(0) / STEP_S) + 1
    assert steps <= bound_steps, f"placed within its hold bound ({steps} steps, bound {bound_steps})"
    replica.adapters.close()


def test_without_protection_the_lru_slot_goes_whatever_its_demand() -> None:
    clock = FakeClock()
    replica = Replica(clock, slots=2, protect=False)
    for i in range(2):
        replica.add(f"hot{i}", "hot", 0, 1, 1)
        replica.step()
    replica.add("once", "once", 0, 1, 1)
    replica.step()
    replica.add("new", "new", 0, 1, 1)
    replica.step()
    assert set(replica.pool.resident()) == {"once", "new"}, "breakers: false: plain LRU"
    replica.adapters.close()


def test_cold_fetches_queue_behind_warm_ones_and_leave_a_worker_for_them() -> None:
    release, started = threading.Event(), []
    lock = threading.Lock()

    def fetch(key: str) -> str:
        with lock:
            started.append(key)
        release.wait(10)
        return key

    queue = FetchQueue(2, max_prefetches=4)
    queue.limit_cold(1)  # as while the replica thrashes
    futures = [queue.submit(fetch, f"cold{i}", 0, cold=True) for i in range(3)]
    futures.append(queue.submit(fetch, "warm", 0))
    for _ in range(1000):  # both workers take a fetch at once; bounded
        with lock:
            if len(started) == 2:
                break
        threading.Event().wait(0.01)
    assert queue.queued() == ["cold1", "cold2"], "the warm fetch took the worker the cold ones may not hold"
    release.set()
    wait(futures, timeout=10)
    assert started[:2] in (["cold0", "warm"], ["warm", "cold0"]), f"one cold fetch at a time: {started}"
    queue.close()


def test_fetch_timings_written_by_the_workers_never_break_the_step_loop() -> None:
    pool = AdapterPool(SHAPES, num_slots=2, max_rank=4, dtype=torch.float32, device=torch.device("cpu"))
    loader = MemoryLoader()
    adapters = AdapterResidency(loader, loader, pool, 4, AdapterGuard(EngineConfig(model="unused")))
    try:
        for n in range(20_000):  # bounded; without the lock the race showed within this many rounds
            batch = [f"x{n}-{i}" for i in range(8)]
            for adapter_id in batch:
                adapters.request_started(adapter_id, 0)
            adapters.end_step()  # reads the fetch timings while the loader workers write them
            for adapter_id in batch:
                adapters.request_finished(adapter_id, 0)
    finally:
        adapters.close()
