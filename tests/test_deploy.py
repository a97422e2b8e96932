"""Deployment manifests: serve_config.yaml and the KubeRay RayService carry valid application args."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from lora_cluster.config import ServeConfig

ROOT = Path(__file__).resolve().parent.parent
VALIDATOR = ROOT.parent / "shared" / "tools" / "validate_k8s.py"


def _apps(serve_config: dict) -> list[dict]:
    return serve_config["applications"]


def test_serve_config_yaml_builds_a_config() -> None:
    (app,) = _apps(yaml.safe_load((ROOT / "serve_config.yaml").read_text()))
    assert app["import_path"] == "lora_cluster.serve.app:build_app", (
        "serve_config.yaml deploys the app builder"
    )
    ServeConfig(**(app.get("args") or {}))


def test_rayservice_args_are_serve_config_fields() -> None:
    docs = list(yaml.safe_load_all((ROOT / "deploy/k8s/rayservice.yaml").read_text()))
    service = next(d for d in docs if d["kind"] == "RayService")
    (app,) = _apps(yaml.safe_load(service["spec"]["serveConfigV2"]))
    assert app["import_path"] == "lora_cluster.serve.app:build_app", "the RayService deploys the app builder"
    config = ServeConfig(**app["args"])
    assert config.num_gpus == 1, "the RayService reserves one GPU per LoRA replica"
    assert config.adapter_source == ["s3://lora-adapters/prod"], (
        "the RayService reads adapters from the prod bucket"
    )


@pytest.mark.skipif(not VALIDATOR.exists(), reason="shared/tools/validate_k8s.py is not beside the checkout")
def test_rayservice_manifest_validates_against_kuberay_crd() -> None:
    result = subprocess.run(
        [sys.executable, str(VALIDATOR), str(ROOT / "deploy/k8s")],
        capture_output=True,
        text=True,
        check=False,
    )
    assert result.returncode == 0, (
        f"deploy/k8s validates against the KubeRay CRD:\n{result.stdout}{result.stderr}"
    )
