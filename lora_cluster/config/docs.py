"""The configuration reference, generated from the fields: their descriptions and defaults.

The docs' field tables (between `<!-- config-table: KEYS -->` and `<!-- /config-table -->`, KEYS
naming groups of `GROUPS` or models of `NESTED`) and the commented application args of
serve_config.yaml (every line below its `args: {}`) are rendered from `ServeConfig` and its
sections (`SECTIONS`), `SlaClassConfig` and `ReplicaGroupConfig`; tests/config/test_config_docs.py fails
when a committed file differs. To change a description or a default, edit the field, then run

    python -m lora_cluster.config.docs          # rewrite the generated parts
    python -m lora_cluster.config.docs --check  # name the files that differ (exit status 1)

Every field of `ServeConfig` and of each of its sections is in exactly one group, each group in
one section; the docs show every group.
"""

from __future__ import annotations

import argparse
import os
import re
import textwrap
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import yaml
from pydantic import BaseModel
from pydantic_core import to_jsonable_python

from lora_cluster.config.parsing import format_bytes, is_byte_size
from lora_cluster.config.serve import FLAT, ReplicaGroupConfig, ServeConfig, SlaClassConfig

ROOT = Path(__file__).resolve().parents[2]
DOCS = ("README.md", "docs/serving.md", "docs/adapter-store.md", "docs/releases.md")
SERVE_YAML = "serve_config.yaml"
ARGS_LINE = "    args: {}\n"
YAML_INDENT = " " * 6
YAML_WIDTH = 110
DESCRIPTION_INDENT = " " * 4  # description lines; a value's own continuation lines are indented by 0 or 2

# Defaults that depend on the machine are shown as the rule that computes them.
SHOWN_DEFAULTS = {"demo_dir": "~/.cache/lora-cluster/demo-zoo"}


@dataclass(frozen=True)
class Group:
    key: str
    title: str
    section: str  # the `ServeConfig` section whose fields these are ("": the top level)
    fields: tuple[str, ...]
    see: tuple[str, str] | None = None  # (file from the repository root, #anchor) of the prose


SECTIONS: dict[str, type[BaseModel]] = {"": ServeConfig, **FLAT.sections}
"""Each section's model by its name ("": the top level); the docs walk `GROUPS`, each section's together."""

