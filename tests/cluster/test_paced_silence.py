"""A replica that reports on its paced period is never forgotten: the silence after which the
controller forgets a replica stretches with the period the report budget paces each replica to
(`ControllerSettings.silent_after_s`), and a replica that stops reporting is still forgotten."""

from __future__ import annotations

from helpers import FakeClock
from tickets import report

from lora_cluster.cluster.controller import Controller
from lora_cluster.cluster.controller_settings import STALE_PERIODS, ControllerSettings
from lora_cluster.cluster.report_rules import report_spacing_s
from lora_cluster.cluster.sla import SlaClasses
from lora_cluster.config import ControllerConfig

BUDGET = 400.0
REPLICAS = 1024


def test_the_silence_that_forgets_a_replica_follows_the_paced_report_period():
    settings = ControllerSettings.from_config(ControllerConfig(controller_report_budget_per_s=BUDGET))
    assert settings.silent_after_s(8) == settings.stale_after_s, "few replicas: the configured silence"
    period = report_spacing_s(REPLICAS, BUDGET)
    assert period > settings.stale_after_s, f"the paced period {period} s is longer than the fixed bound"
    assert settings.silent_after_s(REPLICAS) == STALE_PERIODS * period, (
        "many replicas: that many of their paced periods")


def test_replicas_reporting_on_their_paced_period_stay_and_a_silent_one_goes():
    clock = FakeClock(100.0)
    settings = ControllerSettings.from_config(ControllerConfig(controller_report_budget_per_s=BUDGET))
    controller = Controller(SlaClasses(), settings, clock=clock)
    ids = [f"r{i:04d}" for i in range(REPLICAS)]
    for rid in ids:
        controller.report(report(rid))
    period = report_spacing_s(REPLICAS, BUDGET)
    for _ in range(3):  # each replica reports once per paced period; the controller ticks in between
        for k, rid in enumerate(ids):
            clock.now += period / REPLICAS
            if k % 64 == 0:
                controller.tick()
            if rid != "r0000":
                controller.report(report(rid))
    assert len(controller.view) == REPLICAS, "no replica reporting on its paced period was forgotten"
    clock.now += STALE_PERIODS * period - 3 * period + 0.01
    controller.tick()
    assert controller.view.get("r0000") is None, "the replica silent for the paced bound was forgotten"
    assert len(controller.view) == REPLICAS - 1, "only the silent one"
