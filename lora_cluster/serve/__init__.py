"""Ray Serve application of lora-cluster (see docs/serving.md).

`lora_cluster.serve.app:build_app` builds it; the modules, one concept each:
`app` (the graph), `ingress` (FastAPI deployment), `openai_api` / `lorax_api` / `admin_api` (routes),
`context` (what the routes share), `registrations` (adapters loaded through the vLLM API), `registry`
(those of several ingress replicas), `openai_schemas` / `lorax_schemas` (request bodies), `schemas`
(what they share), `schema_limits` (the limits the OpenAPI schema states), `http_errors` (exception
-> HTTP status), `sse`, `dispatch` (ingress -> replicas), `replica` (the engine deployment),
`request_router` (Ray request router) and `affinity` (its pure policy), `ray_internals` (the private
Ray names we rely on), `protocol` (what ingress and replicas exchange), `model` (demo zoo,
tokenizer), `metrics` (Prometheus).
This package imports nothing at import time, so the pure modules load without Ray.
"""
