"""Config in sections: each owner's section, and the flat names every section field keeps as a
keyword argument, a serve_config.yaml key and a `LORA_CLUSTER_<FIELD>` variable."""

from __future__ import annotations

import pytest
import yaml

from lora_cluster.config import (
    AdmissionConfig,
    ApiConfig,
    ControllerConfig,
    EngineConfig,
    MetricsConfig,
    ReleasesConfig,
    RouterConfig,
    ServeConfig,
    TenancyConfig,
    build_config,
    env_var,
    load_config,
)
from lora_cluster.config.serve import FLAT
from lora_cluster.errors import ConfigError

SECTIONS = {"engine": EngineConfig, "router": RouterConfig, "admission": AdmissionConfig,
            "controller": ControllerConfig, "api": ApiConfig, "tenancy": TenancyConfig,
            "metrics": MetricsConfig, "releases": ReleasesConfig}


def test_every_section_is_a_field_of_the_serve_config_and_holds_its_owner_s_fields() -> None:
    for name, model in SECTIONS.items():
        assert isinstance(getattr(ServeConfig(), name), model), f"ServeConfig.{name} is a {model.__name__}"
    assert ServeConfig().controller.cluster_queue_size is None, "the queue size is in the controller section"
    assert ServeConfig().api.max_n == 16, "the API's limits are in its section"


def test_every_section_field_has_one_flat_name() -> None:
    flat = [name for model in SECTIONS.values() for name in model.model_fields]
    assert len(FLAT.where) == len(flat) - 1, "every section field but the engine's model has a flat name"
    assert FLAT.where["controller"] == ("controller", "enabled"), "`controller` turns the controller on/off"
    assert FLAT.where["max_loras"] == ("engine", "max_loras"), "an engine field keeps its flat name"


@pytest.mark.parametrize(("flat", "value", "section", "field"), [
    ("max_loras", 3, "engine", "max_loras"),
    ("cluster_queue_size", 5, "controller", "cluster_queue_size"),
    ("controller", False, "controller", "enabled"),
    ("router_miss_cost", 2.5, "router", "router_miss_cost"),
    ("admission_capacity", 4, "admission", "admission_capacity"),
    ("max_n", 2, "api", "max_n"),
    ("open_routes", ["/health", "/v1/models"], "tenancy", "open_routes"),
    ("log_format", "json", "metrics", "log_format"),
])
def test_a_flat_keyword_or_yaml_key_sets_its_section_field(flat: str, value: object, section: str,
                                                            field: str) -> None:
    assert getattr(getattr(ServeConfig(**{flat: value}), section), field) == value, (
        f"the flat key {flat} sets {section}.{field}")
    args = yaml.safe_load(yaml.safe_dump({flat: value}))
    assert getattr(getattr(load_config(args), section), field) == value, (
        f"the flat serve_config.yaml key {flat} sets {section}.{field}")


@pytest.mark.parametrize(("flat", "text", "section", "field", "value"), [
    ("max_loras", "3", "engine", "max_loras", 3),
    ("host_cache_bytes", "2GiB", "engine", "host_cache_bytes", 2 << 30),
    ("pinned", "a, b", "engine", "pinned", ["a", "b"]),
    ("cluster_queue_size", "5", "controller", "cluster_queue_size", 5),
    ("controller", "off", "controller", "enabled", False),
    ("prefix_aware_routing", "false", "router", "prefix_aware_routing", False),
    ("max_body_bytes", "2MiB", "api", "max_body_bytes", 2 << 20),
    ("open_routes", '["/health", "/metrics"]', "tenancy", "open_routes", ["/health", "/metrics"]),
    ("metrics_max_adapter_labels", "7", "metrics", "metrics_max_adapter_labels", 7),
])
def test_a_flat_variable_sets_its_section_field(monkeypatch, flat: str, text: str, section: str, field: str,
                                                value: object) -> None:
    monkeypatch.setenv(env_var(flat), text)
    assert getattr(getattr(ServeConfig(), section), field) == value, f"{env_var(flat)} sets {section}.{field}"


def test_sections_given_nested_work_and_arguments_win_over_the_environment(monkeypatch) -> None:
    monkeypatch.setenv(env_var("cluster_queue_size"), "9")
    monkeypatch.setenv(env_var("controller_shards"), "2")
    config = load_config({"controller": {"cluster_queue_size": 5}, "router": {"router_miss_cost": 1.5}})
    assert config.controller.cluster_queue_size == 5, "a nested argument wins over the flat variable"
    assert config.controller.controller_shards == 2, "the variable still sets the section's other fields"
    assert config.router.router_miss_cost == 1.5, "a nested section argument sets its field"
    flat = load_config({"cluster_queue_size": 6, "controller": False})
    assert flat.controller.cluster_queue_size == 6, "a flat argument wins over the flat variable"
    assert flat.controller.controller_shards == 2, "a flat `controller: false` keeps the section's variables"
    assert flat.controller.enabled is False, "and turns the controller off"


def test_a_flat_key_wins_over_the_same_field_in_its_section() -> None:
    config = ServeConfig(max_loras=4, engine={"max_loras": 5})
    assert config.engine.max_loras == 4, "the flat key is the later, more specific spelling"


def test_the_engine_section_runs_the_top_level_model() -> None:
    assert ServeConfig(model="demo").engine.model == "demo", "the engine's model is the top-level model"
    with pytest.raises(ConfigError, match=r"engine\.model"):
        build_config(ServeConfig, model="demo", engine={"model": "other"})


@pytest.mark.parametrize(("args", "names"), [
    ({"cluster_queue_size": 0}, "cluster_queue_size"),
    ({"controller": {"cluster_queue_size": 0}}, "cluster_queue_size"),
    ({"no_such_field": 1}, "no_such_field"),
    ({"router": {"no_such_field": 1}}, "no_such_field"),
    ({"default_max_tokens": 2048, "max_new_tokens": 1024}, "default_max_tokens"),
])
def test_a_bad_value_flat_or_nested_is_a_config_error_naming_the_field(args: dict, names: str) -> None:
    with pytest.raises(ConfigError, match=names):
        load_config(args)


def test_a_bad_json_variable_is_an_error_naming_the_variable(monkeypatch) -> None:
    monkeypatch.setenv(env_var("open_routes"), "/health")
    with pytest.raises(ConfigError, match="LORA_CLUSTER_OPEN_ROUTES"):
        load_config({})


def test_a_dumped_config_builds_the_same_config() -> None:
    config = load_config({"max_loras": 3, "controller_shards": 2, "max_n": 4})
    assert load_config(config.model_dump()) == config, "model_dump -> load_config round-trips (as the app)"
