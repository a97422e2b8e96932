"""How configuration values are read: byte sizes and their unit bases, environment overrides, errors
that name the field, and one place for the defaults (the simulator and the router read them)."""

from __future__ import annotations

import inspect
import subprocess
import sys

import pytest

from lora_cluster.config import EngineConfig, ServeConfig, build_config, env_var, parse_bytes, serve_defaults
from lora_cluster.config.parsing import format_bytes
from lora_cluster.errors import ConfigError


@pytest.mark.parametrize(("text", "size"), [
    ("4GiB", 4 << 30), ("4Gi", 4 << 30), ("4 gib", 4 << 30), ("512MiB", 512 << 20), ("1.5KiB", 1536),
    ("4G", 4 * 10**9), ("4GB", 4 * 10**9), ("500MB", 500 * 10**6), ("2k", 2000), ("1_000", 1000), ("7", 7),
])
def test_byte_sizes_use_the_documented_unit_bases(text: str, size: int) -> None:
    assert parse_bytes(text) == size, f"{text!r} is {size} bytes (IEC units: 1024, SI units: 1000)"


@pytest.mark.parametrize("size", [0, 7, 1000, 1024, 1 << 20, 4 << 30, 20 << 30, 500 * 10**6, 12345])
def test_formatted_byte_sizes_read_back_unchanged(size: int) -> None:
    assert parse_bytes(format_bytes(size)) == size, f"{format_bytes(size)!r} reads back as {size}"


def test_a_bad_byte_size_is_a_config_error_naming_the_field() -> None:
    with pytest.raises(ConfigError, match="max_body_bytes"):
        build_config(ServeConfig, max_body_bytes="huge")


def test_the_environment_overrides_defaults_and_arguments_override_the_environment(monkeypatch) -> None:
    monkeypatch.setenv(env_var("host_cache_bytes"), "2GiB")
    monkeypatch.setenv(env_var("pinned"), "a, b")
    assert env_var("host_cache_bytes") == "LORA_CLUSTER_HOST_CACHE_BYTES", "LORA_CLUSTER_<FIELD>"
    config = EngineConfig(model="m")
    assert config.host_cache_bytes == 2 << 30, "a byte size from the environment takes units"
    assert config.pinned == ["a", "b"], "a list from the environment is comma-separated"
    assert EngineConfig(model="m", host_cache_bytes=1 << 20).host_cache_bytes == 1 << 20, "an argument wins"


def test_serve_defaults_are_the_fields_defaults_whatever_the_environment(monkeypatch) -> None:
    monkeypatch.setenv(env_var("max_ongoing_requests"), "7")
    monkeypatch.setenv(env_var("num_replicas"), "3")
    built = ServeConfig()
    assert built.admission.max_ongoing_requests == 7, "a config built here reads a section field's variable"
    assert built.num_replicas == 3, "and a top-level field's"
    defaults = serve_defaults()
    for name, field in ServeConfig.model_fields.items():
        if field.default_factory is None:
            assert getattr(defaults, name) == field.default, f"serve_defaults().{name} is the field's default"
    for section in (defaults.router, defaults.admission, defaults.controller, defaults.api, defaults.tenancy,
                    defaults.metrics):
        for name, field in type(section).model_fields.items():
            if field.default_factory is None:
                assert getattr(section, name) == field.default, f"serve_defaults' {name} is its default"


def test_the_simulator_and_the_router_run_the_serving_defaults() -> None:
    from lora_cluster.serve.routing.request_router import LoraAffinityRouter
    from lora_cluster.sim.context import ServeSections

    defaults = serve_defaults()
    sections = ServeSections()
    assert sections.router == defaults.router, "the simulator's router section is ServeConfig's default"
    assert sections.admission == defaults.admission, "its admission section too"
    assert sections.controller == defaults.controller, "its controller section too"
    params = inspect.signature(LoraAffinityRouter.initialize_state).parameters
    assert params["router"].default is None, "the router runs the router section's defaults when given none"


def test_the_config_imports_nothing_above_it() -> None:
    code = ("import sys, lora_cluster.config, lora_cluster.config.docs; "
            "print(sorted(m for m in sys.modules if m.startswith('lora_cluster.') "
            "and not m.startswith(('lora_cluster.config', 'lora_cluster.errors', "
            "'lora_cluster.compiled'))))")  # the package's own import hook (lora_cluster/__init__.py)
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "[]", f"lora_cluster.config imports modules above it: {result.stdout}"
