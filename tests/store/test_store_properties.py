"""Property tests of the cache tiers (hypothesis): byte budgets are never exceeded, an adapter in use
or pinned is never evicted (host, disk and device tiers), and the lifecycle never skips a state."""

from __future__ import annotations

import tempfile
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from remote_sources import FolderAsRemote

from lora_cluster.adapter_format import LoraWeights, ModelShapes
from lora_cluster.engine.adapters.pool import AdapterPool
from lora_cluster.engine.model.model_loader import load_base_model
from lora_cluster.replica_policy.eviction import AccessTracker
from lora_cluster.store import TRANSITIONS, AdapterState, Lifecycle, TieredAdapterStore
from lora_cluster.store.admission import AdmissionPolicy
from lora_cluster.store.lifecycle import LifecycleError
from lora_cluster.store.tier import TierIndex
from lora_cluster.store.usage import AdapterUsage

S = AdapterState
IDS = [f"a{i}" for i in range(8)]
PINNED = "a5"
FAST = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def assert_no_skipped_promotion(log) -> None:
    for adapter_id, old, new in log:
        assert new in TRANSITIONS[old], f"{adapter_id}: {old.name} -> {new.name} is not an allowed transition"
        if old is not S.FAILED and new is not S.FAILED and new > old:
            assert new == old + 1, f"{adapter_id}: {old.name} -> {new.name} skips a tier"


# ----- one tier's index ----------------------------------------------------------------------

TIER_OPS = ["admit", "lease", "release", "protect", "unprotect", "remove"]
tier_ops = st.lists(st.tuples(st.sampled_from(TIER_OPS), st.integers(0, 9), st.integers(1, 400)), max_size=60)


@FAST
@given(tier_ops)
def test_tier_index_budget_and_protection(ops):
    protected: set[str] = set()
    index = TierIndex(1000, protected=protected.__contains__, priority=lambda a: hash(a) % 7 / 7)
    for op, n, size in ops:
        key = f"k{n}"
        before = {k: (e.leases, k in protected) for k, e in index.entries.items()}
        if op == "admit":
            evicted = index.admit(key, key, size, reload_cost_s=size / 100)
            if evicted is None:
                assert set(index.entries) == set(before), f"refusing {key} must not change the entries"
            else:
                assert key in index, f"an admitted {key} is in the index"
                for victim in evicted:
                    leases, was_protected = before[victim.key]
                    assert not leases, f"evicted {victim.key} while it was leased"
                    assert not was_protected, f"evicted {victim.key} while it was protected"
        elif op == "lease":
            index.lease(key)
        elif op == "release":
            index.release(key)
        elif op == "protect":
            protected.add(key)
        elif op == "unprotect":
            protected.discard(key)
        else:
            index.remove(key)
        assert index.bytes == sum(e.nbytes for e in index.entries.values()), "bytes is the sum of the entries"
        assert index.bytes <= index.budget, f"{index.bytes} bytes exceed the budget of {index.budget}"


# ----- the lifecycle alone -----------------------------------------------------------------

life_ops = st.lists(st.tuples(st.sampled_from(["promote", "settle", "fail"]), st.sampled_from(IDS[:3]),
                              st.sampled_from(list(S))), max_size=40)


@FAST
@given(life_ops, st.sampled_from([S.REMOTE, S.ON_DISK]))
def test_lifecycle_refuses_skips_and_logs_only_allowed_transitions(ops, floor):
    life = Lifecycle()
    for adapter_id in IDS[:3]:
        life.ensure(adapter_id, floor)
    for op, adapter_id, target in ops:
        before = life.state(adapter_id)
        if op == "promote" and target is not S.FAILED:
            start = floor if before is S.FAILED else before
            if target > start + 1:
                with pytest.raises(LifecycleError, match="skips a tier"):
                    life.promote(adapter_id, target)
                continue
            life.promote(adapter_id, target)
            assert life.state(adapter_id) == max(start, target), f"promote({target.name}) from {before.name}"
        elif op == "settle" and target is not S.FAILED:
            life.settle(adapter_id, target)
            if before is not S.FAILED:
                assert life.state(adapter_id) >= min(before, max(target, floor)), \
                    f"settle({target.name}) from {before.name} dropped below the tier that holds the adapter"
        elif op == "fail":
            life.fail(adapter_id)
        assert life.state(adapter_id) is S.FAILED or life.state(adapter_id) >= floor, \
            f"{adapter_id} is {life.state(adapter_id).name}, below its floor {floor.name}"
    assert_no_skipped_promotion(life.log)


# ----- the whole store: host + disk tiers, device events, in-use and pinned adapters -------------

store_ops = st.lists(st.tuples(st.sampled_from(["load", "start", "finish", "place", "unplace", "invalidate"]),
                               st.sampled_from(IDS)), min_size=1, max_size=30)


@pytest.fixture(scope="module")
def shapes(demo_model_dir: Path) -> ModelShapes:
    return load_base_model(str(demo_model_dir), dtype=torch.float32, device=torch.device("cpu")).dims.shapes()


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow,
                                                                  HealthCheck.function_scoped_fixture])
@given(ops=store_ops, host_budget=st.sampled_from([0, 120_000, 300_000]),
       disk_budget=st.sampled_from([0, 150_000, 400_000]))
