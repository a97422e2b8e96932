"""The request bodies that start a release: the release route's (`CreateReleaseRequest`) and vLLM's
load call with a `release` object (`LoadLoraAdapterRequest`), which share `ReleaseOptions`.

A vLLM-style load of a loaded name replaces it (`load_inplace`); the same load with `"release": {}`
(or with options) stages `lora_path` as the name's next version in a release against the version
the bare name means now, exactly as `POST /v1/adapters/{name}/releases` with the same options does.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from pydantic import Field

from lora_cluster.config.releases import MAX_STEPS, check_steps
from lora_cluster.errors import RequestError
from lora_cluster.releases.gates import ReleaseSettings
from lora_cluster.request.adapter_id import ADAPTER_NAME_PATTERN, MAX_ADAPTER_ID_LEN
from lora_cluster.serve.http.release_eval import MAX_EVAL_CASES
from lora_cluster.serve.http.schemas import Body


class ReleaseOptions(Body):
    steps: list[float] | None = Field(None, min_length=1, max_length=MAX_STEPS,
                                      description="This release's canary steps, percent, increasing, "
                                      "ending at 100 (default: release_canary_steps).")
    step_min_requests: int | None = Field(None, ge=1, description="Default: release_step_min_requests.")
    step_dwell_s: float | None = Field(None, ge=0, le=86_400, description="Default: release_step_dwell_s.")
    shadow_percent: float | None = Field(None, ge=0, le=100, description="Percent of the stable version's "
                                         "greedy requests copied to the candidate (default: "
                                         "release_shadow_percent).")
    eval_set: list[dict[str, Any]] | None = Field(
        None, min_length=1, max_length=MAX_EVAL_CASES,
        description="The evaluation set, one object a case: {prompt, expected}, {prompt, choices, answer} "
        "or {prompt, schema[, constrained]}, run on both versions before any traffic (default: "
        "eval.jsonl beside a local candidate, else none).")

    def settings(self, defaults: ReleaseSettings) -> ReleaseSettings:
        """The release's settings: the config's, with what this request overrides (400 on bad steps)."""
        try:
            steps = defaults.steps if self.steps is None else tuple(check_steps(self.steps, "steps"))
        except ValueError as exc:
            raise RequestError(str(exc)) from None
        return dataclasses.replace(
            defaults, steps=steps,
            step_min_requests=self.step_min_requests or defaults.step_min_requests,
            step_dwell_s=defaults.step_dwell_s if self.step_dwell_s is None else self.step_dwell_s,
            shadow_percent=defaults.shadow_percent if self.shadow_percent is None else self.shadow_percent)


class CreateReleaseRequest(ReleaseOptions):
    lora_path: str = Field(min_length=1, description="Where the candidate version's weights are "
                           "(a folder, or a URI of the configured sources' kinds).")


class LoadLoraAdapterRequest(Body):
    lora_name: str = Field(min_length=1, max_length=MAX_ADAPTER_ID_LEN, pattern=ADAPTER_NAME_PATTERN,
                           description="The adapter id to serve it as (letters, digits, '._-/'); a "
                           "version number is given by the load, never chosen (no `@N` here).")
    lora_path: str = Field(min_length=1)
    load_inplace: bool = Field(False, description="vLLM's field: load a new version of a loaded name. "
                               "Here it creates the next version `name@N`; the bare name moves to it, "
                               "the earlier versions stay addressable as `name@K` until retired.")
    release: ReleaseOptions | None = Field(
        None, description="Release `lora_path` as the next version of the loaded `lora_name` instead of "
        "replacing it: staged against the version the bare name means now, evaluated, then canaried "
        "(`{}`: the configured defaults; the options of POST /v1/adapters/{name}/releases).")

    def create_request(self) -> CreateReleaseRequest:
        """The release this load asks for (`release` is set)."""
        options = self.release.model_dump(exclude_unset=True) if self.release is not None else {}
        return CreateReleaseRequest(lora_path=self.lora_path, **options)
