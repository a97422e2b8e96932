"""Demand prefetch (`serve.replica.demand_prefetch`) with an injected clock and fakes through its
protocols: the controller's hot list drives it, its bandwidth and byte bounds hold, it yields to live
loads, skips failures until the next list, and stops on shutdown; plus the pieces it reads: the
controller's hot list (`Controller.hot_adapters`) and the fetch queue's count of live fetches."""

from __future__ import annotations

import asyncio
import threading
from concurrent.futures import Future

from helpers import FakeClock
from tickets import CLASSES

from lora_cluster.cluster.controller import Controller
from lora_cluster.cluster.placement import DemandTracker
from lora_cluster.cluster.reports import ReplicaReport
from lora_cluster.engine.adapters.fetch_queue import PREFETCH, FetchQueue
from lora_cluster.serve.replica.demand_prefetch import ControllerHotList, DemandPrefetch, State


class FakeHost:
    """A host tier: adapter -> bytes."""

    def __init__(self) -> None:
        self.held: dict[str, int] = {}

    def __contains__(self, adapter_id: str) -> bool:
        return adapter_id in self.held

    @property
    def bytes(self) -> int:
        return sum(self.held.values())

    def nbytes(self, adapter_id: str) -> int | None:
        return self.held.get(adapter_id)


class FakeStore:
    """The store's prefetch lane: lands each adapter at once (`sizes`), or fails ids in `missing`;
    with `hold`, futures stay pending until `finish`."""

    def __init__(self, sizes: dict[str, int], *, hold: bool = False, missing: frozenset[str] = frozenset()):
        self.host, self.sizes, self.hold, self.missing = FakeHost(), sizes, hold, missing
        self.calls: list[str] = []
        self.pending: list[tuple[str, Future[None]]] = []

    def prefetch(self, adapter_id: str) -> Future[None]:
        self.calls.append(adapter_id)
        future: Future[None] = Future()
        if self.hold:
            self.pending.append((adapter_id, future))
        else:
            self._land(adapter_id, future)
        return future

    def finish(self) -> None:
        for adapter_id, future in self.pending:
            if not future.cancelled():
                self._land(adapter_id, future)
        self.pending.clear()

    def _land(self, adapter_id: str, future: Future[None]) -> None:
        if adapter_id not in self.missing:
            self.host.held[adapter_id] = self.sizes[adapter_id]
        future.set_result(None)


class FakeLive:
    def __init__(self) -> None:
        self.n = 0

    def live_fetches(self) -> int:
        return self.n


class FixedHot:
    def __init__(self, hot: list[tuple[str, int]] | None) -> None:
        self.list, self.asked = hot, 0

    async def hot(self, k: int) -> list[tuple[str, int]] | None:
        self.asked += 1
        return None if self.list is None else self.list[:k]


def prefetcher(store: FakeStore, live: FakeLive, clock: FakeClock, *, bytes_per_s: float = 1e9,
               max_bytes: int = 10**9, hot: FixedHot | None = None) -> DemandPrefetch:
    return DemandPrefetch(hot or FixedHot([]), store, live, bytes_per_s=bytes_per_s, max_bytes=max_bytes,
                          period_s=10.0, clock=clock, tick_s=0.01)


def hot_list(n: int) -> list[tuple[str, int]]:
    return [(f"a{i}", 1000 * (n - i)) for i in range(n)]


def test_the_busiest_adapters_come_first_and_held_ones_are_skipped() -> None:
    store, live, clock = FakeStore({f"a{i}": 10 for i in range(4)}), FakeLive(), FakeClock(0.0)
    store.host.held["a0"] = 10
    p = prefetcher(store, live, clock)
    p.observe_hot(hot_list(4))
    for _ in range(6):
        p.step()
    assert store.calls == ["a1", "a2", "a3"], "busiest first; the one held already is not fetched again"
    assert p.counts["prefetched_bytes"] == 30, "each landed adapter's bytes are counted"


