"""The suite's xdist scheduling (tests/xdist_units.py) driven with fake workers: modules whole, the Ray
modules one unit first, every item run though several share a node id, a crashed worker's tests
handed on."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
from xdist_units import ModuleUnits

COLLECTION = ["tests/test_a.py::t1", "tests/test_a.py::t2", "tests/test_b.py::t[x]", "tests/test_b.py::t",
              "tests/test_b.py::t", "tests/test_b.py::t", "tests/test_e2e.py::u", "tests/test_f.py::v"]


class FakeWorker:
    def __init__(self, name: str):
        self.gateway = SimpleNamespace(id=name)
        self.sent: list[int] = []
        self.shutting_down = False

    def send_runtest_some(self, indices: list[int]) -> None:
        self.sent.extend(indices)

    def shutdown(self) -> None:
        self.shutting_down = True


def _scheduler(workers: list[FakeWorker]) -> ModuleUnits:
    sched = ModuleUnits(len(workers), lambda *a: None, lambda nid: "ray" if "e2e" in nid or "_f" in nid
                        else nid.split("::")[0], first="ray")
    for w in workers:
        sched.add_node(w)
        sched.add_node_collection(w, COLLECTION)
    sched.schedule()
    return sched


def _run(sched: ModuleUnits, workers: list[FakeWorker]) -> dict[str, list[int]]:
    """Complete every test sent, a worker at a time, until all are finished; returns what each ran."""
    ran: dict[str, list[int]] = {w.gateway.id: [] for w in workers}
    done = {w.gateway.id: 0 for w in workers}
    for _ in range(100):
        progressed = False
        for w in workers:
            if done[w.gateway.id] < len(w.sent):
                index = w.sent[done[w.gateway.id]]
                done[w.gateway.id] += 1
                ran[w.gateway.id].append(index)
                sched.mark_test_complete(w, index)
                progressed = True
        if not progressed:
            break
    return ran


def test_every_item_runs_once_each_module_on_one_worker_and_the_ray_modules_together_first() -> None:
    workers = [FakeWorker("gw0"), FakeWorker("gw1")]
    sched = _scheduler(workers)
    ran = _run(sched, workers)
    everything = sorted(i for indices in ran.values() for i in indices)
    assert everything == list(range(len(COLLECTION))), "each item once, those sharing a node id included"
    holder = {i: w for w, indices in ran.items() for i in indices}
    for module in ("test_a", "test_b"):
        assert len({holder[i] for i, nid in enumerate(COLLECTION) if module in nid}) == 1, \
            f"{module} runs on one worker"
    assert holder[6] == holder[7], "the Ray modules run on one worker, one after the other"
    assert ran[holder[6]][:2] == [6, 7], "the Ray modules are that worker's first unit, in their order"
    assert sched.tests_finished and all(w.shutting_down for w in workers), "done, workers told to stop"


def test_a_crashed_worker_names_its_running_test_and_its_replacement_runs_the_rest() -> None:
    workers = [FakeWorker("gw0"), FakeWorker("gw1")]
    sched = _scheduler(workers)
    first = workers[0].sent[0]
    crashed = sched.remove_node(workers[0])
    assert crashed == COLLECTION[first], "the test it was running is reported as the crashed one"
    replacement = FakeWorker("gw2")  # xdist starts a new worker for a crashed one
    sched.add_node(replacement)
    sched.add_node_collection(replacement, COLLECTION)
    sched.schedule()
    ran = _run(sched, [workers[1], replacement])
    assert sorted(ran["gw1"] + ran["gw2"] + [first]) == list(range(len(COLLECTION))), \
        "every test but the crashed one runs, once"


@pytest.mark.parametrize("workers", [1, 5])
def test_any_number_of_workers_runs_everything(workers: int) -> None:
    fakes = [FakeWorker(f"gw{k}") for k in range(workers)]
    sched = _scheduler(fakes)
    ran = _run(sched, [w for w in fakes if w in sched.nodes])
    assert sorted(i for v in ran.values() for i in v) == list(range(len(COLLECTION))), "each item once"
