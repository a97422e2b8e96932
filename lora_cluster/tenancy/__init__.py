"""Tenants, API keys and quotas: pure policy, no Ray, no HTTP.

`tenants` parses and validates the tenants file and looks up API keys; `quota` holds the per-tenant
token buckets and concurrency counts; `watch` re-reads the tenants file when it changes. The HTTP
side is `lora_cluster.serve.routing.auth` (the one authentication dependency) and
`lora_cluster.serve.routing.quotas` (the ledger shared by every ingress replica).
"""