def test_bandwidth_bound() -> None:
    store, live, clock = FakeStore({f"a{i}": 100 for i in range(40)}), FakeLive(), FakeClock(0.0)
    p = prefetcher(store, live, clock, bytes_per_s=200.0)
    p.observe_hot(hot_list(40))
    for _ in range(100):  # 10 s in steps of 0.1 s
        p.step()
        clock.now += 0.1
    fetched = 100 * len(store.calls)
    assert fetched <= 200 * 10 + 200 + 100, (
        f"{fetched} bytes in 10 s at 200 B/s: at most the rate times the window, one burst and one adapter")
    assert fetched >= 200 * 10 - 200, f"{fetched} bytes in 10 s: the bucket refills at its rate"


def test_byte_bound_never_evicts() -> None:
    store, live, clock = FakeStore({f"a{i}": 100 for i in range(5)}), FakeLive(), FakeClock(0.0)
    p = prefetcher(store, live, clock, max_bytes=250)
    p.observe_hot(hot_list(5))
    for _ in range(10):
        p.step()
    assert store.calls == ["a0", "a1"], "a third 100-byte adapter would take the host tier past 250 bytes"
    assert store.host.bytes <= 250, "the host tier stays within the prefetch byte bound"


def test_it_pauses_while_a_live_load_waits_or_runs() -> None:
    store, live, clock = FakeStore({"a0": 10, "a1": 10}), FakeLive(), FakeClock(0.0)
    p = prefetcher(store, live, clock)
    p.observe_hot(hot_list(2))
    live.n = 1
    for _ in range(5):
        assert p.step() is None, "nothing is handed out while a request's adapter fetch is queued or running"
    assert store.calls == [], "no prefetch started while a live load was in progress"
    assert p.counts["paused"] == 5, "every paused step is counted"
    live.n = 0
    assert p.step() == "a0", "prefetch resumes once no live load is in progress"


def test_one_prefetch_at_a_time_and_the_real_bytes_are_charged() -> None:
    store, live, clock = FakeStore({"a0": 500, "a1": 500}, hold=True), FakeLive(), FakeClock(0.0)
    p = prefetcher(store, live, clock, bytes_per_s=1000.0)
    p.observe_hot(hot_list(2))
    assert p.step() == "a0", "the busiest adapter is handed out"
    assert p.step() is None, "no second prefetch while one is in flight"
    store.finish()
    assert p.step() == "a1", "the next once the first landed"
    assert p.planner.handed_out_bytes == 500 + 500, "a0's real size was charged, a1's estimate is a0's size"


def test_a_failed_prefetch_is_skipped_until_the_next_hot_list() -> None:
    store = FakeStore({"a0": 10, "a1": 10}, missing=frozenset({"a0"}))
    live, clock = FakeLive(), FakeClock(0.0)
    p = prefetcher(store, live, clock)
    p.observe_hot(hot_list(2))
    for _ in range(5):
        p.step()
    assert store.calls == ["a0", "a1"], "a0 failed once and was not retried within the same list"
    assert p.counts["failed"] == 1, "the failure is counted"
    p.observe_hot(hot_list(2))
    p.step()
    assert store.calls[-1] == "a0", "a new hot list retries it"


def test_stop_cancels_a_prefetch_not_started_and_hands_out_nothing_after() -> None:
    store, live, clock = FakeStore({"a0": 10, "a1": 10}, hold=True), FakeLive(), FakeClock(0.0)
    p = prefetcher(store, live, clock)
    p.observe_hot(hot_list(2))
    p.step()
    pending = store.pending[0][1]
    p.stop()
    assert pending.cancelled(), "the in-flight prefetch that had not started is cancelled"
    assert p.in_flight() is None, "nothing is held in flight after stop"
    assert p.step() is None and store.calls == ["a0"], "nothing is handed out once stopped"
    assert p.state is State.STOPPED, "the lifecycle ends STOPPED"


