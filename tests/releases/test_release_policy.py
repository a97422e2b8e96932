"""A release's life: the eval gate lets a candidate into the canary or refuses it, each step advances
after its minimum requests and dwell while the gates hold, a failing gate rolls back at once, manual
commands obey the state machine, every decision is in the audit log, and a release survives a restart
at its step."""

from __future__ import annotations

import pytest
from helpers import FakeClock

from lora_cluster.config import ServeConfig
from lora_cluster.errors import AdapterNotFoundError, ReleaseConflictError
from lora_cluster.releases.book import ReleaseBook
from lora_cluster.releases.gates import ReleaseSettings, StepStats, judge
from lora_cluster.releases.release import Release, ReleaseState

SETTINGS = ReleaseSettings(steps=(1.0, 5.0, 25.0, 50.0, 100.0), step_min_requests=20, step_dwell_s=30.0,
                           error_rate_margin=0.02, gate_min_requests=10, latency_attainment=0.9,
                           max_events=50)


def canary(clock: FakeClock) -> Release:
    release = Release("r1", "fin", 1, 2, SETTINGS, clock)
    release.eval_passed({"stable_score": 0.9, "candidate_score": 0.9})
    return release


def serve_step(release: Release, clock: FakeClock, candidate_errors: int = 0, late: int = 0) -> None:
    for i in range(SETTINGS.step_min_requests):
        release.record(2, ok=i >= candidate_errors, on_target=i >= candidate_errors + late)
        release.record(1, ok=True)
    clock.advance(SETTINGS.step_dwell_s)
    release.tick()


def test_the_settings_come_from_the_config():
    config = ServeConfig(model="demo", release_canary_steps=[10, 100], release_step_dwell_s=5)
    settings = ReleaseSettings.from_config(config.releases)
    assert settings.steps == (10.0, 100.0), "the steps are the config's"
    assert settings.step_dwell_s == 5.0, "the dwell is the config's"
    with pytest.raises(ValueError, match="end at 100"):
        ServeConfig(model="demo", release_canary_steps=[1, 50])
    with pytest.raises(ValueError, match="increase"):
        ServeConfig(model="demo", release_canary_steps=[50, 5, 100])


def test_no_traffic_reaches_the_candidate_before_the_eval_gate():
    release = Release("r1", "fin", 1, 2, SETTINGS, FakeClock())
    assert release.state is ReleaseState.EVALUATING, "a release starts in evaluation"
    assert release.percent == 0.0, "the candidate gets no share while evaluated"
    assert release.alias().resolve("anyone") == 1, "every user gets the stable version"


def test_a_refused_candidate_is_rolled_back_with_the_evidence():
    release = Release("r1", "fin", 1, 2, SETTINGS, FakeClock())
    release.eval_failed("below the margin", {"stable_score": 0.9, "candidate_score": 0.1})
    assert release.state is ReleaseState.ROLLED_BACK, "a candidate the eval gate refuses is rolled back"
    assert release.events()[-1].evidence["candidate_score"] == 0.1, "the audit log keeps the evidence"
    assert release.candidate_answered == 0, "the candidate answered nothing"


def test_a_good_candidate_goes_through_every_step_to_promotion():
    clock = FakeClock()
    release = canary(clock)
    seen = []
    for _ in SETTINGS.steps:
        seen.append(release.percent)
        serve_step(release, clock)
    assert seen == [1.0, 5.0, 25.0, 50.0, 100.0], "the candidate's share follows every step"
    assert release.state is ReleaseState.PROMOTED, "after the last step the candidate is promoted"
    assert release.alias().resolve("anyone") == 2, "the bare name now means the candidate"
    kinds = [e.kind for e in release.events()]
    assert kinds == ["created", "eval_passed", *["step_advanced"] * 4, "promoted"], \
        f"every decision is in the audit log: {kinds}"


def test_a_step_waits_for_its_requests_and_its_dwell():
    clock = FakeClock()
    release = canary(clock)
    for _ in range(SETTINGS.step_min_requests - 1):
        release.record(2, ok=True)
    clock.advance(SETTINGS.step_dwell_s * 10)
    release.tick()
    assert release.step == 0, "too few requests: the step holds"
    release.record(2, ok=True)
    release.tick()
    assert release.step == 1, "with the minimum requests and the dwell, the step advances"
    for _ in range(SETTINGS.step_min_requests):
        release.record(2, ok=True)
    clock.advance(SETTINGS.step_dwell_s - 1)
    release.tick()
    assert release.step == 1, "before the dwell: the step holds"


def test_an_error_rate_over_the_margin_rolls_back_automatically():
    clock = FakeClock()
    release = canary(clock)
    serve_step(release, clock)
    for _ in range(SETTINGS.gate_min_requests):
        release.record(2, ok=False)
    release.tick()
    assert release.state is ReleaseState.ROLLED_BACK, "a failing gate rolls back before the dwell"
    last = release.events()[-1]
    assert last.percent == 5.0, "the rollback is logged at the step it happened in"
    assert last.evidence["candidate_error_rate"] == 1.0, "with the error rate as evidence"
    assert release.alias().resolve("anyone") == 1, "every user is back on the stable version"


