"""The ingress's config sections: the HTTP API's limits (`api:`), tenancy (`tenancy:`) and
observability (`metrics:`). Each owner takes its section whole; each field keeps its flat
`LORA_CLUSTER_<FIELD>` variable and flat serve_config.yaml key as aliases (config.flat_aliases)."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, Field, field_validator, model_validator

from lora_cluster.config.parsing import SECTION, ByteSize


class ApiConfig(BaseModel):
    """The HTTP API's section (`ServeConfig.api`, YAML `api:`): the limits of a request (each a 400
    naming the limit) and how answers are read for tool calls."""

    model_config = SECTION

    max_prompt_tokens: int | None = Field(
        None,
        ge=1,
        description="Longest prompt in tokens; longer text is fitted or refused as "
        "prompt_truncation says, longer token ids are refused (400). Default: the engine's limit, "
        "max_model_len - 1.",
    )
    prompt_truncation: Literal["auto", "disabled"] = Field(
        "auto", description="A text prompt or chat conversation longer than the prompt limit: auto "
        "serves its most recent part (a text keeps its last tokens; a conversation its system messages "
        "and as many of its latest messages as fit) and says so in the x-lora-truncated-tokens header; "
        "disabled refuses it (400 prompt_too_long, as OpenAI and vLLM). Token-id prompts over the limit "
        "are refused either way (the API schema states their bound). Default auto: a prompt's token "
        "count is the one limit the API schema cannot state, so a schema-valid request is served.",
    )
    max_new_tokens: int = Field(
        1024, ge=1, description="Largest max_tokens / max_new_tokens a request may ask for (400 above)."
    )
    default_max_tokens: int = Field(
        256, ge=1, description="max_new_tokens of chat and LoRAX requests that give none (completions: 16)."
    )
    max_n: int = Field(16, ge=1, le=128, description="Largest `n` (choices per prompt) and `best_of` "
                       "(candidates generated per prompt) of OpenAI requests, and LoRAX's `best_of`.")
    max_body_bytes: ByteSize = Field(
        1 << 20, ge=1024, description="Largest request body in bytes (above: 400 body_too_large). Accepts "
        "suffixes: 1MiB."
    )
    max_json_depth: int = Field(
        32, ge=2, le=1000, description="Deepest nesting of arrays and objects in a JSON body (above: 400 "
        "json_too_deep)."
    )
    max_stop_sequences: int = Field(
        4, ge=0, le=256, description="Most stop strings one request may give (as OpenAI; 400 above)."
    )
    max_stop_length: int = Field(
        256, ge=1, description="Longest stop string in characters (400 above)."
    )
    max_prompts: int = Field(
        16, ge=1, le=4096, description="Most prompts in one /v1/completions request (400 above)."
    )
    max_chat_messages: int = Field(
        2048, ge=1, le=65536, description="Most messages in one /v1/chat/completions request (400 above). "
        "Default: OpenAI's limit of 2048; a conversation's tokens are bounded by max_prompt_tokens."
    )
    tool_call_parser: Literal["auto", "hermes", "llama3_json"] = Field(
        "auto", description="How chat answers with `tool_choice: auto` are read for tool calls (vLLM's "
        "names): hermes (`<tool_call>{...}</tool_call>`), llama3_json (`{\"name\", \"parameters\"}` "
        "objects, optionally after `<|python_tag|>`), or auto: from the base model's chat template "
        "(hermes when it writes `<tool_call>`, llama3_json when it writes `<|python_tag|>` or "
        "`\"parameters\"`, else hermes)."
    )

    @model_validator(mode="after")
    def _default_within_limit(self) -> ApiConfig:
        if self.default_max_tokens > self.max_new_tokens:
            raise ValueError(
                f"default_max_tokens={self.default_max_tokens} must be <= "
                f"max_new_tokens={self.max_new_tokens}"
            )
        return self


class TenancyConfig(BaseModel):
    """The tenancy section (`ServeConfig.tenancy`, YAML `tenancy:`): the tenants file, the routes open
    without a key, and the quota ledger's leases."""

    model_config = SECTION

    tenants_file: str | None = Field(
        None,
        description="YAML file of tenants (API key hashes, adapter patterns, SLA class, quotas) and admin "
        "keys; re-read when it changes (once the file has settled: a file caught mid-write is never "
        "taken). None: no keys, every route is open (local quickstart).",
    )
    tenants_reload_period_s: float = Field(
        2.0, gt=0, description="How often the ingress looks for a changed tenants file (in a thread)."
    )
    open_routes: list[str] = Field(
        default_factory=lambda: ["/health"],
        description="Routes (path templates, e.g. /health) answered without an API key while a tenants "
        "file is in force. Default: /health only (probes), safe behind a public ingress. Every other "
        "route needs a key: /openapi.json, /docs and /redoc any known key, /metrics an admin key (its "
        "`adapter` and `tenant` labels name every tenant's adapters). List one here only when the "
        "port is not public. A name that is not a route of the API stops the ingress from starting. "
        "Without a tenants file every route is open. Environment: a JSON list.",
    )
    quota_lease_s: float = Field(
        1.0,
        gt=0,
        le=60,
        description="Each ingress takes a tenant's quota from the shared ledger in leases of this many "
        "seconds of its rates and gives back the unused part after as long (see docs/serving.md).",
    )
    quota_ticket_ttl_s: float = Field(
        900.0,
        gt=0,
        description="Concurrency slots of a tenant held by an ingress that has not given back to the "
        "quota ledger for this long are released (the ingress died, or keeps taking without settling).",
    )
    usage_db_path: str = Field(
        "~/.local/state/lora-cluster/usage.db",
        description="The usage store (docs/metering.md): a SQLite file of one record per request and "
        "per-minute sums per tenant, adapter, version and SLA class, on the node of the usage-store "
        "deployment (`UsageSink`); `~` is "
        "the user's home. Empty: no usage is recorded. Read by `lora-cluster usage`.",
    )
    usage_flush_s: float = Field(
        5.0, gt=0, le=300,
        description="Each LoRA replica sends its usage records to the usage store in one call this "
        "often, and when it stops (docs/metering.md); at most 10,000 requests' records wait between "
        "two calls.",
    )
    usage_spool_dir: str = Field(
        "~/.local/state/lora-cluster/usage-spool",
        description="A folder on each node's local disk where every LoRA replica and ingress writes "
        "each usage record as its request ends, until the usage store has it; the spool of a process "
        "killed without a graceful stop is sent by another one on the same node (docs/metering.md). "
        "`~` is the user's home. Empty: records wait in memory only (a killed replica loses its last "
        "`usage_flush_s`).",
    )
    usage_budget_refresh_s: float = Field(
        30.0, gt=0, le=3600,
        description="Each ingress reads the tenants' usage this month from the usage store this often, "
        "for their monthly budgets (`budget` in the tenants file; docs/metering.md): a budget check "
        "reads that copy, never the store, so its use is at most this old.",
    )
    usage_retention_s: float = Field(
        7 * 86400.0, gt=0,
        description="Per-request usage records are kept this long after their request ended; the "
        "per-minute sums are kept for good.",
    )
    usage_store_uri: str = Field(
        "", max_length=1024,
        description="A PostgreSQL database for the usage store instead of the SQLite file at "
        "usage_db_path: postgresql://user@host:port/dbname (libpq's URL; give the password by PGPASSWORD "
        "or ~/.pgpass on the usage store's node rather than in the URL). The tables are created on "
        "first use. Needs psycopg on that node (`pip install lora-cluster[postgres]`; without it the "
        "app does not start). Empty: the SQLite file.",
    )
    usage_export_uri: str = Field(
        "", max_length=1024,
        description="Where each closed minute's usage sums are also written as a Parquet file, for a "
        "billing pipeline (docs/metering.md): a folder (or file://) or s3://bucket/prefix, under "
        "`usage/date=YYYY-MM-DD/part-<minute>.parquet`; one file per minute, rewritten in place if the "
        "minute changes later. Needs pyarrow on the usage store's node (`pip install "
        "lora-cluster[parquet]`; without it the app does not start). Empty: no export.",
    )
    usage_export_interval_s: float = Field(
        60.0, gt=0, le=3600,
        description="How often the usage store writes the files of the minutes closed since "
        "(with usage_export_uri): a minute's file appears at most this long after the minute closed "
        "(usage_flush_s + 10 s after its end).",
    )

    @field_validator("usage_store_uri")
    @classmethod
    def _store_is_postgres(cls, value: str) -> str:
        if value and not value.startswith(("postgresql://", "postgres://")):
            raise ValueError("usage_store_uri is a postgresql:// URL (a SQLite file goes in usage_db_path)")
        return value

    @field_validator("open_routes")
    @classmethod
    def _open_routes_are_paths(cls, value: list[str]) -> list[str]:
        bad = [route for route in value if not route.startswith("/")]
        if bad:
            raise ValueError(f"open_routes lists {bad[0]!r}, which is not a path (it starts with '/')")
        return value