def test_the_loop_polls_the_hot_list_prefetches_and_ends_on_stop() -> None:
    async def scenario() -> tuple[list[str], int, bool]:
        store, live = FakeStore({"a0": 10, "a1": 10}), FakeLive()
        hot = FixedHot(hot_list(2))
        p = DemandPrefetch(hot, store, live, bytes_per_s=1e9, max_bytes=10**9, period_s=60.0, tick_s=0.01)
        p.start()
        for _ in range(200):  # at most 2 s
            if len(store.calls) == 2:
                break
            await asyncio.sleep(0.01)
        was_running = p.running()
        p.stop()
        await asyncio.sleep(0.05)
        return store.calls, hot.asked, was_running and not p.running()

    calls, asked, ended = asyncio.run(scenario())
    assert calls == ["a0", "a1"], "the hot list's adapters were prefetched, busiest first"
    assert asked == 1, "the hot list is asked once per period"
    assert ended, "the loop ran until stop ended it"


def test_hot_lists_of_controller_shards_merge_busiest_first() -> None:
    class Method:
        def __init__(self, reply: object) -> None:
            self.reply = reply

        async def remote(self, k: int) -> object:
            if isinstance(self.reply, Exception):
                raise self.reply
            return self.reply

    class Shard:
        def __init__(self, reply: object) -> None:
            self.hot_adapters = Method(reply)

    shards = [Shard([("x", 50), ("y", 5)]), Shard([("z", 20)]), Shard(RuntimeError("gone"))]
    merged = asyncio.run(ControllerHotList(shards).hot(2))
    assert merged == [("x", 50), ("z", 20)], "the busiest of every reachable shard, busiest first"
    unreachable = asyncio.run(ControllerHotList([Shard(RuntimeError("gone"))]).hot(2))
    assert unreachable is None, "no reachable shard: no list (the previous one stays)"


def test_controller_hot_adapters_rank_recent_demand_with_integer_rates() -> None:
    clock = FakeClock(100.0)
    core = Controller(CLASSES, clock=clock)
    core.report(ReplicaReport("r1", "n1", capacity=2, max_num_seqs=2, max_loras=4, running=0, waiting=0,
                              free_adapter_slots=4,
                              adapter_requests={"hot": 30, "warm": 3}))
    hot = core.hot_adapters(32)
    assert [a for a, _ in hot] == ["hot", "warm"], "busiest first"
    assert all(isinstance(rate, int) and rate > 0 for _, rate in hot), "rates are positive ints"
    assert core.hot_adapters(1) == hot[:1], "k bounds the list"


def test_the_hot_list_is_computed_at_most_once_a_second() -> None:
    clock = FakeClock(0.0)
    demand = DemandTracker(window_s=60.0, clock=clock)
    demand.record({"a": 5})
    first = demand.hot(8)
    demand.record({"b": 50})
    assert demand.hot(8) == first, "within a second the list computed before is answered"
    clock.now += 1.0
    assert demand.hot(8)[0][0] == "b", "a second later the new demand ranks"


def test_the_fetch_queue_counts_live_fetches_queued_and_running_not_prefetches() -> None:
    release, started = threading.Event(), threading.Event()

    def fetch(key: str) -> str:
        started.set()
        release.wait(5.0)
        return key

    queue = FetchQueue(1, max_prefetches=4)
    try:
        running = queue.submit(fetch, "live-running", 0)
        assert started.wait(5.0), "the worker took the first fetch"
        queue.submit(fetch, "prefetch", PREFETCH)
        assert queue.live() == 1, "a running request fetch counts; a queued prefetch does not"
        queue.submit(fetch, "live-queued", 0)
        assert queue.live() == 2, "a queued request fetch counts too"
        release.set()
        running.result(5.0)
        for _ in range(500):  # bounded: the worker drains the queue
            if queue.live() == 0:
                break
            threading.Event().wait(0.01)
        assert queue.live() == 0, "no live fetch once they all ran"
    finally:
        release.set()
        queue.close()