def test_store_budgets_in_use_pinned_and_lifecycle(demo_adapters_dir, shapes, ops, host_budget, disk_budget):
    with tempfile.TemporaryDirectory() as tmp:
        store = TieredAdapterStore([FolderAsRemote(demo_adapters_dir)], AdmissionPolicy(shapes, 64),
                                   host_cache_bytes=host_budget, disk_cache_dir=tmp,
                                   disk_cache_bytes=disk_budget, pinned=[PINNED])
        store.wait_prefetches()
        placed: set[str] = set()
        for op, adapter_id in ops:
            keep = {a for a in IDS if store.usage.protected(a)}
            keep -= {adapter_id} if op == "invalidate" else set()
            in_host = {a for a in keep if a in store.host}
            on_disk = {a for a in keep if store.disk.adapter_keys(a)}
            if op == "load":
                assert store.load(adapter_id).adapter_id == adapter_id, "load returns the asked adapter"
            elif op == "start":
                store.usage.request_started(adapter_id)
            elif op == "finish":
                store.usage.request_finished(adapter_id)
            elif op == "place" and adapter_id not in placed and store.state(adapter_id) is not None:
                store.load(adapter_id)  # the engine places only weights it got from the loader
                store.usage.on_device(adapter_id, True)
                placed.add(adapter_id)
            elif op == "unplace" and adapter_id in placed:
                store.usage.on_device(adapter_id, False)
                placed.discard(adapter_id)
            elif op == "invalidate":
                store.invalidate(adapter_id)
            assert store.host.bytes <= host_budget, f"host holds {store.host.bytes} bytes > {host_budget}"
            assert store.disk.bytes <= disk_budget, f"disk holds {store.disk.bytes} bytes > {disk_budget}"
            assert in_host <= {a for a in IDS if a in store.host}, "evicted an in-use adapter from host"
            assert on_disk <= {a for a in IDS if store.disk.adapter_keys(a)}, "evicted in-use from disk"
            for a, state in store.lifecycle.states().items():
                assert_state_is_fastest_tier(store, a, state, a in placed)
        assert_no_skipped_promotion(store.lifecycle.log)
        store.close()


def assert_state_is_fastest_tier(store: TieredAdapterStore, adapter_id: str, state: AdapterState,
                                 placed: bool) -> None:
    """The lifecycle state is the fastest tier holding a copy, as the tiers' public views show it, for
    a store whose sources are all remote (IN_HOST without a host copy is allowed: weights handed to
    the engine and not yet placed)."""
    assert (state is S.ON_DEVICE) == placed, f"{adapter_id} is {state.name} but placed={placed}"
    if state in (S.ON_DEVICE, S.FAILED):
        return
    if adapter_id in store.host:
        assert state is S.IN_HOST, f"{adapter_id} has a host copy but is {state.name}"
    if state is S.ON_DISK:
        assert store.disk.adapter_keys(adapter_id), f"{adapter_id} is ON_DISK without a disk copy"
    if state is S.REMOTE:
        assert not store.disk.adapter_keys(adapter_id), f"{adapter_id} is REMOTE but has a disk copy"


# ----- the device pool with the store's slot policy ------------------------------------------

pool_ops = st.lists(st.tuples(st.sampled_from(["request", "run", "finish_running", "finish_queued"]),
                              st.sampled_from(IDS)), max_size=50)


def _tiny(adapter_id: str) -> LoraWeights:
    return LoraWeights(adapter_id, 2, frozenset({"q_proj"}), {"q_proj": 1.0},
                       {(0, "q_proj"): torch.ones(2, 4)}, {(0, "q_proj"): torch.ones(4, 2)})


@FAST
@given(pool_ops)
def test_device_pool_never_evicts_pinned_queued_or_running(ops):
    evicted: list[str] = []
    usage = AdapterUsage(AccessTracker(60, 4), pinned=[PINNED],
                         on_residency=lambda a, resident: resident or evicted.append(a))
    pool = AdapterPool(ModelShapes(1, {"q_proj": (4, 4)}), num_slots=3, max_rank=4, dtype=torch.float32,
                       device=torch.device("cpu"), policy=usage)
    queued: dict[str, int] = {}
    running: list[tuple[str, int]] = []  # (adapter, slot) of each running request
    for op, adapter_id in ops:
        in_use = {a for a in IDS if usage.protected(a) or pool.refs(a)}
        if op == "request":
            usage.request_started(adapter_id)
            queued[adapter_id] = queued.get(adapter_id, 0) + 1
        elif op == "run" and queued.get(adapter_id):  # the scheduler admits a queued request
            if pool.slot_of(adapter_id) is None:
                if not pool.can_allocate():
                    continue
                pool.allocate(_tiny(adapter_id))
            slot = pool.acquire(adapter_id)
            queued[adapter_id] -= 1
            running.append((adapter_id, slot))
        elif op == "finish_running" and (held := [r for r in running if r[0] == adapter_id]):
            running.remove(held[0])
            pool.release(held[0][1])
            usage.request_finished(adapter_id)
        elif op == "finish_queued" and queued.get(adapter_id):  # aborted while queued
            queued[adapter_id] -= 1
            usage.request_finished(adapter_id)
        assert not set(evicted) & in_use, f"evicted {evicted} while pinned, queued or running"
        evicted.clear()
        assert len(pool.resident()) <= 3, "no more adapters are resident than the pool has slots"
