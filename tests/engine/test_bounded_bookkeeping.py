"""Client-chosen adapter ids never grow the server's memory without bound.

Regression tests: before the fix, every syntactically valid id left an entry in the access history
for good, and fetched adapters whose requests went away stayed in the engine's fetch table (host
weights outside the host byte budget) and in the store's "handed to the engine" set forever.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator

import pytest
import torch
from helpers import FakeLoader, wait_until

from lora_cluster.adapter_format import LoraWeights, ModelShapes
from lora_cluster.engine import Engine, SamplingParams
from lora_cluster.engine.model.model_loader import load_base_model
from lora_cluster.errors import AdapterNotFoundError
from lora_cluster.store import TieredAdapterStore
from lora_cluster.store.admission import AdmissionPolicy

UNKNOWN_IDS = 100_000
ABORTED_LOADS = 10_000


@pytest.fixture(scope="module")
def shapes(demo_model_dir) -> ModelShapes:
    return load_base_model(str(demo_model_dir), dtype=torch.float32, device=torch.device("cpu")).dims.shapes()


def test_unknown_ids_leave_bounded_records(shapes, demo_adapters_dir, tmp_path):
    store = TieredAdapterStore([str(demo_adapters_dir)], AdmissionPolicy(shapes, 64),
                               disk_cache_dir=tmp_path / "disk")
    try:
        for i in range(UNKNOWN_IDS):
            adapter_id = f"missing-{i}"
            store.request_started(adapter_id)
            with pytest.raises(AdapterNotFoundError):
                store.load(adapter_id)
            store.request_finished(adapter_id)
        tracked = store.snapshot()["tracked"]
        assert tracked["access_history"] == 0, "ids that do not exist keep no access history"
        assert tracked["lifecycle"] == 0, "ids that do not exist have no lifecycle entry"
        assert tracked["unplaced"] == 0, "failed loads leave nothing marked as handed to the engine"
        assert tracked["in_use"] == 0, "finished requests leave no use count"
        assert tracked["missing"] <= store.missing.max_entries, "the negative cache is bounded"
        store.load("a0")
        assert store.snapshot()["tracked"]["lifecycle"] == 1, "an adapter that exists is tracked"
    finally:
        store.close()


def test_a_remembered_miss_is_answered_without_asking_the_sources(shapes, demo_adapters_dir, tmp_path):
    now = [0.0]
    store = TieredAdapterStore([str(tmp_path / "src")], AdmissionPolicy(shapes, 64),
                               disk_cache_dir=tmp_path / "disk", negative_cache_ttl_s=5.0,
                               clock=lambda: now[0])
    try:
        with pytest.raises(AdapterNotFoundError):
            store.load("late")
        (tmp_path / "src").mkdir()
        (tmp_path / "src" / "late").symlink_to(demo_adapters_dir / "a0")
        with pytest.raises(AdapterNotFoundError):
            store.load("late")  # still remembered as missing
        now[0] = 6.0
        assert store.load("late").adapter_id == "late", "after the TTL the sources are asked again"
    finally:
        store.close()


class CountingLoader(FakeLoader):
    """An `EnginePort` that makes tiny weights for any id and counts what the engine hands back."""

    def __init__(self, shapes: ModelShapes, gate: threading.Event):
        self.shapes, self.gate = shapes, gate
        self.loaded = self.abandoned = 0
        self._lock = threading.Lock()

    def load(self, adapter_id: str) -> LoraWeights:
        self.gate.wait(30)
        in_f, out_f = self.shapes.modules["q_proj"]
        with self._lock:
            self.loaded += 1
        return LoraWeights(adapter_id, 1, frozenset({"q_proj"}), {"q_proj": 1.0},
                           {(0, "q_proj"): torch.zeros(1, in_f)}, {(0, "q_proj"): torch.zeros(out_f, 1)})

    def load_abandoned(self, adapter_id: str) -> None:
        with self._lock:
            self.abandoned += 1


def _wait_for_fetches(engine: Engine) -> None:
    """Until no adapter fetch of `engine` is in flight (bounded)."""
    wait_until(lambda: not engine.stats().loading_adapters, 30.0, "the adapter fetches to end",
               interval_s=0.01)


@pytest.fixture
def gated_engine(make_engine, shapes) -> Iterator[tuple[Engine, CountingLoader, threading.Event]]:
    gate = threading.Event()
    loader = CountingLoader(shapes, gate)
    engine = make_engine(adapter_source=None, adapter_loader=loader, max_loras=2, max_waiting=ABORTED_LOADS)
    yield engine, loader, gate
    gate.set()
    engine.close()


def test_aborted_requests_let_go_of_their_fetches(gated_engine):
    engine, loader, gate = gated_engine
    sampling = SamplingParams(max_new_tokens=1)
    for i in range(ABORTED_LOADS):
        engine.add_request(f"r{i}", [1, 2, 3], f"fetched-{i}", sampling)
        engine.abort(f"r{i}")
    assert engine.stats().held_fetches <= engine.config.adapter_load_workers, (
        "queued fetches of aborted requests are cancelled; only those already running remain")
    gate.set()
    _wait_for_fetches(engine)
    engine.step()
    assert engine.stats().held_fetches == 0, "finished fetches nobody waits for are let go"
    assert loader.abandoned == loader.loaded, "every fetched-then-abandoned copy is handed back to the loader"


def test_fetched_weights_of_an_aborted_request_return_to_the_host_budget(make_engine, tmp_path):
    engine = make_engine(max_loras=2, max_lora_rank=32, disk_cache_dir=str(tmp_path / "disk"))
    try:
        store = engine.loader
        engine.add_request("r", "the river", "a3", SamplingParams(max_new_tokens=1))
        _wait_for_fetches(engine)
        engine.abort("r")
        engine.step()
        assert engine.stats().held_fetches == 0, "the engine let go of the fetched weights"
        assert store.snapshot()["tracked"]["unplaced"] == 0, "the store no longer counts a3 as handed out"
    finally:
        engine.close()