class MetricsConfig(BaseModel):
    """The observability section (`ServeConfig.metrics`, YAML `metrics:`): label cardinality of the
    request metrics, and log lines."""

    model_config = SECTION

    metrics_max_adapter_labels: int = Field(
        50, ge=0, le=10_000,
        description="Adapters that keep their own `adapter` label in the request metrics: the busiest "
        "ones over the last metrics_label_window_s; every other adapter is counted as adapter=\"other\" "
        "(bounded Prometheus cardinality; 0 = all \"other\").",
    )
    metrics_max_tenant_labels: int = Field(
        50, ge=0, le=10_000,
        description="Tenants that keep their own `tenant` label (the busiest ones, as for adapters); "
        "the others are tenant=\"other\".",
    )
    metrics_label_window_s: float = Field(
        300.0, gt=0, description="Window over which the busiest adapters and tenants are re-ranked."
    )
    log_format: Literal["text", "json"] = Field(
        "text",
        description="Format of lora-cluster's log lines in the ingress and replicas: text, or json (one "
        "object per line: ts, level, logger, message, request_id). Every line of a request carries its "
        "`x-request-id`.",
    )
    internal_access_log: bool = Field(
        False,
        description="Ray Serve's access line (`CALL <method> OK <ms>`) for every call between lora-cluster's "
        "own deployments: the ingress's calls to the LoRA replicas and the cluster controller, the replicas' "
        "reports, the registry, quota ledger and metrics hub (one to three lines per request). Off: on the "
        "demo server they cost 5% of the server's CPU per request (docs/soak.md, \"Serve's access lines\"), "
        "and lora-cluster's metrics count those calls. The ingress's HTTP access line (method, path, "
        "status, latency) is not one of them and follows the application's `logging_config` as before. "
        "These deployments get `logging_config: {enable_access_log: <this>}` from the application; "
        "serve_config.yaml's per-deployment `logging_config` still overrides it (log level, encoding).",
    )
