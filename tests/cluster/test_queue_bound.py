"""The cluster queue's bound (`cluster_queue_size`): set, it is exact; None, the default, it grows with
the replicas the controller sees (`QUEUE_PER_REPLICA` each, at least `QUEUE_FLOOR`), each shard holding
its share, so that a 1,024-replica cluster does not refuse a third of a second of its arrivals."""

from __future__ import annotations

from helpers import FakeClock
from tickets import CLASSES

from lora_cluster.cluster.controller import Controller, ControllerSettings
from lora_cluster.cluster.controller_settings import QUEUE_FLOOR, QUEUE_PER_REPLICA, cluster_queue_bound
from lora_cluster.cluster.reports import ReplicaReport
from lora_cluster.config import ControllerConfig


def report(replica_id: str) -> ReplicaReport:
    return ReplicaReport(replica_id, "n1", capacity=4, max_num_seqs=4, max_loras=4, running=0, waiting=0,
                         free_adapter_slots=4)


def test_the_default_bound_grows_with_the_replicas_past_its_floor() -> None:
    assert cluster_queue_bound(None, 0) == QUEUE_FLOOR, "no replica seen: the floor"
    assert cluster_queue_bound(None, 32) == QUEUE_FLOOR, "32 replicas: 32 x 128 = 4096, the floor"
    assert cluster_queue_bound(None, 1024) == 1024 * QUEUE_PER_REPLICA, "1,024 replicas: 128 each"


def test_a_size_set_is_the_bound_whatever_the_replicas() -> None:
    assert cluster_queue_bound(5, 1024) == 5, "cluster_queue_size set: exactly that"


def test_the_controller_queue_follows_the_replicas_it_sees() -> None:
    clock = FakeClock(100.0)
    ctl = Controller(CLASSES, ControllerSettings(), clock=clock)
    assert ctl.snapshot()["queue"]["size"] == QUEUE_FLOOR, "before any report: the floor"
    for i in range(40):
        ctl.report(report(f"r{i}"))
    assert ctl.snapshot()["queue"]["size"] == 40 * QUEUE_PER_REPLICA, "40 replicas: 128 each"
    clock.advance(3600.0)
    ctl.tick()
    assert ctl.snapshot()["queue"]["size"] == QUEUE_FLOOR, "every replica forgotten: the floor again"


def test_a_controller_with_a_size_set_keeps_it() -> None:
    ctl = Controller(CLASSES, ControllerSettings(queue_size=7), clock=FakeClock(100.0))
    for i in range(40):
        ctl.report(report(f"r{i}"))
    assert ctl.snapshot()["queue"]["size"] == 7, "cluster_queue_size 7 holds with 40 replicas"


def test_each_shard_holds_its_share_of_the_bound() -> None:
    settings = ControllerSettings.from_config(ControllerConfig(controller_shards=4))
    assert settings.queue_bound(1024) == 1024 * QUEUE_PER_REPLICA // 4, "a quarter of 128 x 1,024 a shard"
    fixed = ControllerSettings.from_config(ControllerConfig(controller_shards=4, cluster_queue_size=10))
    assert fixed.queue_bound(1024) == 3, "10 over 4 shards: 3 each, rounded up"
