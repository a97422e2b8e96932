"""What every API route of the ingress shares: the config, the dispatcher, and four parts, each one
concept: `tokens` (each base's tokenizer off the event loop, the prompt and chat limits:
`tokenization`), `models` (what a request's names run on: `model_names`) and `policy` (the caller and
its SLA class: `request_policy`), and `releases` (the adapters' releases: `releases.book`, kept with
the durable release state by `release_state`); plus the
generations' fan-in (`merge`, `finals`).

The context is the ingress's composition root: it builds the four parts from its fields, so a test
or the ingress gives it a config, a tokenizer and a dispatcher (and optionally each base's tokenizer,
the adapter registrations, the tenants and quotas) and every route reads the same parts. Call
`close()` when the ingress goes away.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Annotated, Any

from fastapi import Header

from lora_cluster.config import ServeConfig
from lora_cluster.config.engine import default_disk_cache_dir
from lora_cluster.errors import RequestAbortedError
from lora_cluster.releases.book import ReleaseBook
from lora_cluster.releases.gates import ReleaseSettings
from lora_cluster.releases.state_location import AUTO, StateLocation, locate_state
from lora_cluster.releases.state_store import open_state_store
from lora_cluster.serve.http.model_names import ModelNames
from lora_cluster.serve.http.registrations import AdapterRegistrations
from lora_cluster.serve.http.registry import LocalRegistrations, Registrations
from lora_cluster.serve.http.release_state import SharedReleases
from lora_cluster.serve.http.request_policy import RequestPolicy
from lora_cluster.serve.http.tokenization import ENCODE_THREADS, Tokenization
from lora_cluster.serve.http.usage_api import UsageReader
from lora_cluster.serve.ops import metrics_exposition, usage_metrics
from lora_cluster.serve.ops.metrics_hub import SharedMetrics
from lora_cluster.serve.ops.usage_budgets import BudgetGuard
from lora_cluster.serve.ops.usage_refusals import RefusalMeter
from lora_cluster.serve.routing.auth import Caller, TenantsSource
from lora_cluster.serve.routing.dispatch import Dispatcher, Generation
from lora_cluster.serve.routing.group_dispatch import GroupedDispatcher
from lora_cluster.serve.routing.quotas import Quotas

log = logging.getLogger(__name__)
_END = object()
HEADER_PRIORITY_CLASS = "x-lora-priority-class"  # response: the SLA class that served the request
# a route's `x_lora_priority: PriorityHeader = None` parameter reads the x-lora-priority header
PriorityHeader = Annotated[str | None, Header(description="The request's SLA class, by name.")]
# a route's `x_lora_user: UserHeader = None` parameter reads the x-lora-user header (releases.split)
UserHeader = Annotated[str | None, Header(max_length=256, description="The end user, for a sticky release "
                                          "split (the OpenAI routes' `user` field wins).")]
__all__ = ["HEADER_PRIORITY_CLASS", "ApiContext", "PriorityHeader", "UserHeader", "finals", "merge"]


@dataclass
class ApiContext:
    """Shared by the routes of one ingress (see the module docstring)."""

    config: ServeConfig
    tokenizer: Any  # the first base's
    dispatcher: Dispatcher | GroupedDispatcher
    tokenizers: dict[str, Any] = field(default_factory=dict)  # each base's, by API name (absent: the first's)
    # adapters loaded through the vLLM API: this process's, or shared by every ingress (http.registry);
    # an AdapterRegistrations given here is kept in this process
    registrations: Registrations | AdapterRegistrations = field(default_factory=LocalRegistrations)
    encode_threads: int = ENCODE_THREADS
    tenants: TenantsSource | None = None  # None: no tenants file, every route is open
    quotas: Quotas | None = None  # the tenants' quota ledger (None: quotas are not enforced)
    metrics_hub: SharedMetrics | None = None  # several ingress replicas: /metrics sums them (ops.metrics_hub)
    usage: UsageReader | None = None  # the usage store, read by GET /v1/usage (None: usage not recorded)
    # the usage records of the requests this ingress refuses (serve.ops.usage_refusals; default: none kept)
    refusals: RefusalMeter = field(default_factory=lambda: RefusalMeter(None, ""))
    ingress_id: str | None = None  # this ingress's replica id, owner of the eval gates it runs (None: random)
    budgets: BudgetGuard | None = field(init=False, repr=False)  # tenants' monthly budgets (with usage)
    releases: ReleaseBook = field(init=False, repr=False)  # this ingress's adapter releases
    release_state: SharedReleases = field(init=False, repr=False)  # the book kept with the durable state
    tokens: Tokenization = field(init=False, repr=False)
    models: ModelNames = field(init=False, repr=False)
    policy: RequestPolicy = field(init=False, repr=False)

    def __post_init__(self) -> None:
        if isinstance(self.registrations, AdapterRegistrations):
            self.registrations = LocalRegistrations(self.registrations)
        self.tokens = Tokenization(self.config, self.tokenizer, self.tokenizers, self.encode_threads)
        # a release outlives a step's dwell across restarts: a wall clock (releases.release)
        self.releases = ReleaseBook(ReleaseSettings.from_config(self.config.releases), time.time)
        store = open_state_store(self._state_location().uri, self.config.engine.adapter_source)
        self.release_state = SharedReleases(self.releases, store, self.registrations,
                                            self.config.releases.release_sync_s,
                                            self.config.releases.release_lease_s, owner=self.ingress_id)
        self.release_state.load()  # blocking: the ingress's constructor, off the event loop
        self.models = ModelNames(self.config, self.dispatcher, self.registrations, self.releases)
        self.policy = RequestPolicy(self.config, self.tenants, self.quotas)
        self.budgets = None if self.usage is None or self.tenants is None else BudgetGuard(
            self.usage, self.tenants, self.config.tenancy.usage_budget_refresh_s)

    def _state_location(self) -> StateLocation:
        """Where the release state is kept (`releases.state_location`); one WARNING when `auto`
        falls back to memory."""
        engine = self.config.engine
        tiered = engine.adapter_store == "tiered"  # only the tiered store has a disk tier
        disk = str(engine.disk_cache_dir or default_disk_cache_dir()) if tiered else None
        location = locate_state(self.config.releases.release_state_uri, engine.adapter_source, disk,
                                several_ingresses=not isinstance(self.registrations, LocalRegistrations))
        if location.kind == "memory" and self.config.releases.release_state_uri == AUTO:
            log.warning("releases are kept in this ingress's memory, lost on a restart (%s); set "
                        "release_state_uri to a folder or s3:// to keep them", location.reason)
        else:
            log.info("releases are kept in %s (%s)", location.kind, location.reason)
        return location

    def export_usage_metrics(self) -> None:
        """The usage counters' labels bounded by this context's tenants file and SLA classes, and the
        budget gauge in the scrape (`build_fastapi` calls this; `serve.ops.usage_metrics`)."""
        usage_metrics.configure(self.tenants, self.policy.sla.names)
        if self.budgets is not None:
            metrics_exposition.set_scrape_collector("budgets", self.budgets)

    def check_budget(self, caller: Caller) -> None:
        """429 `budget_exceeded` when the caller's tenant used up a `refuse` budget (`usage_budgets`)."""
        if self.budgets is not None:
            self.budgets.check(caller.principal.tenant)

    def budget_headers(self, caller: Caller) -> dict[str, str]:
        """`x-lora-budget-warning` when the caller's tenant used up a `warn` budget."""
        return {} if self.budgets is None else self.budgets.warning(caller.principal.tenant)

    def close(self) -> None:
        """Stop the tokenizer threads (jobs not started yet are dropped) and the metrics pushes."""
        self.tokens.close()
        self.release_state.stop()
        if self.metrics_hub is not None:
            self.metrics_hub.stop()
        if self.budgets is not None:
            self.budgets.close()

    @staticmethod
    def new_id(prefix: str) -> str:
        return f"{prefix}-{uuid.uuid4().hex}"


