"""Deployment manifests: serve_config.yaml and the KubeRay RayService carry valid application args,
and every manifest of deploy/k8s validates against the KubeRay and Prometheus Operator CRDs (the
team's `validate_k8s.py` and the CRDs it reads, vendored in `tools/` and `specs/`, so that the check
runs on every clone)."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from itertools import pairwise
from pathlib import Path

import pytest
import yaml

from lora_cluster.config import ServeConfig

ROOT = Path(__file__).resolve().parents[2]
VALIDATOR = ROOT / "tools" / "validate_k8s.py"


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
    assert config.engine.adapter_source == ["s3://lora-adapters/prod"], (
        "the RayService reads adapters from the prod bucket"
    )


def _validate(path: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(VALIDATOR), str(path)], capture_output=True, text=True,
                          check=False, timeout=300)


def test_rayservice_manifest_validates_against_kuberay_crd() -> None:
    result = _validate(ROOT / "deploy/k8s")
    assert result.returncode == 0, (
        f"deploy/k8s validates against the KubeRay CRD:\n{result.stdout}{result.stderr}"
    )
    checked = [line for line in result.stdout.splitlines() if " CRD " in line]
    assert any("RayService/lora-cluster " in line for line in checked), f"RayService checked: {checked}"
    assert any("PodMonitor/" in line for line in checked), f"the PodMonitor was checked: {checked}"


def test_the_validator_refuses_a_field_the_crd_does_not_declare(tmp_path: Path) -> None:
    docs = _docs("deploy/k8s/rayservice.yaml")
    service = next(d for d in docs if d["kind"] == "RayService")
    service["spec"]["rayClusterConfig"]["headGroupSpec"]["rayStartParamz"] = {}
    manifest = tmp_path / "rayservice.yaml"
    manifest.write_text(yaml.safe_dump(service))
    result = _validate(manifest)
    assert result.returncode == 1, f"an undeclared field fails validation: {result.stdout}{result.stderr}"
    assert "rayStartParamz" in result.stdout, f"the failure names the field: {result.stdout}"


# ----- observability and autoscaling (issue 11) -------------------------------------------------


def _docs(path: str) -> list[dict]:
    return [d for d in yaml.safe_load_all((ROOT / path).read_text()) if d]


def _rules() -> dict[str, dict]:
    (rule,) = [d for d in _docs("deploy/k8s/monitoring.yaml") if d["kind"] == "PrometheusRule"]
    return {r["alert"]: r for g in rule["spec"]["groups"] for r in g["rules"] if "alert" in r}


@pytest.mark.parametrize(("alerts", "metric", "thresholds"), [
    (("LoraAdapterSwitchRateHigh", "LoraAdapterSwitchRateCritical"), "lora_cluster_adapter_switches_total",
     (3, 5)),
    (("LoraAdapterLoadLatencyHigh", "LoraAdapterLoadLatencyCritical"),
     "lora_cluster_adapter_load_duration_seconds", (0.05, 0.1)),
    (("LoraRoutingErrorRateHigh", "LoraRoutingErrorRateCritical"), "lora_cluster_routing_errors_total",
     (0.01, 0.03)),
    (("LoraMemoryFragmentationHigh", "LoraMemoryFragmentationCritical"),
     "lora_cluster_adapter_pool_fragmentation_ratio", (0.2, 0.3)),
])
def test_alerts_carry_seed_001_thresholds_as_warning_critical_pairs(alerts, metric, thresholds):
    rules = _rules()
    for alert, severity, threshold in zip(alerts, ("warning", "critical"), thresholds, strict=True):
        assert alert in rules, f"the PrometheusRule has {alert}"
        rule = rules[alert]
        assert rule["labels"]["severity"] == severity, f"{alert} is a {severity} alert"
        assert metric in rule["expr"], f"{alert} watches {metric}"
        assert rule["expr"].rstrip().endswith(f"> {threshold}"), f"{alert} fires above {threshold}"


def test_alerts_cover_sla_attainment_per_class_and_replica_health():
    rules = _rules()
    sla = [r for r in rules.values() if "lora_cluster_slo_requests_total" in r["expr"]]
    severities = {r["labels"]["severity"] for r in sla}
    assert severities == {"warning", "critical"}, "SLA attainment: a warning and a critical alert"
    assert all("by (priority_class)" in r["expr"] for r in sla), "SLA attainment is computed per class"
    assert "LoraNoReplicas" in rules, "an alert when no replica runs"
    assert "LoraMetricsAbsent" in rules, "an alert when the scrape is missing"


def test_the_pod_monitor_scrapes_the_ingress_once_and_every_ray_pod():
    (monitor,) = [d for d in _docs("deploy/k8s/monitoring.yaml") if d["kind"] == "PodMonitor"]
    service = next(d for d in _docs("deploy/k8s/rayservice.yaml") if d["kind"] == "RayService")
    cluster = service["spec"]["rayClusterConfig"]
    templates = [cluster["headGroupSpec"]["template"], *(g["template"] for g in cluster["workerGroupSpecs"])]
    selector = monitor["spec"]["selector"]["matchLabels"]
    for template in templates:
        labels = template["metadata"]["labels"]
        assert all(labels.get(k) == v for k, v in selector.items()), "every Ray pod matches the PodMonitor"
    endpoints = {e["port"]: e for e in monitor["spec"]["podMetricsEndpoints"]}
    assert endpoints["serve"]["path"] == "/metrics", "the app's /metrics through the Serve proxy"
    keep = endpoints["serve"]["relabelings"][0]
    assert (keep["action"], keep["regex"]) == ("keep", "head"), "the ingress is scraped through the head only"
    ports = [{p["name"] for c in t["spec"]["containers"] for p in c.get("ports", [])} for t in templates]
    assert all("metrics" in p for p in ports), "every Ray pod exposes Ray's metrics port"


def test_metrics_stay_off_the_public_port_and_the_pod_monitor_sends_a_key():
    service = next(d for d in _docs("deploy/k8s/rayservice.yaml") if d["kind"] == "RayService")
    (app,) = _apps(yaml.safe_load(service["spec"]["serveConfigV2"]))
    open_routes = ServeConfig(**app["args"]).tenancy.open_routes
    assert open_routes == ["/health"], f"only the probes' route answers without a key: {open_routes}"
    assert ServeConfig(model="m").tenancy.open_routes == ["/health"], "and so does the default"
    docs = _docs("deploy/k8s/monitoring.yaml")
    (monitor,) = [d for d in docs if d["kind"] == "PodMonitor"]
    serve = next(e for e in monitor["spec"]["podMetricsEndpoints"] if e["port"] == "serve")
    credentials = serve["authorization"]["credentials"]
    assert serve["authorization"]["type"] == "Bearer", "Prometheus sends `Authorization: Bearer <key>`"
    secrets = {d["metadata"]["name"]: d for d in docs if d["kind"] == "Secret"}
    assert credentials["key"] in secrets[credentials["name"]]["stringData"], "the key is in a Secret"


def test_rayservice_autoscales_replicas_and_gpu_workers():
    from lora_cluster.serve.app import replica_options

    service = next(d for d in _docs("deploy/k8s/rayservice.yaml") if d["kind"] == "RayService")
    (app,) = _apps(yaml.safe_load(service["spec"]["serveConfigV2"]))
    options = replica_options(ServeConfig(**app["args"]))
    scaling = options["autoscaling_config"]
    assert scaling["min_replicas"] < scaling["max_replicas"], "Serve scales the LoRA replicas between bounds"
    assert scaling["target_ongoing_requests"] < app["args"]["max_num_seqs"], (
        "the target is under a replica's batch slots, so that full replicas scale out")
    cluster = service["spec"]["rayClusterConfig"]
    assert cluster["enableInTreeAutoscaling"] is True, "KubeRay's autoscaler adds and removes worker pods"
    (gpu,) = cluster["workerGroupSpecs"]
    assert gpu["maxReplicas"] >= scaling["max_replicas"], "enough GPU pods for the most replicas"
    spec = gpu["template"]["spec"]
    assert spec["nodeSelector"], "GPU workers run on GPU nodes"
    assert any(t["key"] == "nvidia.com/gpu" for t in spec["tolerations"]), "GPU workers tolerate GPU taints"
    for template in (cluster["headGroupSpec"]["template"], gpu["template"]):
        (container,) = template["spec"]["containers"]
        assert "readinessProbe" in container, f"{container['name']} has a readiness probe"
        assert "livenessProbe" in container, f"{container['name']} has a liveness probe"


def test_serve_config_documents_autoscaling_and_metric_bounds():
    text = (ROOT / "serve_config.yaml").read_text()
    for field in ("autoscaling_config", "target_ongoing_requests", "metrics_max_adapter_labels"):
        assert field in text, f"serve_config.yaml documents {field}"


def test_dashboard_has_the_sections_and_variables():
    dashboard = json.loads((ROOT / "deploy/grafana/lora-cluster.json").read_text())
    variables = {v["name"] for v in dashboard["templating"]["list"]}
    assert {"tenant", "adapter"} <= variables, f"the dashboard has tenant and adapter variables: {variables}"
    rows = {p["title"] for p in dashboard["panels"] if p["type"] == "row"}
    for section in ("Cluster overview", "Per tenant", "Per adapter (top N)", "Adapter cache tiers",
                    "Memory and engines", "SLA attainment", "Prefix cache", "Usage by tenant", "Releases"):
        assert section in rows, f"the dashboard has a '{section}' row"
    panels = [p for p in dashboard["panels"] if p["type"] != "row"]
    assert all(p["targets"] and all(t["expr"] for t in p["targets"]) for p in panels), "every panel queries"
    assert any("topk($topn" in t["expr"] for p in panels for t in p["targets"]), "adapters are shown top N"


def test_the_usage_row_queries_declared_usage_counters_by_tenant():
    from lora_cluster.serve.ops import metrics
    from lora_cluster.tenancy.budget import ALERT_RATIO

    dashboard = json.loads((ROOT / "deploy/grafana/lora-cluster.json").read_text())
    rows = [p for p in dashboard["panels"] if p["type"] == "row"]
    (usage_row,) = [r for r in rows if r["title"] == "Usage by tenant"]
    below = [r["gridPos"]["y"] for r in rows if r["gridPos"]["y"] > usage_row["gridPos"]["y"]]
    end = min(below, default=float("inf"))
    panels = [p for p in dashboard["panels"] if p["type"] != "row"
              and usage_row["gridPos"]["y"] < p["gridPos"]["y"] < end]
    exprs = [t["expr"] for p in panels for t in p["targets"]]
    declared = {m._name for m in metrics.REQUEST_METRICS}  # prometheus_client's name, no _total suffix
    declared.add(metrics.USAGE_BUDGET_USED.name)
    used = set(re.findall(r"lora_cluster_usage_\w+", " ".join(exprs)))
    assert len(panels) >= 4, \
        f"the row shows device time, tokens, requests and budgets: {[p['title'] for p in panels]}"
    assert used and all(name.removesuffix("_total") in declared for name in used), \
        f"every usage metric the row queries is declared in serve.ops.metrics: {used}"
    assert all("by (tenant" in e for e in exprs), "every usage panel is per tenant"
    gauges = [p for p in panels if p["type"] == "gauge"]
    assert [t["expr"] for p in gauges for t in p["targets"]] == [
        'max by (tenant, budget) (lora_cluster_usage_budget_used_ratio{tenant=~"$tenant"})'], \
        "one gauge shows each tenant's budgets used, one series per tenant and budget across ingresses"
    steps = [s["value"] for p in gauges for s in p["fieldConfig"]["defaults"]["thresholds"]["steps"]]
    assert steps == [None, ALERT_RATIO, 1.0], "the gauge turns at the alerts' 80% and at 100%"
    cells = sorted((p["gridPos"]["y"], p["gridPos"]["x"], p["gridPos"]["w"]) for p in panels)
    assert all(a[0] != b[0] or a[1] + a[2] <= b[1] for a, b in pairwise(cells)) and \
        all(x + w <= 24 for _, x, w in cells), f"the row's panels do not overlap: {cells}"


def test_the_budget_alerts_read_the_declared_gauge_at_80_and_100_percent():
    from lora_cluster.serve.ops.metrics import USAGE_BUDGET_USED
    from lora_cluster.tenancy.budget import ALERT_RATIO

    (rule,) = [d for d in _docs("deploy/k8s/usage-budgets.yaml") if d["kind"] == "PrometheusRule"]
    alerts = {r["alert"]: r["expr"] for g in rule["spec"]["groups"] for r in g["rules"]}
    assert all(USAGE_BUDGET_USED.name in expr for expr in alerts.values()), \
        f"the alerts read the gauge declared in serve.ops.metrics: {alerts}"
    thresholds = sorted(float(expr.rsplit(">=", 1)[1]) for expr in alerts.values())
    assert thresholds == [ALERT_RATIO, 1.0], f"a warning at 80% and a critical alert at 100%: {alerts}"


# ----- adapter releases (issue 47): the Releases row and the release alerts -----------------------------


def _declared_metrics() -> set[str]:
    """Every metric name serve.ops.metrics declares: measured (prometheus_client's name, no `_total`),
    computed at each scrape (`ScrapeFamily`), or named in its tables of report fields."""
    from prometheus_client.metrics import MetricWrapperBase

    from lora_cluster.serve.ops import metrics

    def names(value: object) -> set[str]:
        if isinstance(value, str):
            return {value} if value.startswith("lora_cluster_") else set()
        if isinstance(value, dict):
            return names(list(value.keys())) | names(list(value.values()))
        if isinstance(value, list | tuple | set | frozenset):
            return set().union(*(names(v) for v in value)) if value else set()
        return set()

    declared = set()
    for value in vars(metrics).values():
        if isinstance(value, MetricWrapperBase):
            declared |= {family.name for family in value.describe()}
        elif isinstance(value, metrics.ScrapeFamily):
            declared.add(value.name)
        else:
            declared |= names(value)
    return declared


def _metric_base(sample: str) -> str:
    """The metric a sample name belongs to (a histogram's `_bucket`, `_count`, `_sum`; a counter's
    `_total`)."""
    for suffix in ("_bucket", "_count", "_sum", "_total"):
        if sample.endswith(suffix):
            return sample.removesuffix(suffix)
    return sample


def _row_panels(title: str) -> list[dict]:
    dashboard = json.loads((ROOT / "deploy/grafana/lora-cluster.json").read_text())
    rows = [p for p in dashboard["panels"] if p["type"] == "row"]
    (row,) = [r for r in rows if r["title"] == title]
    top = row["gridPos"]["y"]
    end = min((r["gridPos"]["y"] for r in rows if r["gridPos"]["y"] > top), default=float("inf"))
    return [p for p in dashboard["panels"] if p["type"] != "row" and top < p["gridPos"]["y"] < end]


def test_every_metric_the_dashboard_and_the_alerts_query_is_declared():
    declared = _declared_metrics()
    texts = {"deploy/grafana/lora-cluster.json": (ROOT / "deploy/grafana/lora-cluster.json").read_text()}
    texts |= {str(p.relative_to(ROOT)): p.read_text() for p in sorted((ROOT / "deploy/k8s").rglob("*.yaml"))}
    for where, text in texts.items():
        used = set(re.findall(r"lora_cluster_\w+", text))
        unknown = sorted(name for name in used if name not in declared and _metric_base(name) not in declared)
        assert not unknown, f"{where} queries metrics serve.ops.metrics does not declare: {unknown}"


def test_the_releases_row_shows_requests_errors_and_ttft_per_version_and_role_and_the_release_gauges():
    from lora_cluster.serve.ops.metrics import (
        RELEASE_CANDIDATE_SHARE,
        RELEASE_ROLLBACK_TIME,
        RELEASE_STEP_SECONDS,
        RELEASE_VERSION_ERRORS,
        RELEASE_VERSION_REQUESTS,
        RELEASE_VERSION_TTFT,
    )

    panels = _row_panels("Releases")
    exprs = [t["expr"] for p in panels for t in p["targets"]]
    per_version = [e for e in exprs if "lora_cluster_release_version_" in e]
    for metric in (RELEASE_VERSION_REQUESTS, RELEASE_VERSION_ERRORS, RELEASE_VERSION_TTFT):
        (family,) = metric.describe()
        assert any(family.name in e for e in per_version), f"the row shows {family.name}"
    assert per_version and all("by (adapter, version, role" in e for e in per_version), \
        f"every per-version panel is per name, version and role: {per_version}"
    for family in (RELEASE_CANDIDATE_SHARE, RELEASE_STEP_SECONDS, RELEASE_ROLLBACK_TIME):
        assert any(family.name in e for e in exprs), f"the row shows {family.name}"
    assert all(p["targets"] and all(t["expr"] for t in p["targets"]) for p in panels), "every panel queries"


def test_the_release_alerts_fire_on_a_rollback_and_on_a_release_stuck_in_one_step():
    from lora_cluster.serve.ops.metrics import RELEASE_ROLLBACK_TIME, RELEASE_STEP_SECONDS

    (rule,) = [d for d in _docs("deploy/k8s/releases.yaml") if d["kind"] == "PrometheusRule"]
    alerts = {r["alert"]: r for g in rule["spec"]["groups"] for r in g["rules"]}
    rolled_back, stuck = alerts["LoraReleaseRolledBack"], alerts["LoraReleaseStuck"]
    assert RELEASE_ROLLBACK_TIME.name in rolled_back["expr"], "the rollback alert reads the rollback's time"
    assert "by (adapter, cause)" in rolled_back["expr"], "and names the adapter and the cause"
    assert RELEASE_STEP_SECONDS.name in stuck["expr"], "the stuck alert reads the seconds in the step"
    assert float(stuck["expr"].rsplit(">", 1)[1]) >= 600, f"above a bound of minutes: {stuck['expr']}"
    assert "paused" not in stuck["expr"].split("{", 1)[1].split("}", 1)[0], \
        "a release an operator paused is not stuck"
    assert {r["labels"]["severity"] for r in alerts.values()} == {"warning"}, "both are warnings"


# ----- replica groups (issue 10 part 6): a KubeRay worker group per business line ----------------------


def test_each_replica_group_runs_on_its_own_worker_group_and_nodes():
    from lora_cluster.serve.routing.replica_groups import replica_groups

    (service,) = [d for d in _docs("deploy/k8s/groups/rayservice.yaml") if d["kind"] == "RayService"]
    (app,) = _apps(yaml.safe_load(service["spec"]["serveConfigV2"]))
    groups = replica_groups(ServeConfig(**app["args"]))
    workers = {w["groupName"]: w for w in service["spec"]["rayClusterConfig"]["workerGroupSpecs"]}
    assert len(groups) >= 2, "the manifest deploys several business lines"
    for group in groups:
        line = group.node_labels.get("lora-group")
        assert line in workers, f"group {group.name}: a worker group for lora-group={line}"
        worker = workers[line]
        assert worker["labels"] == {"lora-group": line}, f"{line}: its Ray nodes carry the lora-group label"
        terms = worker["template"]["spec"]["affinity"]["nodeAffinity"][
            "requiredDuringSchedulingIgnoredDuringExecution"]["nodeSelectorTerms"]
        assert {"key": "lora-group", "operator": "In", "values": [line]} in terms[0]["matchExpressions"], (
            f"{line}: its pods are scheduled only on nodes labelled lora-group={line}")
        (container,) = worker["template"]["spec"]["containers"]
        gpus = int(container["resources"]["limits"]["nvidia.com/gpu"])
        assert worker["maxReplicas"] * gpus >= group.num_replicas * group.num_gpus, (
            f"{line}: its worker group has GPUs for all of the group's replicas")
