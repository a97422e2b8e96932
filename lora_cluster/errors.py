"""Domain exceptions.

Every error names what it is about (the adapter, the request, the model) and the limit that was
crossed, so that a user reading an HTTP error body knows what to change. The HTTP layer maps these
classes to status codes in one place (`lora_cluster.serve.http_errors`); nothing else picks codes.
"""

from __future__ import annotations


class LoraClusterError(Exception):
    """Base class of every error this project raises on purpose."""


class ConfigError(LoraClusterError):
    """The configuration or the served model cannot be used."""


class UnsupportedModelError(ConfigError):
    """The base model's architecture is not one this engine implements."""

    def __init__(self, model: str, architecture: str, supported: tuple[str, ...]):
        self.model, self.architecture, self.supported = model, architecture, supported
        super().__init__(
            f"model {model!r} has architecture {architecture!r}; supported architectures: "
            f"{', '.join(supported)}"
        )


class AdapterError(LoraClusterError):
    """Something is wrong with one adapter; the message names it and the reason."""

    def __init__(self, adapter_id: str, reason: str):
        self.adapter_id, self.reason = adapter_id, reason
        super().__init__(f"adapter {adapter_id!r}: {reason}")


class AdapterNotFoundError(AdapterError):
    """No configured source offers this adapter."""


class AdapterIdError(AdapterNotFoundError):
    """The adapter id is not a valid id (so no adapter can have it); the message says why."""


class AdapterVersionNotFoundError(AdapterNotFoundError):
    """`name@N` names a version that was never registered, or was retired (404)."""

    def __init__(self, name: str, number: int, reason: str):
        self.name, self.number = name, number
        super().__init__(f"{name}@{number}", reason)


class AdapterFormatError(AdapterError):
    """The adapter's files are not a valid PEFT LoRA adapter (pickle, corrupt safetensors, bad config)."""


class AdapterRankError(AdapterError):
    """The adapter's rank exceeds the engine's `max_lora_rank`."""

    def __init__(self, adapter_id: str, rank: int, max_rank: int):
        self.rank, self.max_rank = rank, max_rank
        super().__init__(adapter_id, f"rank {rank} exceeds max_lora_rank={max_rank}")


class AdapterShapeError(AdapterError):
    """The adapter's weights do not fit the served base model."""


class AdapterBaseModelError(AdapterShapeError):
    """The adapter declares another base model than the served one (refused with base_model_check=strict)."""


class AdapterBaseConflictError(AdapterError):
    """The adapter id exists under two base models of the cluster, so a request cannot say which."""


class AdapterIntegrityError(AdapterError):
    """Checksum mismatch, tampered or undecryptable file."""


class AdapterLoadError(AdapterError):
    """The adapter could not be fetched from its source (I/O, network) after retries."""


class AdapterSourceUnavailableError(AdapterLoadError):
    """The adapter's source is down (its circuit breaker is open): cold loads from it fail at once.
    `source` is the source's public name (scheme and bucket or repository); `retry_after_s` is when
    the breaker lets a probe through."""

    def __init__(self, adapter_id: str, source: str, retry_after_s: float):
        self.source, self.retry_after_s = source, retry_after_s
        super().__init__(adapter_id, f"adapter source {source} is unavailable (its circuit breaker is open "
                                     f"after repeated failures); retry in {retry_after_s:.0f} s")


class AdapterCapacityError(AdapterError):
    """The adapter cannot be placed: every slot or byte of a tier is held by adapters in use."""


class AdapterMergeError(AdapterError):
    """A merged adapter cannot be built from its adapters (ranks that differ for ties/dare, a merged
    rank above max_lora_rank); names the merged adapter and the limit (lora_cluster.store.merge)."""


class RequestError(LoraClusterError):
    """A request's parameters are invalid."""


class PromptTooLongError(RequestError):
    """The prompt has more tokens than the configured limit."""

    def __init__(self, prompt_tokens: int, limit: int):
        self.prompt_tokens, self.limit = prompt_tokens, limit
        super().__init__(f"prompt has {prompt_tokens} tokens; the limit is {limit} tokens")


class EngineOverloadedError(LoraClusterError):
    """The engine's waiting queue is full; the caller should retry later."""


class ClusterOverloadedError(LoraClusterError):
    """The cluster queue refused a request: it is full, or the request's class deadline cannot be
    met. `retry_after_s` is when a retry may succeed."""

    def __init__(self, message: str, retry_after_s: float):
        self.retry_after_s = retry_after_s
        super().__init__(message)


class QueueFullError(ClusterOverloadedError):
    """The cluster queue is full (`cluster_queue_size`) of requests at least as urgent (429 with
    Retry-After; `cluster.cluster_queue`)."""


class DeadlineOutOfReachError(ClusterOverloadedError):
    """The cluster queue refused a request because its predicted wait would miss its class's TTFT
    target (429). Its class is then shedding load (`cluster.shedding`)."""