async def merge(generations: list[Generation]) -> AsyncIterator[tuple[int, dict[str, Any]]]:
    """(index, item) of several generations as they arrive; cancels them all when left early."""
    if len(generations) == 1:
        async for item in generations[0].items():
            yield 0, item
        return
    queue: asyncio.Queue = asyncio.Queue()

    async def pump(index: int, generation: Generation) -> None:
        try:
            async for item in generation.items():
                queue.put_nowait((index, item))
        except Exception as exc:
            queue.put_nowait((index, exc))
        except BaseException as exc:  # a cancelled choice ends the response with an error, not silently
            error = RequestAbortedError(f"choice {index} was cancelled ({type(exc).__name__})")
            queue.put_nowait((index, error))
            raise
        finally:
            queue.put_nowait((index, _END))

    tasks = [asyncio.create_task(pump(i, g)) for i, g in enumerate(generations)]
    try:
        remaining = len(tasks)
        while remaining:
            index, item = await queue.get()
            if item is _END:
                remaining -= 1
            elif isinstance(item, Exception):
                raise item
            else:
                yield index, item
    finally:
        for task in tasks:
            task.cancel()
        for g in generations:
            g.cancel()


async def finals(generations: list[Generation]) -> list[dict[str, Any]]:
    """Final items of every generation; on an error the others are cancelled and it is raised."""
    try:
        return list(await asyncio.gather(*(g.final() for g in generations)))
    except BaseException:
        for g in generations:
            g.cancel()
        raise
