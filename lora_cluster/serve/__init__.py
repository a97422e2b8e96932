"""Ray Serve application of lora-cluster (see docs/serving.md).

`lora_cluster.serve.app:build_app` builds it; the modules, one concept each:
`app` (the graph), `ingress` (FastAPI deployment), `openai_api` / `lorax_api` / `admin_api` (routes),
`schemas` (request bodies), `errors` (exception -> HTTP status), `sse`, `dispatch` (ingress -> replicas),
`replica` (the engine deployment), `router` (Ray request router) and `routing` (its pure policy),
`protocol` (what ingress and replicas exchange), `model` (demo zoo, tokenizer).
This package imports nothing at import time, so the pure modules load without Ray.
"""