GROUPS = (
    Group("model", "Model and demo zoo", "",
          ("model", "served_model_name", "demo_dir", "demo_num_adapters", "demo_size")),
    Group("replicas", "Replicas, resources and autoscaling", "",
          ("num_replicas", "num_cpus", "num_gpus", "ingress_num_replicas", "ingress_num_cpus",
           "ingress_max_ongoing_requests", "autoscaling_config", "ingress_autoscaling_config"),
          ("docs/serving.md", "autoscaling")),
    Group("sla", "SLA classes", "",
          ("sla_classes", "default_priority_class"),
          ("docs/serving.md", "sla-classes")),
    Group("groups", "Replica groups", "",
          ("replica_groups",),
          ("docs/serving.md", "replica-groups")),
    Group("engine", "Engine: adapter slots and batching", "engine",
          ("max_loras", "max_lora_rank", "max_num_seqs", "max_model_len", "max_num_batched_tokens",
           "max_waiting", "kernel", "dtype", "device", "adapter_load_workers",
           "max_consecutive_step_failures",
           "less_urgent_prefill_chunk", "preempt_patience")),
    Group("memory", "KV cache, memory sizing and LoRA kernels", "engine",
          ("kv_block_size", "enable_prefix_caching", "num_kv_blocks", "gpu_memory_utilization",
           "adapter_pool_share", "memory_buffer_share", "lora_decode_kernel", "lora_fused_shrink",
           "lora_cpu_native"),
          ("docs/serving.md", "kv-cache-and-memory")),
    Group("store", "Adapter store and cache tiers", "engine",
          ("adapter_source", "adapter_store", "host_cache_bytes", "host_int8", "host_pin_memory",
           "disk_cache_dir", "disk_cache_bytes", "cluster_tier_bytes", "pinned", "preload",
           "negative_cache_ttl_s",
           "prefetch_window_s", "prefetch_min_requests", "prefetch_bytes_per_s", "prefetch_max_bytes",
           "prefetch_hot_period_s", "fetch_retries", "fetch_backoff_s",
           "fetch_timeout_s", "encryption_key_env", "encryption_key_file", "require_encryption",
           "require_checksum", "base_model_check"),
          ("docs/adapter-store.md", "tiers")),
    Group("rotation", "Adapter rotation and prefetch", "engine",
          ("adapter_min_steps", "adapter_wait_bounds_s", "adapter_wait_fraction", "adapter_max_wait_s",
           "adapter_prefetch_depth", "adapter_async_copy_bytes"),
          ("docs/adapter-store.md", "rotation-device-slots")),
    Group("logprobs", "Log probabilities and merged adapters", "engine",
          ("max_logprobs", "max_merged_adapter_ids", "max_merged_adapters", "merge_seed"),
          ("docs/serving.md", "log-probabilities")),
    Group("structured", "Structured output", "engine",
          ("guided_compile_timeout_s", "guided_grammar_cache_size"),
          ("docs/structured_output.md", "constrained-decoding-in-the-engine")),
    Group("breakers", "Overload protection: adapter protection, alerts and breakers", "engine",
          ("breakers", "breaker_switch_warn_per_s", "breaker_switch_trip_per_s",
           "breaker_switch_recover_per_s", "breaker_switch_recover_s", "breaker_switch_window_s",
           "breaker_load_warn_ms", "breaker_load_trip_ms", "breaker_load_recover_ms",
           "breaker_load_recover_loads", "breaker_source_failures",
           "breaker_source_cooldown_s", "breaker_cooldown_s"),
          ("docs/serving.md", "breakers")),
    Group("admission", "Admission: requests a replica and the router hold", "admission",
          ("max_ongoing_requests", "max_queued_requests", "admission_capacity", "admission_window_max"),
          ("docs/serving.md", "cluster-controller")),
    Group("routing", "Routing, and the ingress's routing-error breaker", "router",
          ("routing_stats_period_s", "router_miss_cost", "router_placement_ttl_s", "prefix_aware_routing",
           "prefix_routing_share", "breaker_routing_warn", "breaker_routing_trip",
           "breaker_routing_recover_requests"),
          ("docs/serving.md", "routing")),
    Group("controller", "Cluster controller: cluster queue, preemption, placement", "controller",
          ("enabled", "controller_shards", "controller_shard_heartbeat_s", "controller_gc_threshold",
           "cluster_queue_size",
           "cluster_queue_aging_s", "cluster_queue_timeout_s", "cluster_queue_max_wait_s",
           "cold_shed_window_s", "cold_shed_pressure", "edge_max_age_s",
           "preempt_after_fraction", "top_class_preempt_after_fraction", "controller_report_period_s",
           "controller_report_coalesce_s", "controller_report_budget_per_s", "controller_park_batch_max",
           "controller_batch_window_s", "placement_hot_share"),
          ("docs/serving.md", "cluster-controller")),
    Group("limits", "Request limits: each a 400 naming the limit (a long text prompt: prompt_truncation)",
          "api",
          ("max_prompt_tokens", "prompt_truncation", "max_new_tokens", "default_max_tokens", "max_n",
           "max_body_bytes", "max_json_depth", "max_stop_sequences", "max_stop_length", "max_prompts",
           "max_chat_messages", "tool_call_parser"),
          ("docs/serving.md", "input-limits")),
    Group("tenants", "Tenants, API keys and quotas", "tenancy",
          ("tenants_file", "tenants_reload_period_s", "open_routes", "quota_lease_s", "quota_ticket_ttl_s",
           "usage_db_path", "usage_store_uri", "usage_flush_s", "usage_spool_dir", "usage_budget_refresh_s",
           "usage_retention_s", "usage_export_uri", "usage_export_interval_s"),
          ("docs/serving.md", "tenants-and-quotas")),
    Group("ops", "Metrics and logs", "metrics",
          ("metrics_max_adapter_labels", "metrics_max_tenant_labels", "metrics_label_window_s", "log_format",
           "internal_access_log"),
          ("docs/serving.md", "metrics")),
    Group("releases", "Adapter releases: versions kept, canary steps and gates", "releases",
          ("release_versions_kept", "release_canary_steps", "release_step_min_requests",
           "release_step_dwell_s", "release_error_rate_margin", "release_gate_min_requests",
           "release_latency_attainment", "release_eval_margin", "release_max_events", "release_state_uri",
           "release_sync_s", "release_lease_s", "release_shadow_percent", "release_shadow_min_agreement"),
          ("docs/releases.md", "configuration")),
)
NESTED: dict[str, tuple[str, type[BaseModel]]] = {
    "sla_class": ("One entry of `sla_classes`", SlaClassConfig),
    "replica_group": ("One entry of `replica_groups`", ReplicaGroupConfig),
}
_MARKER = re.compile(r"(<!-- config-table: ([a-z_, ]+) -->\n)(.*?)(<!-- /config-table -->)", re.DOTALL)


