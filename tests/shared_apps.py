"""The Ray Serve applications that several end-to-end modules share, one deploy each (conftest's
`demo_app`, `bases_app` and `tenants_app` fixtures; `ray_app.run_app` keeps an application deployed for
the next module that asks for the same configuration, and conftest runs such modules one after the
other). A shared configuration holds every value that one of its modules relies on; a module whose
tests need a value another one cannot take, or that changes its app for good (kills a deployment's
actor, an environment of its own), keeps an app of its own.

* `demo_config`: the tiny demo zoo on two LoRA replicas with a 64-token prompt limit, a small router
  queue and cluster queue (test_serve_e2e: limits, overload, affinity over both replicas;
  test_structured_output_e2e: grammars and best_of, n at most 4).
* `Bases` / `bases_config`: several base models in one cluster, a replica group per base (test_multi_base_e2e:
  the demo Llama and a Qwen3 checkpoint with its own tokenizer; test_family_serve_e2e: Phi-3, Gemma 2
  and Mixtral, each with its adapters renamed `<arch>-a<i>` so that no id is listed under two bases;
  test_tool_calls_e2e: the demo Llama group's tool-capable chat template, 16 batch slots and 512
  batched tokens so that a whole batch of 16 tool-call requests of 368 prompt tokens runs at once).
* `tenants_yaml` / `tenants_config`: four ingress replicas, the cluster controller, one LoRA replica
  of two batch slots and a tenants file (test_ingress_replicas_e2e: spread, quota, registrations and
  parked requests across the ingresses; test_quotas_e2e: one tenant held to its quota across the
  ingresses while another is served; test_usage_e2e: usage records reach the store, flushed every
  0.2 s; test_releases_e2e: a release state folder, and eval gates' leases of 4 s so that a gate
  whose ingress is killed is taken over within seconds). Each module's tenants are its own, so
  neither spends the other's quota.
"""

from __future__ import annotations

import json
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from other_tokenizer import write_other_tokenizer

from lora_cluster.demo import DemoZoo
from lora_cluster.tenancy.tenants import hash_key

# ----- the demo app -----

MAX_PROMPT_TOKENS = 64


def demo_config(demo_zoo: DemoZoo) -> dict[str, Any]:
    return {
        "model": str(demo_zoo.model_dir), "adapter_source": [str(demo_zoo.adapters_dir)],
        "num_replicas": 2, "num_cpus": 1, "max_loras": 4, "max_lora_rank": 32, "max_num_seqs": 8,
        "max_num_batched_tokens": 256, "max_prompt_tokens": MAX_PROMPT_TOKENS, "max_new_tokens": 400,
        "max_n": 4, "max_ongoing_requests": 8, "max_queued_requests": 4, "routing_stats_period_s": 0.5,
        "cluster_queue_size": 4,
    }


# ----- several bases -----

LLAMA, QWEN = "llama-tiny", "qwen3-tiny"
QWEN_ADAPTERS = ["q0", "q1"]
FAMILIES = ("phi3", "gemma2", "mixtral")


@dataclass(frozen=True)
class Bases:
    """The checkpoints of the several-bases app besides the demo zoo: the Qwen3 base (`qwen_model`, in
    a folder named `qwen3-tiny`, a tokenizer of its own) with its adapters q0, q1 (`qwen_adapters`), and
    each family's zoo (`families[arch]`: its adapters renamed `<arch>-a<i>`)."""

    qwen_model: Path
    qwen_adapters: Path
    families: dict[str, DemoZoo]


def build_bases(root: Path) -> Bases:
    """The tiny Qwen3 checkpoint in a folder named `qwen3-tiny`, with a tokenizer of its own, and its PEFT
    adapters as q0, q1 declaring `org/qwen3-tiny` as their base (a hub id and a local copy of it match
    by their last component); each family's tiny zoo of 3 adapters, copied under ids of its own."""
    from lora_cluster.demo_families import build_family_zoo

    zoo = build_family_zoo(root / "qwen-zoo", "qwen3", num_adapters=2)
    qwen_model = root / QWEN
    shutil.copytree(zoo.model_dir, qwen_model)
    write_other_tokenizer(qwen_model)
    qwen_adapters = root / "qwen-adapters"
    for index, name in enumerate(QWEN_ADAPTERS):
        shutil.copytree(zoo.adapters_dir / f"a{index}", qwen_adapters / name)
        config_file = qwen_adapters / name / "adapter_config.json"
        config = json.loads(config_file.read_text())
        config["base_model_name_or_path"] = f"org/{QWEN}"
        config_file.write_text(json.dumps(config))
    families = {}
    for arch in FAMILIES:
        built = build_family_zoo(root / arch, arch, num_adapters=3)
        renamed = root / f"{arch}-adapters"
        for adapter_id in built.adapter_ids:
            shutil.copytree(built.adapters_dir / adapter_id, renamed / f"{arch}-{adapter_id}")
        families[arch] = DemoZoo(built.model_dir, renamed, [f"{arch}-{a}" for a in built.adapter_ids])
    return Bases(qwen_model, qwen_adapters, families)


