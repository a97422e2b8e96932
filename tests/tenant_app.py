"""The ingress app in process with a tenants file in force: the tenants (finance, hr, an admin key),
their keys, and a fake replica serving a small zoo of adapters (`ZooDispatcher`, which refuses any
other adapter exactly as a replica does: through `describe`)."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
from app_client import FakeDispatcher, FakeTokenizer, serving

from lora_cluster.errors import AdapterNotFoundError
from lora_cluster.serve.http_errors import ApiException, describe
from lora_cluster.serve.protocol import GenerateJob
from lora_cluster.serve.routing.dispatch import Generation
from lora_cluster.tenancy.tenants import hash_key
from lora_cluster.tenancy.watch import TenantsWatcher

FIN_KEY, HR_KEY, ADMIN_KEY = "sk-fin-0123456789", "sk-hr-0123456789", "sk-admin-0123456789"
ZOO = ["fin-a", "fin-b", "shared-x", "hr-a", "hr-secret"]


def tenants_yaml(fin_key: str = FIN_KEY, hr_extra: str = "") -> str:
    return f"""
admin_api_keys: ["{hash_key(ADMIN_KEY)}"]
tenants:
  - name: finance
    api_keys: ["{hash_key(fin_key)}"]
    adapters: ["fin-*", "shared-*"]
    priority_class: interactive
  - name: hr
    api_keys: ["{hash_key(HR_KEY)}"]
    adapters: ["hr-*"]
    base_model: false
    priority_class: batch
{hr_extra}"""


class ZooDispatcher(FakeDispatcher):
    """A replica serving the adapters of ZOO: any other adapter is refused as a replica refuses it."""

    async def start(self, job: GenerateJob, route: str) -> Generation:
        if job.adapter_id is not None and job.adapter_id not in ZOO:
            error = AdapterNotFoundError(job.adapter_id, "not found in the configured adapter sources")
            raise ApiException(describe(error))
        return await super().start(job, route)

    async def any_replica(self, method: str, *args: Any, timeout_s: float = 30.0) -> Any:
        return list(ZOO) if method == "list_adapters" else "r1"


@contextlib.asynccontextmanager
async def tenant_app(tenants_file: Path, dispatcher: Any, period_s: float = 60.0,
                     watcher: TenantsWatcher | None = None,
                     **context: Any) -> AsyncIterator[httpx.AsyncClient]:
    """The app with `tenants_file` in force (re-read every `period_s`), or `watcher`'s when given;
    `context`: more ApiContext fields."""
    if watcher is None:
        watcher = TenantsWatcher(str(tenants_file), ("interactive", "standard", "batch"), period_s)
    try:
        async with serving(FakeTokenizer(), dispatcher, tenants=watcher, **context) as client:
            yield client
    finally:
        watcher.close()


def bearer(key: str) -> dict[str, str]:
    return {"authorization": f"Bearer {key}"}