class WaitBoundError(ClusterOverloadedError):
    """A request of a class without a TTFT target refused because its class's queued requests already
    wait half of `cluster_queue_max_wait_s` (429 with Retry-After; `cluster.cluster_queue`)."""


class ColdAdapterShedError(ClusterOverloadedError):
    """A request refused while its class sheds load, because no replica holds its adapter (429;
    `cluster.shedding`)."""


class RoutingUnavailableError(LoraClusterError):
    """The ingress's routing-error breaker is open: the request is shed (503, `retry_after_s`)."""

    def __init__(self, message: str, retry_after_s: float):
        self.retry_after_s = retry_after_s
        super().__init__(message)


class ClusterQueueTimeoutError(LoraClusterError):
    """A request waited in the cluster queue longer than `cluster_queue_timeout_s`."""


class ControllerOffError(LoraClusterError):
    """The cluster controller is not running (configured off, or unreachable)."""


class RegistryUnavailableError(LoraClusterError):
    """The adapter registry shared by the ingress replicas cannot be reached: an adapter cannot be
    loaded or unloaded through the vLLM API now (503)."""


class RequestAbortedError(LoraClusterError):
    """The request was cancelled before it finished."""


class EngineStepError(LoraClusterError):
    """An engine step failed (forward pass, sampling, detokenization); its requests end with this."""


class EngineUnavailableError(LoraClusterError):
    """The engine cannot serve: its loop has stopped, or steps keep failing (the replica is unhealthy)."""


# ----- tenants and quotas (lora_cluster.tenancy, serve/routing/auth.py) -----


class AuthenticationError(LoraClusterError):
    """The request carries no API key, or one that the tenants file does not know (401)."""

    def __init__(self, message: str, code: str):
        self.code = code
        super().__init__(message)


class PermissionDeniedError(LoraClusterError):
    """The caller's key is known but may not use this route (a tenant key on an admin route, 403)."""


class QuotaUnavailableError(LoraClusterError):
    """The quota ledger cannot be reached, so a tenant's quota cannot be checked (503)."""


class UsageUnavailableError(LoraClusterError):
    """The usage store cannot be read: usage is not recorded (`usage_db_path` empty), or its
    deployment cannot be reached (503)."""


class BudgetExceededError(LoraClusterError):
    """A tenant used all of a monthly budget whose action is `refuse` (tenancy.budget); names the
    tenant, the budget, its limit and the use; `retry_after_s` is when the month ends (429)."""

    def __init__(self, tenant: str, budget: str, limit: float, used: float, retry_after_s: float):
        self.tenant, self.budget, self.limit, self.used = tenant, budget, limit, used
        self.retry_after_s = retry_after_s
        super().__init__(f"tenant {tenant!r} has used its monthly budget: {budget}={limit:g}, used "
                         f"{used:g} this month (UTC); it resets in {retry_after_s / 86400:.1f} days")


class QuotaExceededError(LoraClusterError):
    """A tenant's quota refused a request; names the tenant and the limit, `retry_after_s` says when
    a retry may succeed (429)."""

    def __init__(self, tenant: str, limit: str, value: int, retry_after_s: float):
        self.tenant, self.limit, self.value, self.retry_after_s = tenant, limit, value, retry_after_s
        super().__init__(f"tenant {tenant!r} is over its quota: {limit}={value}; retry after "
                         f"{max(retry_after_s, 0.001):.3g} s")


# ----- adapter releases (lora_cluster.releases) -----


class ReleaseConflictError(LoraClusterError):
    """A release command that the release's state refuses (promote a rolled-back release, start a
    second release of a name that has one running); names the adapter, the release and its state (409)."""

    def __init__(self, adapter: str, release_id: str, message: str):
        self.adapter, self.release_id = adapter, release_id
        super().__init__(f"release {release_id!r} of adapter {adapter!r}: {message}")


class ReleaseStateUnavailableError(LoraClusterError):
    """The shared release state (`release_state_uri`) cannot be read or written, or other ingresses
    kept changing it through every retry; names the location's kind and the cause, never a path (503)."""

    def __init__(self, where: str, cause: str):
        self.where, self.cause = where, cause
        kind = "s3" if where.startswith("s3://") else "memory" if where == "memory" else "folder"
        super().__init__(f"the release state ({kind}, release_state_uri) is unavailable: {cause}; retry")


class ReleasePermissionError(PermissionDeniedError):
    """A tenant key asked to release an adapter that is not its own, or a candidate that is not one
    of its adapters in the configured sources; names the tenant and the adapter (403)."""

    def __init__(self, tenant: str | None, adapter: str, reason: str):
        self.tenant, self.adapter = tenant, adapter
        super().__init__(f"tenant {tenant!r} may not release adapter {adapter!r}: {reason}")