def bases_config(demo_zoo: DemoZoo, bases: Bases) -> dict[str, Any]:
    """A replica group per base, one replica each (half a CPU: five fit the local Ray's four): `llama`
    (the demo zoo, served as `llama-tiny`), `qwen` (`qwen3-tiny`) and each family's (its `model` folder
    as its name)."""
    families = [{"name": arch, "model": str(zoo.model_dir),
                 "engine": {"adapter_source": [str(zoo.adapters_dir)]}}
                for arch, zoo in bases.families.items()]
    return {
        "model": str(demo_zoo.model_dir), "served_model_name": LLAMA,
        "adapter_source": [str(demo_zoo.adapters_dir)], "num_cpus": 0.5, "max_loras": 2, "max_lora_rank": 64,
        "max_num_seqs": 4, "routing_stats_period_s": 0.5, "controller_report_period_s": 0.25,
        "replica_groups": [
            {"name": "llama", "engine": {"max_loras": 4, "max_num_seqs": 16, "max_num_batched_tokens": 512}},
            {"name": "qwen", "model": str(bases.qwen_model), "served_model_name": QWEN,
             "engine": {"adapter_source": [str(bases.qwen_adapters)]}},
            *families,
        ],
    }


# ----- several ingresses and a tenants file -----

INGRESSES = 4
RPM = 8  # the requests_per_minute of each module's limited tenant
ADMIN = "sk-admin-0123456789"  # test_ingress_replicas_e2e's admin and limited tenant (`finance`)
FIN = "sk-fin-0123456789"
QUOTA_ADMIN = "sk-admin"  # test_quotas_e2e's admin, its limited tenant (`quota-fin`) and another (`quota-hr`)
QUOTA_FIN, QUOTA_HR = "sk-fin-quota", "sk-hr-quota"
USAGE_A, USAGE_B = "sk-usage-a-0123", "sk-usage-b-0123"  # test_usage_e2e's tenants `usage-a`, `usage-b`
RELEASER = "sk-releases-0123"  # test_releases_e2e's tenant `releases`
USAGE_CAPPED = "sk-usage-capped-0123"  # test_usage_e2e's tenant `usage-capped`: a 1-token monthly budget
USAGE_CHAOS = "sk-usage-chaos-0123"  # test_usage_e2e's tenant `usage-chaos`: its chaos test's requests


def tenants_yaml() -> str:
    return f"""
admin_api_keys: ["{hash_key(ADMIN)}", "{hash_key(QUOTA_ADMIN)}"]
tenants:
  - name: finance
    api_keys: ["{hash_key(FIN)}"]
    adapters: ["a*"]
    requests_per_minute: {RPM}
  - name: quota-fin
    api_keys: ["{hash_key(QUOTA_FIN)}"]
    adapters: ["a*"]
    requests_per_minute: {RPM}
  - name: quota-hr
    api_keys: ["{hash_key(QUOTA_HR)}"]
    adapters: ["a*"]
  - name: usage-a
    api_keys: ["{hash_key(USAGE_A)}"]
    adapters: ["a*"]
  - name: usage-b
    api_keys: ["{hash_key(USAGE_B)}"]
    adapters: ["a*"]
  - name: releases
    api_keys: ["{hash_key(RELEASER)}"]
    adapters: ["a*"]
  - name: usage-capped
    api_keys: ["{hash_key(USAGE_CAPPED)}"]
    adapters: ["a*"]
    budget: {{tokens_per_month: 1, action: refuse}}
  - name: usage-chaos
    api_keys: ["{hash_key(USAGE_CHAOS)}"]
    adapters: ["a*"]
"""


def tenants_config(demo_zoo: DemoZoo, tenants_file: Path) -> dict[str, Any]:
    return {"model": str(demo_zoo.model_dir), "adapter_source": [str(demo_zoo.adapters_dir)],
            "num_replicas": 1, "num_cpus": 1, "max_loras": 4, "max_lora_rank": 32, "max_num_seqs": 2,
            "max_num_batched_tokens": 64, "ingress_num_replicas": INGRESSES, "admission_window_max": 0,
            "routing_stats_period_s": 0.2, "controller_report_period_s": 0.2,
            "tenants_file": str(tenants_file), "usage_flush_s": 0.2,
            "release_state_uri": str(tenants_file.parent / "release-state"), "usage_budget_refresh_s": 0.5,
            "release_lease_s": 4.0}
