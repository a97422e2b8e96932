"""Tenants, API keys and quotas: pure policy, no Ray, no HTTP.

`tenants` parses and validates the tenants file and looks up API keys; `quota` holds the per-tenant
token buckets and concurrency counts; `watch` re-reads the tenants file when it changes;
`usage_record` and `usage_store` are metering's records (one per request) and their durable SQLite
store (docs/metering.md). The HTTP
side is `lora_cluster.serve.routing.auth` (the one authentication dependency) and
`lora_cluster.serve.routing.quotas` (the ledger shared by every ingress replica).
"""
