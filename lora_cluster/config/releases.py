"""The releases section (`ServeConfig.releases`, YAML `releases:`): how many versions of an adapter
name are kept, the canary steps of a release and the gates that advance or roll it back.

Each field keeps its flat `LORA_CLUSTER_<FIELD>` variable (config.flat_aliases); the policy that
reads them is `lora_cluster.releases` (`ReleaseSettings.from_config`)."""

from __future__ import annotations

import itertools

from pydantic import BaseModel, Field, field_validator, model_validator

from lora_cluster.config.parsing import SECTION

MAX_STEPS = 16


class ReleasesConfig(BaseModel):
    """The releases section (`ServeConfig.releases`, YAML `releases:`): versions kept per adapter
    name, canary steps, and the gates a candidate version must hold at each step."""

    model_config = SECTION

    release_versions_kept: int = Field(
        5, ge=1, le=100, description="Versions of one adapter name kept; registering one more retires "
        "the oldest that no release uses (its `name@N` is then a 404)."
    )
    release_canary_steps: list[float] = Field(
        default_factory=lambda: [1.0, 5.0, 25.0, 50.0, 100.0],
        description="The canary steps of a release: percent of the bare name's traffic answered by the "
        "candidate, increasing, ending at 100 (the candidate is then the stable version). Environment: "
        "a JSON list.",
    )
    release_step_min_requests: int = Field(
        20, ge=1, description="Candidate requests a step must see before it may advance."
    )
    release_step_dwell_s: float = Field(
        30.0, ge=0, description="Seconds a step lasts at least before it may advance."
    )
    release_error_rate_margin: float = Field(
        0.02, ge=0, le=1, description="Gate: the candidate's error rate in a step may exceed the stable "
        "version's by at most this much; beyond it the release rolls back."
    )
    release_gate_min_requests: int = Field(
        10, ge=1, description="Candidate requests a step needs before its gates can fail (fewer: "
        "too little evidence to roll back)."
    )
    release_latency_attainment: float = Field(
        0.9, ge=0, le=1, description="Gate: the share of the candidate's requests that must meet their "
        "SLA class's TTFT and TPOT targets in a step."
    )
    release_eval_margin: float = Field(
        0.05, ge=0, le=1, description="Eval gate: the candidate's score on the evaluation set (exact "
        "match, choice accuracy, schema-valid rate) may be below the stable version's by at most this; "
        "so may the schema-valid rate of its shadow copies of JSON-constrained requests, once "
        "release_gate_min_requests were checked."
    )
    release_max_events: int = Field(
        1000, ge=10, description="Audit-log events kept per release (the oldest dropped first)."
    )
    release_shadow_percent: float = Field(
        0.0, ge=0, le=100, description="Shadow: the percent of the stable version's greedy (temperature 0), "
        "one-choice requests (OpenAI and LoRAX, streamed or not) during a canary that are copied to the "
        "candidate at the least urgent SLA class after the live answer, never answered to a client "
        "(0: no shadow). A release may set its own."
    )
    release_shadow_min_agreement: float = Field(
        0.5, ge=0, le=1, description="Shadow gate: the least token agreement of the candidate's copies with "
        "the stable version's answers, once a step has release_gate_min_requests copies; below it the "
        "release rolls back."
    )
    release_state_uri: str = Field(
        "auto", max_length=1024, description="Where releases and the versions of loaded adapters are "
        "kept, so that they survive a restart and every ingress replica follows the same releases: a "
        "folder (or file://), s3://bucket/prefix, `adapter_source` for a `.lora-cluster` folder (key "
        "prefix) under the first adapter source, or empty for the ingress's memory (lost on a restart; "
        "releases need one ingress replica). `auto`: the `.lora-cluster` folder under the first "
        "adapter source that is a writable local folder; else, with one ingress replica, under the "
        "disk tier folder (disk_cache_dir); else memory, with a WARNING at start (docs/releases.md)."
    )
    release_sync_s: float = Field(
        2.0, gt=0, le=300, description="How often each ingress reads the shared release state and writes "
        "its live evidence (with `release_state_uri`): the longest an ingress's traffic split lags a "
        "step decided elsewhere."
    )

    release_lease_s: float = Field(
        30.0, gt=0, le=3600, description="The lease of a release's eval gate in the shared release "
        "state: the ingress running the gate renews it every release_sync_s; when that ingress dies, "
        "the next ingress to sync after the lease expired takes it and runs the gate again. At least "
        "twice release_sync_s."
    )

    @model_validator(mode="after")
    def _lease_outlives_syncs(self) -> ReleasesConfig:
        if self.release_lease_s < 2 * self.release_sync_s:
            raise ValueError(f"release_lease_s ({self.release_lease_s}) must be at least twice "
                             f"release_sync_s ({self.release_sync_s}): its owner renews it once per sync")
        return self

    @field_validator("release_canary_steps")
    @classmethod
    def _steps(cls, steps: list[float]) -> list[float]:
        return check_steps(steps, "release_canary_steps")


def check_steps(steps: list[float], field: str) -> list[float]:
    """Canary steps: 1 to MAX_STEPS percents, increasing within (0, 100], the last 100 (ValueError)."""
    if not steps or len(steps) > MAX_STEPS:
        raise ValueError(f"{field} needs 1 to {MAX_STEPS} steps, got {len(steps)}")
    if any(not 0 < s <= 100 for s in steps) or any(b <= a for a, b in itertools.pairwise(steps)):
        raise ValueError(f"{field} must increase within (0, 100], got {steps}")
    if steps[-1] != 100:
        raise ValueError(f"{field} must end at 100, got {steps}")
    return steps