def test_missed_latency_targets_roll_back():
    clock = FakeClock()
    release = canary(clock)
    serve_step(release, clock, late=5)
    assert release.state is ReleaseState.ROLLED_BACK, "25% of requests late is below the 90% attainment"
    assert "TTFT/TPOT" in release.events()[-1].reason, "the reason names the latency gate"


def test_the_gates_need_evidence_before_they_fail():
    few = StepStats(requests=SETTINGS.gate_min_requests - 1, errors=SETTINGS.gate_min_requests - 1)
    assert judge(SETTINGS, few, StepStats(), 1000.0).outcome == "hold", "too few requests to roll back"
    noisy_stable = StepStats(requests=100, errors=10)
    candidate = StepStats(requests=100, errors=11)
    assert judge(SETTINGS, candidate, noisy_stable, 1000.0).outcome == "pass", \
        "an error rate within the margin of the stable version's passes"


def test_manual_commands_follow_the_state_machine():
    clock = FakeClock()
    release = canary(clock)
    release.pause()
    serve_step(release, clock)
    assert release.step == 0, "a paused release does not advance"
    assert release.percent == 1.0, "a paused release keeps its share"
    release.resume()
    release.rollback("operator")
    with pytest.raises(ReleaseConflictError, match="cannot go from rolled_back to promoted"):
        release.promote()


def test_the_audit_log_is_bounded():
    clock = FakeClock()
    release = canary(clock)
    for _ in range(SETTINGS.max_events):
        release.pause()
        release.resume()
    assert len(release.events()) == SETTINGS.max_events, "the oldest events are dropped"
    assert release.events()[-1].seq == 2 + 2 * SETTINGS.max_events, "sequence numbers keep counting"


def test_a_release_resumes_at_its_step_after_a_restart():
    clock = FakeClock()
    release = canary(clock)
    serve_step(release, clock)
    serve_step(release, clock)
    release.record(2, ok=True)
    again = Release.from_dict(release.to_dict(), SETTINGS, clock)
    assert again.state is ReleaseState.CANARY and again.percent == 25.0, "it resumes at the same step"
    assert again.stats["candidate"].requests == 1, "with the step's counts"
    assert [e.kind for e in again.events()] == [e.kind for e in release.events()], "and its audit log"


def test_a_release_keeps_its_own_settings_across_a_restart():
    clock = FakeClock()
    own = ReleaseSettings(steps=(50.0, 100.0), step_min_requests=2, step_dwell_s=0.0)
    release = Release("r1", "fin", 1, 2, own, clock)
    again = Release.from_dict(release.to_dict(), SETTINGS, clock)
    assert again.settings == own, "the release's own steps and gates come back, not the defaults"


def test_the_bare_name_follows_loads_and_releases():
    book = ReleaseBook(SETTINGS, FakeClock())
    assert book.alias("fin", [1, 2], "u") == 2, "with no release the bare name is the latest version"
    release = book.start("fin", "r1", stable=2, candidate=3)
    assert book.alias("fin", [1, 2, 3], "u") == 2, "a candidate being evaluated gets no traffic"
    release.eval_passed({})
    book.command("fin", "r1", "promote")
    assert book.alias("fin", [1, 2, 3], "u") == 3, "a promotion moves the bare name to the candidate"
    assert book.alias("fin", [], "u") is None, "a name with no version kept has no alias"


def test_one_release_runs_per_name_and_a_rollback_keeps_the_alias():
    book = ReleaseBook(SETTINGS, FakeClock())
    book.start("fin", "r1", stable=1, candidate=2).eval_passed({})
    with pytest.raises(ReleaseConflictError, match="promote or roll it back"):
        book.start("fin", "r2", stable=1, candidate=3)
    for _ in range(SETTINGS.gate_min_requests):
        book.record("fin", 2, ok=False)
    assert book.running("fin") is None, "a failing gate ends the release on the request that fails it"
    assert book.alias("fin", [1, 2], "u") == 1, "after a rollback the bare name stays on the stable version"
    assert book.alias("fin", [1, 2, 3], "u") == 3, "until a newer version is loaded without a release"
    assert book.protected("fin") == [], "a finished release protects no version"


def test_finished_releases_are_bounded():
    book = ReleaseBook(SETTINGS, FakeClock(), finished_kept=2)
    for n in range(5):
        book.start("fin", f"r{n}", stable=1, candidate=n + 2)
        book.command("fin", f"r{n}", "rollback")
    assert [r.id for r in book.releases("fin")] == ["r2", "r3", "r4"], \
        "at most finished_kept releases before the latest are kept, the oldest dropped first"
    with pytest.raises(AdapterNotFoundError, match="no release 'r0'"):
        book.release("fin", "r0")


def test_the_book_survives_a_restart():
    clock = FakeClock()
    book = ReleaseBook(SETTINGS, clock)
    book.start("fin", "r1", stable=1, candidate=2).eval_passed({})
    again = ReleaseBook(SETTINGS, clock)
    again.restore(book.to_dict())
    assert again.running("fin").percent == 1.0, "the running release resumes at its step"
    assert again.protected("fin") == [1, 2], "and keeps its versions from retirement"