def documented_fields(section: str) -> list[str]:
    """The fields of a section that the docs list: all of them, except the sections themselves at
    the top level and the engine's `model` (the top-level one)."""
    names = list(SECTIONS[section].model_fields)
    if section == "":
        return [n for n in names if n not in SECTIONS]
    return [n for n in names if not (section == "engine" and n == "model")]


def field_cell(section: str, name: str) -> str:
    """A field as the docs' tables name it: its path (`controller.cluster_queue_size`), with its flat
    name (keyword, yaml key and `LORA_CLUSTER_<FLAT>`) where that differs from the field's."""
    if not section:
        return f"`{name}`"
    flat = next((f for f, where in FLAT.where.items() if where == (section, name)), name)
    return f"`{section}.{name}`" + (f" (flat: `{flat}`)" if flat != name else "")


def default_of(model: type[BaseModel], name: str) -> object:
    """The default of a field as plain data (lists, dicts, numbers, strings, None)."""
    info = model.model_fields[name]
    if info.is_required():
        return None
    return to_jsonable_python(info.get_default(call_default_factory=True, validated_data={}))


def shown_default(model: type[BaseModel], name: str) -> object:
    """The default as written in the docs and the yaml: byte sizes in units, machine paths as a rule."""
    if name in SHOWN_DEFAULTS:
        return SHOWN_DEFAULTS[name]
    value = default_of(model, name)
    if isinstance(value, int) and is_byte_size(model.model_fields[name].metadata):
        return format_bytes(value)
    return value


def _flow(value: object) -> str:
    text = yaml.safe_dump(value, default_flow_style=True, width=10**6, sort_keys=False).strip()
    return text.removesuffix("\n...").strip()


def _description(model: type[BaseModel], name: str) -> str:
    return " ".join((model.model_fields[name].description or "").split())


def _rows(model: type[BaseModel], names: Sequence[str], section: str = "") -> str:
    lines = ["| field | default | meaning |", "|---|---|---|"]
    for name in names:
        required = model.model_fields[name].is_required()
        default = "required" if required else f"`{_flow(shown_default(model, name))}`"
        meaning = _description(model, name).replace("|", "\\|")
        lines.append(f"| {field_cell(section, name)} | {default} | {meaning} |")
    return "\n".join(lines)


def _link(see: tuple[str, str], doc: str) -> str:
    target, anchor = see
    if target == doc:
        return f"#{anchor}"
    return f"{os.path.relpath(ROOT / target, (ROOT / doc).parent)}#{anchor}"


def markdown_tables(keys: Sequence[str], doc: str) -> str:
    """The tables of the groups or nested models named by `keys`, for the file `doc` (its links)."""
    parts = []
    for key in keys:
        group = next((g for g in GROUPS if g.key == key), None)
        section = ""
        if group is not None:
            title, model, names, section = group.title, SECTIONS[group.section], group.fields, group.section
            see = f" ([more]({_link(group.see, doc)}))" if group.see else ""
        elif key in NESTED:
            title, model = NESTED[key]
            names, see = tuple(model.model_fields), ""
        else:
            raise ValueError(f"{doc}: config-table names {key!r}, not one of {', '.join(all_keys())}")
        if len(keys) > 1:
            parts.append(f"**{title}**{see}")
        parts.append(_rows(model, names, section))
    return "\n\n".join(parts)


def all_keys() -> list[str]:
    return [g.key for g in GROUPS] + list(NESTED)


def table_keys(text: str) -> list[list[str]]:
    """The keys of each config-table marker in a markdown text."""
    return [[k.strip() for k in m.group(2).split(",")] for m in _MARKER.finditer(text)]


def _yaml_value_lines(name: str, value: object) -> list[str]:
    """`name: value` in yaml: a list of mappings or a mapping one entry a line, anything else on one."""
    if isinstance(value, list) and value and all(isinstance(item, dict) for item in value):
        return [f"{name}:"] + [f"  - {_flow(item)}" for item in value]
    if isinstance(value, dict) and value:
        return [f"{name}:"] + [f"  {_flow({key: item})[1:-1]}" for key, item in value.items()]
    return [f"{name}: {_flow(value)}"]


def yaml_args() -> str:
    """The commented application args of serve_config.yaml: every field at its default, by group, each
    section's fields under its key (`engine:`, `controller:`, ...)."""
    out = [f"{YAML_INDENT}# {line}" for line in (
        "Every field of ServeConfig at its default, generated from its description by",
        "`python -m lora_cluster.config.docs` (edit the field in lora_cluster/config/, not this).",
        "A section's field may also be given flat, by its own name (max_loras: 16), as LORA_CLUSTER_<NAME>.",
        "Byte sizes: KiB/MiB/GiB are powers of 1024, kB/MB/GB powers of 1000.")]
    section = ""
    for group in GROUPS:
        model, indent = SECTIONS[group.section], "  " if group.section else ""
        see = f" ({group.see[0]}#{group.see[1]})" if group.see else ""
        head = f"{YAML_INDENT}# --- {group.title}{see} "
        out.append(head + "-" * max(3, YAML_WIDTH - len(head)))
        if group.section and group.section != section:
            out.append(f"{YAML_INDENT}# {group.section}:")
        section = group.section
        width = YAML_WIDTH - len(YAML_INDENT) - 2 - len(indent) - len(DESCRIPTION_INDENT)
        for name in group.fields:
            value = shown_default(model, name)
            out += [f"{YAML_INDENT}# {indent}{line}" for line in _yaml_value_lines(name, value)]
            text = textwrap.wrap(_description(model, name), width, break_long_words=False,
                                 break_on_hyphens=False)
            for example in model.model_fields[name].examples or []:
                text.append("Example:")
                text += [f"  {line}" for line in _yaml_value_lines(name, example)]
            out += [f"{YAML_INDENT}# {indent}{DESCRIPTION_INDENT}{line}".rstrip() for line in text]
    return "\n".join(out) + "\n"


def commented_args(text: str) -> dict[str, object]:
    """The values of the commented args of a serve_config.yaml text (what uncommenting them gives):
    top-level fields by name, a section's fields in a dict under its name."""
    block = text.split(ARGS_LINE, 1)[1]
    prefix = f"{YAML_INDENT}# "
    snippets: dict[tuple[str, str], list[str]] = {}
    current: list[str] | None = None
    section, indent = "", ""
    for line in block.splitlines():
        body = line.removeprefix(prefix) if line.startswith(prefix) else ""
        opened = re.fullmatch(r"([a-z]+):", body)
        if opened and opened.group(1) in SECTIONS and opened.group(1):
            section, indent, current = opened.group(1), "  ", None
            continue
        field = re.match(r"( {0,2})([a-z][a-z0-9_]*):", body)
        if field and field.group(1) == "" and field.group(2) in documented_fields(""):
            section, indent = "", ""
        if field and field.group(1) == indent and field.group(2) in documented_fields(section):
            current = snippets.setdefault((section, field.group(2)), [])
            current.append(body.removeprefix(indent))
        elif current is not None and re.match(indent + r"  \S", body):
            current.append(body.removeprefix(indent))  # a value's continuation: a list item or mapping entry
        else:
            current = None
    values: dict[str, object] = {}
    for (where, name), lines in snippets.items():
        value = yaml.safe_load("\n".join(lines))[name]
        if where:
            values.setdefault(where, {})[name] = value  # type: ignore[index]
        else:
            values[name] = value
    return values


def rendered(relpath: str) -> str:
    """What the file `relpath` (from the repository root) should hold."""
    text = (ROOT / relpath).read_text()
    if relpath == SERVE_YAML:
        head, sep, _ = text.partition(ARGS_LINE)
        if not sep:
            raise ValueError(f"{relpath} has no line {ARGS_LINE.strip()!r} to put the args under")
        return head + ARGS_LINE + yaml_args()
    return _MARKER.sub(lambda m: m.group(1) + markdown_tables(
        [k.strip() for k in m.group(2).split(",")], relpath) + "\n" + m.group(4), text)


def stale() -> list[str]:
    """The generated files whose committed text differs from the fields."""
    return [p for p in (SERVE_YAML, *DOCS) if (ROOT / p).read_text() != rendered(p)]


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m lora_cluster.config.docs",
                                     description="Write the config tables of the docs and serve_config.yaml.")
    parser.add_argument("--check", action="store_true", help="only name the files that differ (exit 1)")
    args = parser.parse_args(argv)
    files = stale()
    for path in files:
        if args.check:
            print(f"{path} differs from the config fields; run python -m lora_cluster.config.docs")
        else:
            (ROOT / path).write_text(rendered(path))
            print(f"wrote {path}")
    return 1 if files and args.check else 0


if __name__ == "__main__":
    raise SystemExit(main())
